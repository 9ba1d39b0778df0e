"""Building a run config: YAML presets shipped in the package or files, then ``key=value`` overrides, then
``validate``. A malformed YAML file or override is one error naming it, the line and the column; a key
given twice is refused (``_repeated_key``, ``refuse_repeated_keys``)."""
from __future__ import annotations

import difflib
import warnings
from importlib import resources
from pathlib import Path

import yaml

from codraft.config.schema import ConfigError, RunConfig, _all_keys, _check_type, validate


def _yaml_load(text: str, where: str, column_offset: int = 0):
    """``yaml.safe_load``; a syntax error is one ConfigError line: ``where``, line, column, the problem."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        if mark is not None:
            line, column = mark.line, mark.column
        else:  # a ReaderError (a character YAML does not allow) has only a position
            pos = getattr(e, "position", 0)
            line, column = text.count("\n", 0, pos), pos - (text.rfind("\n", 0, pos) + 1)
        column += column_offset if line == 0 else 0
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML at line {line + 1}, column {column + 1}: {problem}") from None


def _coerce(key: str, value, typ: type, where: str | None = None, column_offset: int = 0):
    """Convert a YAML/CLI value to ``typ``; strings from the command line are parsed as YAML scalars."""
    if isinstance(value, str) and typ is not str:
        value = _yaml_load(value, where or f"value {value!r} of config key {key!r}", column_offset)
    if typ is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if typ is str and isinstance(value, list) and all(isinstance(x, (str, int, float)) for x in value):
        value = ",".join(str(x) for x in value)  # a YAML list of a comma-separated key (reward.funcs, weights)
    _check_type(key, value, typ)
    return value


def flatten(d: dict, prefix="") -> dict:
    """Nested sections -> {"section.key": value}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys that existed once, ignored with a warning so the config.yaml of an older run still loads.
RETIRED = {"rollout.speculate": "superseded by rollout.draft_length (auto sizes each round's drafts)"}


def apply(cfg: RunConfig, flat: dict, *, where: str | None = None, column_offset: int = 0) -> RunConfig:
    """Set each ``key: value`` of ``flat`` (types converted and checked; ranges: ``validate``).
    where/column_offset: the override the values come from, for YAML errors."""
    keys = _all_keys(RunConfig)
    for key, value in flat.items():
        if key in RETIRED:
            warnings.warn(f"config key {key!r} is retired ({RETIRED[key]}); ignored", stacklevel=2)
            continue
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(keys))}"
            raise ConfigError(f"unknown config key {key!r}{hint}")
        obj = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, _coerce(key, value, keys[key], where, column_offset))
    return cfg


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("codraft.configs").iterdir() if p.name.endswith(".yaml"))


def _read_source(name: str) -> tuple[str, dict]:
    """(how messages name it, its mapping) of ``--config NAME``: a preset name, else a file read as YAML
    whatever its extension."""
    path, yaml_suffix = Path(name), Path(name).suffix in (".yaml", ".yml")
    if name in preset_names():
        label, text = f"preset {name!r}", resources.files("codraft.configs").joinpath(f"{name}.yaml").read_text()
    elif path.is_file():
        label = f"config file {name!r}" + ("" if yaml_suffix else " (not a preset name: read as a YAML file)")
        try:
            text = path.read_text()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{label}: not a text file ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{label}: cannot be read ({e.strerror})") from None
    elif yaml_suffix:
        raise ConfigError(f"config file {name!r} does not exist")
    elif path.exists():
        raise ConfigError(f"config file {name!r} is not a file (and not a preset: {', '.join(preset_names())})")
    else:
        raise ConfigError(f"unknown preset {name!r} (presets: {', '.join(preset_names())}); "
                          f"no file {name!r} either")
    data = _yaml_load(text, label)
    repeated = _repeated_key(yaml.compose(text, Loader=yaml.SafeLoader), {})
    if repeated:  # yaml keeps the last silently
        raise ConfigError(f"{label}: {repeated}; give each key once")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: must be a mapping of keys (key: value lines), got a {type(data).__name__}")
    return label, data


def _split_override(item: str) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, value = item.split("=", 1)
    return key.strip(), value


def _repeated_key(node, seen: dict[str, int], prefix: str = "") -> str | None:
    """The first key a YAML document gives twice, with both lines: in one mapping, or written nested and
    dotted (``grpo: {lr: ..}`` and ``grpo.lr: ..``). ``seen``: dotted key -> line."""
    for k, v in node.value if isinstance(node, yaml.MappingNode) else ():
        if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
            key, line = prefix + k.value, k.start_mark.line + 1
            if key in seen:
                return f"config key {key!r} is given twice (lines {seen[key]} and {line})"
            seen[key] = line
            found = _repeated_key(v, seen, key + ".")
            if found:
                return found
    return None


def refuse_repeated_keys(overrides: list[str]):
    """``key=value`` overrides as a user gives them: a key twice is refused (``load_config`` lets the last
    win, for callers that layer their defaults under a user's overrides)."""
    first = {}
    for item in overrides:
        key = _split_override(item)[0]
        if key in first:
            raise ConfigError(f"config key {key!r} is given twice ({first[key]!r} and {item!r}); give it once")
        first[key] = item


def load_config(preset_or_file: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Preset name (e.g. "tiny") or YAML file, then `key=value` overrides, then ``validate``."""
    label, data = _read_source(preset_or_file or "tiny")
    try:
        cfg = apply(RunConfig(), flatten(data))
    except ConfigError as e:
        raise ConfigError(f"{label}: {e}") from None
    for item in overrides:
        key, value = _split_override(item)
        apply(cfg, {key: value}, where=f"override {item!r}", column_offset=len(item) - len(value))
    return validate(cfg)
