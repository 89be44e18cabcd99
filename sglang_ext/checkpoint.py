"""Read a checkpoint directory's metadata without loading weights: config.json and safetensors
headers (8-byte length + JSON), single-file or sharded. Pure Python, so it works on a laptop for a
1T-parameter target and never unpickles anything."""

from __future__ import annotations

import json
import os
import struct

from sglang_ext.conventions import ConfigError

INDEX_FILE = "model.safetensors.index.json"


def read_safetensors_header(path: str) -> dict[str, dict]:
    """{tensor name: {"dtype": str, "shape": [..]}} of one .safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError("safetensors", path, "file shorter than its 8-byte header length", "re-export it")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ConfigError("safetensors", path, f"header length {n} is implausible", "re-export it")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: {"dtype": v["dtype"], "shape": list(v["shape"])} for k, v in header.items()}


def safetensors_files(model_dir: str) -> list[str]:
    if not os.path.isdir(model_dir):
        return []
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    return sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))


def weight_shapes(model_dir: str) -> dict[str, dict]:
    """All tensors' dtypes and shapes in a checkpoint directory ({} if it has no safetensors)."""
    out: dict[str, dict] = {}
    for path in safetensors_files(model_dir):
        out.update(read_safetensors_header(path))
    return out


def fc_in_features(shapes: dict[str, dict]) -> int | None:
    """in_features of an Eagle3 head's fc (the aux-state projection), whatever its prefix."""
    for name, meta in shapes.items():
        if name == "fc.weight" or name.endswith(".fc.weight"):
            return int(meta["shape"][1])
    return None
