"""Read a checkpoint directory's metadata without loading weights: config.json and safetensors
headers (8-byte length + JSON), single-file or sharded. Pure Python, so it works on a laptop for a
1T-parameter target and never unpickles anything."""

from __future__ import annotations

import json
import os
import struct

from sglang_ext.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"


def directory_of(path: str) -> str:
    """The model directory a path names: itself, or the directory of the file (a config.json) it names."""
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def read_safetensors_header(path: str) -> dict[str, dict]:
    """{tensor name: {"dtype": str, "shape": [..]}} of one .safetensors file; a file that is not one
    (truncated, not JSON, malformed entries) is a ConfigError naming it."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ConfigError("safetensors", path, "file shorter than its 8-byte header length", "re-export it")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise ConfigError("safetensors", path, f"header length {n} is implausible", "re-export it")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ConfigError("safetensors", path, f"cannot read it ({e.strerror})", "check the file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError("safetensors", path, f"its header is not JSON ({e})", "re-export it") from None
    if not isinstance(header, dict):
        raise ConfigError("safetensors", path, "its header is not a JSON object", "re-export it")
    header.pop("__metadata__", None)
    out = {}
    for k, v in header.items():
        if not (isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v["shape"])):
            raise ConfigError("safetensors", path, f"tensor {k!r} has no valid dtype and shape in the header",
                              "re-export it")
        out[k] = {"dtype": v["dtype"], "shape": list(v["shape"])}
    return out


def read_index(model_dir: str) -> dict:
    """model.safetensors.index.json as {"weight_map": {name: file}, "metadata": {...}}, checked."""
    path = os.path.join(model_dir, INDEX_FILE)
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError("safetensors", path, f"cannot read the index ({e})", "fix or remove the index file") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ConfigError("safetensors", path, "no weight_map object in the index",
                          "write the index as {\"weight_map\": {tensor name: file}} or remove it")
    return index


def safetensors_files(model_dir: str) -> list[str]:
    if not os.path.isdir(model_dir):
        return []
    if os.path.exists(os.path.join(model_dir, INDEX_FILE)):
        names = sorted({str(v) for v in read_index(model_dir)["weight_map"].values()})
        missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise ConfigError("safetensors", os.path.join(model_dir, INDEX_FILE),
                              f"the index names {len(missing)} shard(s) that are not there: {missing[:3]}",
                              "copy the missing shards, or fix the index")
        return [os.path.join(model_dir, n) for n in names]
    return sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))


def pickle_weight_files(model_dir: str) -> list[str]:
    """Weight files in pickle formats (*.bin, *.pt, *.pth): never read here."""
    if not os.path.isdir(model_dir):
        return []
    return sorted(n for n in os.listdir(model_dir) if n.endswith((".bin", ".pt", ".pth")))


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}


def tensor_bytes(shapes: dict[str, dict]) -> int:
    total = 0
    for meta in shapes.values():
        n = 1
        for d in meta["shape"]:
            n *= d
        total += n * _DTYPE_BYTES.get(meta["dtype"], 2)
    return total


def checkpoint_bytes(model_dir: str) -> int | None:
    """A checkpoint's weight bytes: the index's metadata.total_size, else the sum over the safetensors
    headers; None without safetensors."""
    if not os.path.isdir(model_dir):
        return None
    if os.path.exists(os.path.join(model_dir, INDEX_FILE)):
        total = (read_index(model_dir).get("metadata") or {}).get("total_size")
        if isinstance(total, int) and total > 0:
            return total
    files = safetensors_files(model_dir)
    if not files:
        return None
    return sum(tensor_bytes(read_safetensors_header(f)) for f in files)


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
            if len(meta["shape"]) != 2:
                raise ConfigError(f"draft.weights[{name}]", meta["shape"], "not a 2-D matrix",
                                  "re-export the head (fc is [hidden, num_aux x target hidden])")
            return int(meta["shape"][1])
    return None
