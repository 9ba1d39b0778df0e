"""`codraft bench spec --dtypes float32,bfloat16` on a small saved policy: both rollout dtypes side by
side, every row tagged with its dtype and compared with the plain side of its own dtype; the HF side
decoding as many tokens as codraft's."""
import json

import torch

from codraft.cli import main


def test_bench_spec_compares_rollout_dtypes(tiny_policy_dir, tmp_path, capsys):
    out = tmp_path / "spec.json"
    main(["bench", "spec", "--models", str(tiny_policy_dir), "--batches", "1,2", "--max-new-tokens", "8",
          "--drafts", "ngram", "--repeats", "1", "--no-hf", "--threads", "1", "--dtypes", "bfloat16,float32",
          "--t1-rows", "3", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["settings"]["dtypes"] == ["float32", "bfloat16"]  # the baseline first
    rows = data["models"][str(tiny_policy_dir)]["rows"]
    sides = {(r["batch"], r["side"]): r for r in rows}
    for b in (1, 2):
        assert sides[b, "codraft plain"]["dtype"] == "float32" and sides[b, "codraft plain bf16"]["dtype"] == "bfloat16"
        spec = sides[b, "codraft spec/ngram bf16"]
        assert spec["dtype"] == "bfloat16" and spec["identical_to_plain"] is True  # greedy: the bf16 plain's tokens
        assert spec["new_tokens"] == b * 8
        # the rollout measure: 3 prompts per repetition, b per call (batch 2: 2 + 1), pooled
        assert len(spec["seconds_t1"]) == {1: 3, 2: 2}[b] and spec["stats_t1"]["rounds"] >= len(spec["seconds_t1"])
        st = spec["stats_t1"]  # a round's split: the target's verify, the draft's propose + commit
        assert spec["verify_ms_per_round_t1"] == 1e3 * st["verify_s"] / st["rounds"] > 0
        assert spec["draft_ms_per_round_t1"] == 1e3 * st["draft_s"] / st["rounds"] > 0
    summary = {s["dtype"]: s for s in data["summary"]}
    assert summary["bfloat16"]["weight_MB"] < 0.6 * summary["float32"]["weight_MB"]  # the matrices halve
    assert summary["bfloat16"]["speedup_vs_float32"] > 0
    printed = capsys.readouterr().out
    assert "plain decoding with bfloat16 rollout weights vs float32: batch 1" in printed
    assert "T=1 verify / draft ms a round" in printed


def test_hf_side_decodes_every_token_as_codraft_does(tiny_policy_dir):
    """Greedy rows run EOS off on every side. HF's generate() fills a setting left None from the
    model's own generation config, so a model whose config names an EOS stopped there: SmolLM2's HF
    rows stopped after 13 of 128 tokens, and "vs HF" timed mostly a prefill. Here the model's EOS is
    the first token it emits: the HF side still decodes all of them, the same tokens as codraft."""
    from transformers import AutoModelForCausalLM

    from codraft.bench import spec
    from codraft.policy import load_policy
    from codraft.rollout import Engine

    prompt, n = [1, 2, 3], 6
    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir))
        first = hf(torch.tensor([prompt])).logits[0, -1].argmax()
    (tiny_policy_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": int(first)}))
    side = spec._hf_side("hf generate", spec._load_hf(tiny_policy_dir), 0, n)
    tokens = side.run([prompt])["tokens"]
    policy, _, _ = load_policy(str(tiny_policy_dir))
    ours = Engine(policy.eval()).generate([prompt], n, temperature=0.0, eos_id=[])
    assert tokens == [ours[0].tokens] and tokens[0][0] == first and len(tokens[0]) == n


def test_rollout_calls_take_turns_across_sides(tiny_policy_dir, tmp_path, monkeypatch):
    """Each T = 1 call of a repetition runs on every side before the next call starts, so a change in the
    host's speed during the measure reaches every side alike (an earlier `auto` ran its whole share in a
    slow spell)."""
    from codraft.bench import spec

    order, make = [], spec._codraft_side

    def logged(name, *args, **kw):
        side = make(name, *args, **kw)
        run = side.run

        def run_logged(prompts, *a, temperature=0.0, **k):
            order.append((name, temperature, tuple(map(tuple, prompts))))
            return run(prompts, *a, temperature=temperature, **k)
        side.run = run_logged
        return side

    monkeypatch.setattr(spec, "_codraft_side", logged)
    main(["bench", "spec", "--models", str(tiny_policy_dir), "--batches", "1", "--max-new-tokens", "4",
          "--drafts", "ngram", "--gammas", "2,3", "--repeats", "2", "--no-hf", "--threads", "1",
          "--t1-rows", "3", "--json", str(tmp_path / "spec.json")])
    sampled = [(name, prompts) for name, t, prompts in order if t == 1.0]
    names = sorted({name for name, _ in sampled})
    assert len(names) == 3 and len(sampled) == 3 * 3 * 2  # plain, γ = 2, γ = 3; 3 calls; 2 repetitions
    for i in range(0, len(sampled), 3):  # one call, every side in turn, then the next call
        turn = sampled[i:i + 3]
        assert sorted(n for n, _ in turn) == names and len({p for _, p in turn}) == 1
