"""The package structure: every module imports on its own, and dependencies point one way.

Oracles: a fresh interpreter importing each module first (a cycle shows up as an ImportError
for some entry point), and the import statements themselves read from the source (AST), checked
against the allowed direction between packages.
"""
import ast
import subprocess
import sys
from pathlib import Path

import codraft

ROOT = Path(codraft.__file__).parent

# package -> the codraft packages it may import (besides itself). Leaves first.
ALLOWED = {
    "cache": set(), "atomic": set(), "tokenizer": set(), "spec": set(), "tasks": set(),
    "attention": set(),
    "kernels": {"models", "attention", "cache", "atomic"},
    "models": {"attention", "atomic", "cache"},
    "drafts": {"models", "kernels", "attention", "spec", "atomic"},
    "rollout": {"models", "kernels", "spec", "cache"},
    "envs": {"tasks", "rollout"},
    "train": {"models", "attention", "drafts", "rollout", "tasks", "tokenizer", "atomic", "cache"},
    "policy": {"models", "kernels", "rollout", "tasks", "tokenizer", "train", "atomic", "cache", "envs"},
    "parallel": {"models", "attention", "drafts"},
    "data": {"tasks"},
    "rewards": {"tasks", "data", "envs"},
    "config": {"drafts", "tasks", "envs", "rewards", "parallel"},
    "vllm": {"models", "rollout", "export"},
    "rl": {"models", "kernels", "attention", "drafts", "rollout", "tasks", "policy", "train", "config", "atomic",
           "parallel", "envs", "data", "rewards", "eval", "vllm"},
    "bench": {"models", "kernels", "drafts", "rollout", "tasks", "policy", "train", "rl", "config", "tokenizer",
              "attention", "spec", "parallel", "vllm"},
    "export": {"models", "kernels", "drafts", "train", "policy", "atomic"},
    "eval": {"atomic", "config", "data", "drafts", "envs", "export", "policy", "rewards", "rollout", "train"},
    "cli_bench": {"bench", "config"},
    "cli": {"bench", "cli_bench", "config", "drafts", "eval", "export", "models", "parallel", "policy", "rl",
            "rollout", "tasks", "train"},
    "__main__": {"cli"},
}
for _deps in ALLOWED.values():  # codraft.errors (the base of the deliberate errors) is a leaf every package uses
    _deps.add("errors")


def _modules() -> list[str]:
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported codraft module, whether the import sits inside a function) for each import."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module == "codraft":  # from codraft import kernels
                found.extend((f"codraft.{a.name}", in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("codraft"):
                found.append((child.module, in_function))
            elif isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names if a.name.startswith("codraft"))
            visit(child, nested)
    visit(tree, False)
    return found


def test_every_module_imports_first_in_a_fresh_interpreter():
    # one interpreter; codraft's modules are dropped from sys.modules before each import, so each
    # one is imported first (torch and the other third-party modules stay loaded: fast)
    code = (
        "import importlib, sys, traceback\n"
        f"mods = {_modules()!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    for k in [k for k in sys.modules if k == 'codraft' or k.startswith('codraft.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dependencies_point_one_way():
    wrong = []
    for module in _modules():
        src = _package(module)
        path = ROOT.parent / (module.replace(".", "/") + ".py")
        if not path.is_file():
            path = ROOT.parent / module.replace(".", "/") / "__init__.py"
        for target, _ in _imports(path):
            dst = _package(target)
            if dst and dst != src and dst not in ALLOWED.get(src, set()):
                wrong.append(f"{module} imports {target} ({src} -> {dst})")
    assert not wrong, "\n".join(wrong)


def test_no_function_level_imports_of_codraft():
    """Imports sit at module level (the CLI excepted: it loads a subcommand's machinery lazily so
    `codraft --help` stays instant)."""
    lazy = []
    for module in _modules():
        if module in ("codraft.cli", "codraft.cli_bench"):
            continue
        path = ROOT.parent / (module.replace(".", "/") + ".py")
        if not path.is_file():
            path = ROOT.parent / module.replace(".", "/") / "__init__.py"
        lazy += [f"{module} imports {t} inside a function" for t, inside in _imports(path) if inside]
    assert not lazy, "\n".join(lazy)


def test_the_checker_sees_a_violation(tmp_path):
    """The AST reader finds module- and function-level imports (so the tests above can fail)."""
    f = tmp_path / "m.py"
    f.write_text("from codraft.rl import trainer\nfrom codraft import kernels\n\n"
                 "def g():\n    import codraft.bench.spec\n")
    assert _imports(f) == [("codraft.rl", False), ("codraft.kernels", False), ("codraft.bench.spec", True)]
