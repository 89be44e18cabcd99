"""JSON values as configs hold them: integers that are not booleans, finite positive numbers, a config.json file."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from sglang_ext.errors import ConfigError


def is_int(value: Any) -> bool:
    """A JSON integer (not a bool, not a float, not a numeric string: transformers refuses those)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_number(value: Any) -> bool:
    """A JSON number > 0 and finite (not a bool, not a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_int(value: Any, field: str, minimum: int = 1) -> int:
    if not is_int(value):
        raise ConfigError(field, value, "not an integer", f"write it as a JSON integer (e.g. {max(minimum, 1)})")
    if value < minimum:
        raise ConfigError(field, value, f"must be at least {minimum}", f"set a value >= {minimum}")
    return value


def require_int(cfg: Mapping, key: str, prefix: str, minimum: int = 1) -> int:
    """A required integer field, at least `minimum`."""
    if key not in cfg or cfg[key] is None:
        raise ConfigError(prefix + key, None, "missing", f"set {key} in config.json")
    return check_int(cfg[key], prefix + key, minimum)


def load_json(path: str) -> dict:
    """A config.json (or a directory holding one) as a JSON object; anything else is a ConfigError."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not an error
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConfigError("path", path, "no config.json there",
                          "pass a model directory containing config.json, or the config.json itself") from None
    except IsADirectoryError:
        raise ConfigError("path", path, "is a directory, not a config file", "pass the model directory") from None
    except UnicodeDecodeError as e:
        raise ConfigError("path", path, f"config.json is not UTF-8 ({e.reason} at byte {e.start})",
                          "save it as UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise ConfigError("path", path, f"config.json is not valid JSON ({e})", "fix the file") from None
    except OSError as e:
        raise ConfigError("path", path, f"cannot read it ({e.strerror})", "check the path and its permissions") from None
    if not isinstance(cfg, dict):
        raise ConfigError("path", path, f"config.json holds a JSON {type(cfg).__name__}, not an object",
                          "write the config as a JSON object {...}")
    return cfg
