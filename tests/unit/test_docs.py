"""The user docs (README.md, docs/*.md) against the code and against themselves. Text checks only: no
model is built.

* docs/configuration.md's key tables list exactly the keys of ``codraft.config.RULES``;
* every relative link resolves to a file, and a ``#anchor`` to a heading of the target page (GitHub's
  slugs);
* "session" appears only in docs/history.md (the other pages are user docs), and not in the source;
* the keys a resume may change are listed as ``RESUMABLE`` has them;
* every ``codraft <subcommand>`` / ``codraft bench <name>`` in README.md's code is a real subcommand of
  ``codraft.cli.parser()``, its ``--options`` are that subcommand's and its ``key=value`` overrides are
  config keys;
* no page points at a removed script: of ``scripts/``, only ``scripts/device_check.py`` exists.

The last test feeds each check a broken page, so none of them can pass vacuously.
"""
from __future__ import annotations

import argparse
import functools
import re
import unicodedata
from pathlib import Path

import pytest

from codraft.cli import parser
from codraft.config import RULES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
HISTORY = ROOT / "docs" / "history.md"
KEPT_SCRIPTS = {"device_check.py"}

FENCE = re.compile(r"^(```|~~~)(?P<info>[^\n]*)\n(?P<body>.*?)^\1[ \t]*$", re.M | re.S)
INLINE = re.compile(r"(`+)(?P<code>.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(?P<text>.+?)[ \t#]*$", re.M)


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def without_fences(text: str) -> str:
    """``text`` with its fenced blocks blanked out (a '# comment' there is not a heading)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def without_code(text: str) -> str:
    """``text`` with fenced blocks and inline code blanked out (a link there is not a link)."""
    return INLINE.sub(lambda m: " " * len(m.group(0)), without_fences(text))


# ---------------------------------------------------------------- (a) configuration.md against RULES


def documented_keys(text: str) -> list[str]:
    """The first column of every table under '## Keys' whose header's first cell is 'key' (backticked)."""
    m = re.search(r"^## Keys[ \t]*\n(?P<body>.*?)(?=^## )", text, re.M | re.S)
    assert m, "docs/configuration.md has no '## Keys' section"
    keys, in_key_table = [], False
    for line in m.group("body").splitlines():
        if not line.startswith("|"):
            in_key_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_key_table:
            in_key_table = cells[0] == "key"  # a table's header row
            continue
        if set(cells[0]) <= set("-: "):
            continue  # the header's separator row
        key = re.fullmatch(r"`([^`]+)`", cells[0])
        assert key, f"docs/configuration.md: a key table row's first cell is not one backticked key: {line!r}"
        keys.append(key.group(1))
    return keys


def test_configuration_page_lists_every_key_once():
    keys = documented_keys((ROOT / "docs" / "configuration.md").read_text(encoding="utf-8"))
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    assert not repeated, f"docs/configuration.md lists these keys more than once: {repeated}"
    missing, unknown = sorted(set(RULES) - set(keys)), sorted(set(keys) - set(RULES))
    assert not missing and not unknown, (f"docs/configuration.md's key tables against codraft.config.RULES: "
                                         f"undocumented {missing}, not config keys {unknown}")


# ---------------------------------------------------------------- (b) relative links and anchors


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation and symbols dropped
    (letters, digits, marks, '_' and '-' kept), spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, repeats numbered -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(without_fences(text)):
        s = slug(m.group("text"))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(page: Path, text: str) -> list[str]:
    bad = []
    for m in LINK.finditer(without_code(text)):
        target = m.group("target")
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http:, https:, mailto:: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{_rel(page)}: link {target!r}: no such file {dest}")
        elif anchor and dest.suffix == ".md":
            if anchor not in anchors(dest.read_text(encoding="utf-8") if dest != page else text):
                bad.append(f"{_rel(page)}: link {target!r}: {dest.name} has no heading with anchor #{anchor}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    bad = broken_links(page, page.read_text(encoding="utf-8"))
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- (c) "session" only in history.md


def mentions_session(text: str) -> list[str]:
    return [f"line {i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
            if re.search("session", line, re.I)]


@pytest.mark.parametrize("page", [p for p in PAGES if p != HISTORY], ids=_rel)
def test_session_only_in_history(page):
    found = mentions_session(page.read_text(encoding="utf-8"))
    assert not found, f"{_rel(page)} says 'session' (only docs/history.md may):\n" + "\n".join(found)


def test_no_session_in_the_source():
    """Code and tests cite docs and measurements, not the work's history (subprocess's
    ``start_new_session`` and pytest's ``scope="session"`` are API names; this file names the word it checks)."""
    files = [f for f in sorted([*(ROOT / "codraft").rglob("*.py"), *(ROOT / "tests").rglob("*.py")])
             if f != Path(__file__).resolve()]
    api = ("start_new_session", 'scope="session"')
    found = [f"{_rel(f)} {hit}" for f in files
             for hit in mentions_session(functools.reduce(lambda text, name: text.replace(name, ""), api,
                                                          f.read_text(encoding="utf-8")))]
    assert not found, "source says 'session':\n" + "\n".join(found)


# ---------------------------------------------------------------- (c') the resumable keys, as documented

def test_the_resumable_keys_are_the_documented_ones():
    from codraft.rl.runs import RESUMABLE
    section = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8").split("## Keys a resume may change")[1]
    listed = re.findall(r"`([a-z_]+(?:\.[a-z_]+)?)`", section.split("\n## ")[0])
    assert set(listed) == set(RESUMABLE), f"docs/configuration.md lists {sorted(set(listed) ^ set(RESUMABLE))} wrongly"


# ---------------------------------------------------------------- (d) README's commands against the CLI


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction))


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def code_texts(text: str) -> list[str]:
    """Shell code of a page: each line of its fenced blocks that are not Python (continuation lines
    joined, comments dropped), and each inline code span."""
    out = []
    for m in FENCE.finditer(text):
        if m.group("info").strip().lower() in ("python", "py", "json", "yaml", "text"):
            continue
        for line in m.group("body").replace("\\\n", " ").splitlines():
            out.append(re.sub(r"(^|\s)#.*", "", line))
    rest = FENCE.sub("", text)
    out += [m.group("code") for m in INLINE.finditer(rest)]
    return out


def _placeholder(token: str) -> bool:
    return bool(re.fullmatch(r"[A-Z][A-Z0-9_]*\W*", token))  # CMD, NAME, RUN_DIR ...


def command_errors(text: str, where: str) -> list[str]:
    """Every ``codraft SUB [NAME] ...`` in the code of ``text`` checked against ``codraft.cli.parser()``."""
    top = _subparsers(parser())
    bad = []
    for code in code_texts(text):
        for m in re.finditer(r"(?<![\w./-])codraft[ \t\n]+(?P<rest>[^`\n]*(?:\n[^`\n]*)*)", code):
            tokens = m.group("rest").split()
            if not tokens or _placeholder(tokens[0]):
                continue
            sub, args = tokens[0], tokens[1:]
            if sub.startswith("-"):
                continue  # `codraft --help`
            if sub not in top:
                bad.append(f"{where}: `codraft {sub}` is not a codraft subcommand ({', '.join(top)})")
                continue
            commands = [(sub, top[sub])]
            if sub == "bench":
                if not args or _placeholder(args[0]):
                    continue
                benches = _subparsers(top["bench"])
                commands = []
                for name in args[0].split("|"):  # `codraft bench spec|gemv|...`
                    if name not in benches:
                        bad.append(f"{where}: `codraft bench {name}` is not a benchmark ({', '.join(benches)})")
                    else:
                        commands.append((f"bench {name}", benches[name]))
                args = args[1:]
            for what, p in commands:
                for tok in args:
                    if tok in ("&&", "||", ";", "|") or tok.startswith("#"):
                        break  # the next command
                    opt = re.match(r"\[?(--[a-z][\w-]*)", tok)
                    if opt and opt.group(1) not in _options(p):
                        bad.append(f"{where}: `codraft {what}` has no option {opt.group(1)}")
                    key = re.fullmatch(r"\[?([a-z_]+(?:\.[a-z_]+)*)=\S*", tok)
                    if key and key.group(1) not in RULES:
                        bad.append(f"{where}: `codraft {what} {tok}`: {key.group(1)!r} is not a config key")
    return bad


def test_readme_commands_exist():
    bad = command_errors(README.read_text(encoding="utf-8"), "README.md")
    assert not bad, "\n".join(bad)


def test_readme_tour_lists_every_benchmark():
    """The README's `codraft bench a|b|...` names every benchmark the CLI has."""
    benches = set(_subparsers(_subparsers(parser())["bench"]))
    listed = set()
    for code in code_texts(README.read_text(encoding="utf-8")):
        for m in re.finditer(r"codraft bench (\S+)", code):
            listed |= set(m.group(1).split("|"))
    assert benches <= listed, f"README.md does not mention `codraft bench` {sorted(benches - listed)}"


# ---------------------------------------------------------------- (e) no removed scripts


def script_references(text: str) -> list[str]:
    return [m.group(0) for m in re.finditer(r"scripts/([\w*?.-]+)", text) if m.group(1) not in KEPT_SCRIPTS]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_removed_scripts(page):
    found = script_references(page.read_text(encoding="utf-8"))
    assert not found, (f"{_rel(page)} points at scripts that no longer exist (only scripts/device_check.py "
                       f"remains): {found}")
    for name in KEPT_SCRIPTS:
        assert (ROOT / "scripts" / name).is_file()


# ---------------------------------------------------------------- each check fails on a broken page


def test_checks_catch_broken_pages():
    conf = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    dropped = conf.replace("| `steps` |", "| `stepz` |", 1)
    assert dropped != conf and "steps" not in documented_keys(dropped) and "stepz" in documented_keys(dropped)

    page = ROOT / "docs" / "benchmarks.md"
    assert broken_links(page, "[x](no-such-page.md)")
    assert broken_links(page, "[x](configuration.md#no-such-heading)")
    assert broken_links(page, "[x](#no-such-heading)\n\n# A heading\n")
    assert not broken_links(page, "[x](configuration.md#keys-a-resume-may-change) [y](#a-heading)\n# A heading\n")
    assert not broken_links(page, "`[x](no-such-page.md)`")  # code, not a link
    assert slug("The first fast-path timing's memory") == "the-first-fast-path-timings-memory"
    assert slug("Draft length (`rollout.draft_length=auto`)") == "draft-length-rolloutdraft_lengthauto"
    assert anchors("# A\n## A\n") == {"a", "a-1"}
    assert anchors("# `codraft bench spec`: speed\n```\n# not a heading\n```\n") == {"codraft-bench-spec-speed"}

    assert mentions_session("Work done in Session 3.") and not mentions_session("a run, a step")

    assert command_errors("`codraft trian steps=3`", "x")
    assert command_errors("`codraft bench speed`", "x")
    assert command_errors("`codraft bench spec|gemv|nope`", "x")
    assert command_errors("```bash\ncodraft generate --model m --no-such-flag\n```\n", "x")
    assert command_errors("`codraft train draft.kinds=dspark`", "x")
    assert command_errors("```\ntorchrun --nproc-per-node 2 -m codraft train parallel.ccp=2\n```\n", "x")
    assert not command_errors("`codraft train --resume RUN_DIR [steps=N ...]` `codraft CMD: error: ...` "
                              "`codraft bench draft-length --batch 8 --dtype bfloat16` "
                              "\n```python\nfrom codraft import kernels\n```\n", "x")

    assert script_references("python scripts/precision_ab.py 6") == ["scripts/precision_ab.py"]
    assert script_references("`scripts/*.py`") and script_references("scripts/gemv_harness.c")
    assert not script_references("python scripts/device_check.py --device cuda")
