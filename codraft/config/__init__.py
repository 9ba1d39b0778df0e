"""Run configuration: typed sections, YAML presets shipped in the package, `key=value` overrides.

Everything is validated before any work starts (``load_config`` and ``Trainer`` both run
``validate``): an unknown key names the closest valid keys, a wrong type names the key and the
expected type, a value out of range names the key, the value and the allowed range (``RULES``:
one row per key; ``CROSS_RULES``: rules between keys), a malformed YAML file or override names
the file or the override and the line and column. The resolved config is what gets saved in the
run folder, so a run can be reproduced from it alone.

``schema``: the sections, their keys and defaults, ``validate``; ``rules``: what each key allows;
``taps``: the EAGLE-3 draft's taps; ``loading``: presets, YAML files and overrides.
"""
from codraft.config.loading import RETIRED, apply, flatten, load_config, preset_names, refuse_repeated_keys
from codraft.config.rules import (COUNT, CROSS_RULES, EVERY, NON_NEGATIVE, POSITIVE, PRECISION, RULES, Device,
                                  Flag, OneOf, Range, Text)
from codraft.config.schema import (ConfigError, DataConfig, DraftConfig, EnvConfig, GRPOConfig, LogConfig, ParallelConfig,
                                   PolicyConfig, RewardConfig, RolloutConfig, RunConfig, TaskConfig, _all_keys, check_policy,
                                   check_taps, validate)
from codraft.config.taps import Taps, taps_problem

__all__ = ["COUNT", "CROSS_RULES", "EVERY", "NON_NEGATIVE", "POSITIVE", "PRECISION", "RETIRED", "RULES",
           "ConfigError", "DataConfig", "Device", "DraftConfig", "EnvConfig", "Flag", "GRPOConfig", "LogConfig", "OneOf",
           "ParallelConfig", "PolicyConfig", "Range", "RewardConfig", "RolloutConfig", "RunConfig", "Taps", "TaskConfig", "Text",
           "apply", "check_policy", "check_taps", "flatten", "load_config", "preset_names", "refuse_repeated_keys",
           "taps_problem", "validate"]
