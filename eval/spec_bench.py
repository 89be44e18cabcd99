"""`eagle3-spec-bench` (`python -m sglang_ext spec-bench`): speculation speedup on a Kimi-K2.5-shaped target against
upstream SGLang EAGLE3 and against the physical bound, side by side in one run (one GPU).

1. `build`: a DeepseekV3 target with Kimi-K2.5's per-layer shapes (hidden 7168, 64 MLA heads,
   q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v 128, dense MLP 18432, vocab 163840; `--layers`
   of them) served with `--load-format dummy` (no weight files), and ~1B-parameter random Eagle3 heads
   of the matching size in the MHA and the MLA layout (weights written on the GPU machine from
   `sglang_ext.config.weights`, so names and shapes are what SGLang loads). Chat prompts come from
   a small ChatML tokenizer saved with the target.
2. Arms, one server at a time (`ARMS`): no speculation; upstream EAGLE3 (plugin excluded with
   `SGLANG_PLUGINS`); the plugin with chain, with an MLA head, with tree drafting, with fp8 draft KV
   -- all at the same synthetic acceptance (`SGLANG_SIMULATE_ACC_LEN`, default 3.0 tokens per step =
   2 accepted drafts); and a draft that never accepts (random head, no simulation) without and with
   the cost-model protection (`--speculative-adaptive`, `SGLANG_EXT_ADAPTIVE_POLICY=cost`).
3. Each arm: output tokens/s and TPOT at each concurrency (fixed input and output lengths,
   chat-formatted, `ignore_eos`), `--repeats` times, after an untimed warm-up pass and a prefill pass per
   level (`run_arm`); each request's start, first token and end; the server's KV pool lines.
4. `report`: ratios (plugin/upstream, spec/no-spec, achieved/bound with c measured from the
   zero-acceptance arm at concurrency 1: TPOT_zero = TPOT_nospec x (1 + k c)), min-max over repeats,
   fp8 vs bf16 draft pool tokens and max running requests; writes benchmarks.md, report.json and a PNG.
5. `bound`: chain arms at concurrency 1 against the bound the weights read set (`weight_bytes_bound`: a cycle reads
   the target once and the head once per step, and yields 1 + accepted tokens), by TPOT and by throughput.

Resumable: results accumulate in WORK/state.json, so the arms can be spread over several calls; `run` writes each
level as it is measured (an arm stopped by a time limit keeps its levels, marked unfinished, and `all` redoes it).

    eagle3-spec-bench build
    eagle3-spec-bench run ARM [ARM ...]
    eagle3-spec-bench report --out docs/benchmarks.md
    eagle3-spec-bench bound ARM [ARM ...] --state STATE
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import time

from sglang_ext.commands import VERSION, prog
from sglang_ext.plotting import pyplot

WORK = os.environ.get("SPEC_BENCH_WORK", "/tmp/specbench")
KIMI = dict(hidden_size=7168, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432, vocab_size=163840)
STEPS = 3
CHAIN = ["--speculative-num-steps", str(STEPS), "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", str(STEPS + 1)]
TREE = ["--speculative-num-steps", str(STEPS), "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]
SIM = "SGLANG_SIMULATE_ACC_LEN"
# upstream's verify kernel inside the plugin (the plugin's default verifies MLA chains as decode attention):
# the arms named without "verify-decode" keep the meaning they had in earlier runs' state files
EXTEND = {"SGLANG_EXT_MLA_VERIFY": "extend"}
DECODE = {"SGLANG_EXT_MLA_VERIFY": "decode"}
# depth 0 of the protection as upstream runs it (a one-token verify): what the protected arms of runs 1-3 measured
VERIFY0 = {"SGLANG_EXT_ADAPTIVE_DEPTH0": "verify"}
# name: (head or None, drafting args, env, simulated)
ARMS = {
    "nospec": (None, [], {}, False),
    "upstream-chain": ("mha-upstream", CHAIN, {"SGLANG_PLUGINS": "none"}, True),
    "plugin-chain": ("mha", CHAIN, EXTEND, True),
    # verify of the MLA target as grouped decode attention (sglang_ext.serving.mla_verify; chains: the default)
    "plugin-chain-verify-decode": ("mha", CHAIN, DECODE, True),
    "zero-accept-verify-decode": ("mha", CHAIN, DECODE, False),
    "plugin-tree-verify-decode": ("mha", TREE, DECODE, True),
    # the protection with depth 0 as upstream's one-token verify (as decode attention), no draft extend
    "zero-accept-protected-verify-decode": ("mha", CHAIN + ["--speculative-adaptive"],
                                            {"SGLANG_EXT_ADAPTIVE_POLICY": "cost", **DECODE, **VERIFY0,
                                             "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"}, False),
    # the protection as shipped: depth 0 is the target's plain decode step (serving/decode_depth0.py); a draft
    # that never accepts, so no draft extend at depth 0
    "zero-accept-protected-decode0": ("mha", CHAIN + ["--speculative-adaptive"],
                                      {"SGLANG_EXT_ADAPTIVE_POLICY": "cost",
                                       "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"}, False),
    # the protection at zero acceptance: depth 0's draft extend only in the steps before a probe
    # (SGLANG_EXT_ADAPTIVE_DEPTH0_DRAFT_EXTEND unset = warm; the arm above never runs it), and the draft's prefill
    # over every prompt row as upstream (--speculative-draft-prefill full: this arm's meaning in earlier state files)
    "zero-accept-protected-warm": ("mha", CHAIN + ["--speculative-adaptive"],
                                   {"SGLANG_EXT_ADAPTIVE_POLICY": "cost", "SGLANG_EXT_DRAFT_PREFILL": "full"}, False),
    # the same with the draft's prefill computing its last layer's output projection and MLP only at each request's
    # last token (--speculative-draft-prefill last, the default): the protection as shipped
    "zero-accept-protected-warm-last-prefill": ("mha", CHAIN + ["--speculative-adaptive"],
                                                {"SGLANG_EXT_ADAPTIVE_POLICY": "cost",
                                                 "SGLANG_EXT_DRAFT_PREFILL": "last"}, False),
    # the protection at the synthetic acceptance of the chain arms: it must keep the gain where drafting pays
    # and stop where it does not (depth 0's draft extend as shipped: only before a probe)
    "chain-protected-decode0": ("mha", CHAIN + ["--speculative-adaptive"], {"SGLANG_EXT_ADAPTIVE_POLICY": "cost"},
                                True),
    # the protection where drafting barely pays: 0.5 accepted drafts per step (SGLang's "match-expected" sampling
    # of 1.5 tokens per step: the first draft accepted on half the steps, the others never), the break-even region
    # where a wrong choice of depth costs most
    "low-accept-protected-decode0": ("mha", CHAIN + ["--speculative-adaptive"],
                                     {"SGLANG_EXT_ADAPTIVE_POLICY": "cost", SIM: "1.5"}, False),
    # the draft's format and KV dtype, at the plugin's defaults (chains verified as decode attention)
    "plugin-mla-chain": ("mla", CHAIN, {}, True),
    "plugin-mla-tree": ("mla", TREE, {}, True),
    "plugin-fp8": ("mha", CHAIN, {"SGLANG_EXT_DRAFT_KV_CACHE_DTYPE": "fp8_e4m3"}, True),
    "plugin-tree": ("mha", TREE, EXTEND, True),
    "zero-accept": ("mha", CHAIN, EXTEND, False),
    "zero-accept-protected": ("mha", CHAIN + ["--speculative-adaptive"], {"SGLANG_EXT_ADAPTIVE_POLICY": "cost",
                                                                          **EXTEND, **VERIFY0}, False),
    # upstream and the plugin at their defaults, each head format and drafting shape (what an FA3 server runs)
    "plugin-mha-chain": ("mha", CHAIN, {}, True),
    "upstream-mla-chain": ("mla", CHAIN, {"SGLANG_PLUGINS": "none"}, True),
    "upstream-tree": ("mha-upstream", TREE, {"SGLANG_PLUGINS": "none"}, True),
    "plugin-mha-tree": ("mha", TREE, {}, True),
    "upstream-zero-accept": ("mha-upstream", CHAIN, {"SGLANG_PLUGINS": "none"}, False),
    # the automatic drafting shape (--speculative-adaptive-shapes tree): started as the tree, the cost policy chooses
    # the tree, a chain depth or no drafting per batch size. At simulated acceptance (the same accepted drafts for
    # every shape) the chain must win; with a head that never accepts, no drafting
    "auto-shape": ("mha", TREE + ["--speculative-adaptive"], {"SGLANG_EXT_ADAPTIVE_POLICY": "cost",
                                                             "SGLANG_EXT_ADAPTIVE_SHAPES": "tree"}, True),
    "mla-auto-shape": ("mla", TREE + ["--speculative-adaptive"], {"SGLANG_EXT_ADAPTIVE_POLICY": "cost",
                                                                 "SGLANG_EXT_ADAPTIVE_SHAPES": "tree"}, True),
    "zero-accept-auto-shape": ("mha", TREE + ["--speculative-adaptive"], {"SGLANG_EXT_ADAPTIVE_POLICY": "cost",
                                                                         "SGLANG_EXT_ADAPTIVE_SHAPES": "tree"}, False),
}


# the order `all` runs them in: what the ratios need first (c comes from zero-accept at batch 1)
PRIORITY = ["nospec", "zero-accept-protected-warm", "low-accept-protected-decode0", "chain-protected-decode0",
            "zero-accept-protected-decode0",
            "plugin-chain-verify-decode",
            "zero-accept-verify-decode", "plugin-chain", "upstream-chain", "plugin-fp8", "plugin-mla-chain",
            "zero-accept-protected-verify-decode", "zero-accept", "plugin-tree-verify-decode",
            "zero-accept-protected", "plugin-tree", "plugin-mla-tree"]


# ------------------------------------------------------------------------------------ build
# DeepSeek-V3's own checkpoint format (its config.json): fp8 e4m3 linear weights with a float32 scale per 128 x 128
# block, activations quantized per token group at run time; embeddings, norms and the LM head stay bf16. Half the
# bytes of bf16: a 61-layer target fits one 80 GB card.
FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
TARGET_WEIGHTS = ("bf16", "fp8")


def target_config(layers: int, weights: str = "bf16") -> dict:
    if weights not in TARGET_WEIGHTS:
        raise ValueError(f"target weights {weights!r}: choose one of {', '.join(TARGET_WEIGHTS)}")
    quant = {"quantization_config": dict(FP8_BLOCK)} if weights == "fp8" else {}
    return dict(KIMI, **quant, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                num_hidden_layers=layers,
                num_key_value_heads=KIMI["num_attention_heads"], first_k_dense_replace=layers, moe_layer_freq=1,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=2048,
                n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5,
                norm_topk_prob=True, num_nextn_predict_layers=0, ep_size=1, hidden_act="silu", rms_norm_eps=1e-6,
                max_position_embeddings=8192, rope_theta=50000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                bos_token_id=0, eos_token_id=2, pad_token_id=0, attention_bias=False)


def head_config(fmt: str, layers: int, draft_vocab: int = 32000) -> dict:
    from sglang_ext.config.aux_layers import default_output_ids

    cfg = dict(hidden_size=KIMI["hidden_size"], intermediate_size=KIMI["intermediate_size"],
               num_attention_heads=KIMI["num_attention_heads"], vocab_size=KIMI["vocab_size"],
               draft_vocab_size=draft_vocab, target_hidden_size=KIMI["hidden_size"], num_hidden_layers=1,
               rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=8192, hidden_act="silu",
               tie_word_embeddings=False, torch_dtype="bfloat16",
               eagle_config={"use_aux_hidden_state": True, "aux_layer_convention": "output",
                             "eagle_aux_hidden_state_layer_ids": default_output_ids(layers)})
    if fmt == "mha":
        cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_key_value_heads=8, head_dim=128)
    else:
        cfg.update({k: KIMI[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                         "v_head_dim")},
                   architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="deepseek_v3",
                   num_key_value_heads=KIMI["num_attention_heads"], first_k_dense_replace=1, moe_layer_freq=1,
                   num_nextn_predict_layers=0, moe_intermediate_size=KIMI["intermediate_size"])
    return cfg


def write_head(out_dir: str, cfg: dict, fmt: str, device: str = "cuda", std: float = 0.02, seed: int = 0) -> int:
    """Random weights for every tensor SGLang's loader expects (the format's weight map)."""
    import torch
    from safetensors.torch import save_file

    from sglang_ext.config import Eagle3DraftConfig, weight_map

    required, _ = weight_map(fmt).expected(Eagle3DraftConfig.from_dict(cfg))
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in required.items():
        if name == "d2t":
            tensors[name] = torch.zeros(shape, dtype=torch.int64)  # draft id i = target id i
        elif name.endswith("norm.weight") or "layernorm" in name or "norm." in name:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=g, device=device) * std).to(torch.bfloat16).cpu()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=1)
    return sum(t.numel() for t in tensors.values())


def upstream_copy(src: str, dst: str) -> None:
    """The MHA head with its ids in upstream's reading (undeclared, SGLang convention)."""
    import shutil

    from sglang_ext.config.aux_layers import from_output_ids

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    from sglang_ext.config.values import load_json

    cfg = load_json(dst)
    eagle = cfg["eagle_config"]
    eagle["eagle_aux_hidden_state_layer_ids"] = from_output_ids(eagle["eagle_aux_hidden_state_layer_ids"], "sglang")
    eagle.pop("aux_layer_convention", None)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)


def build(layers: int, device: str = "cuda", weights: str = "bf16") -> dict:
    """The target's config (weights dummy-loaded by every server: `--load-format dummy`), its tokenizer, and random
    heads of both formats (bf16 whatever the target's weights, as trained heads ship)."""
    from sglang_ext.core import tiny

    t = time.time()
    os.makedirs(f"{WORK}/target", exist_ok=True)
    json.dump(target_config(layers, weights), open(f"{WORK}/target/config.json", "w"), indent=1)
    tok = tiny.train_tokenizer(512)
    tok.save_pretrained(f"{WORK}/target")
    json.dump({"eos_token_id": tok.eos_token_id, "do_sample": False}, open(f"{WORK}/target/generation_config.json", "w"))
    params = {}
    for fmt in ("mha", "mla"):
        params[fmt] = write_head(f"{WORK}/head-{fmt}", head_config(fmt, layers), fmt, device)
        tok.save_pretrained(f"{WORK}/head-{fmt}")
    upstream_copy(f"{WORK}/head-mha", f"{WORK}/head-mha-upstream")
    return {"layers": layers, "target_weights": weights, "head_params": params, "build_s": time.time() - t}


# --------------------------------------------------------------------------------- measure
def prompts(n: int, input_len: int, seed: int = 0) -> list[str]:
    """Chat-formatted prompts of `input_len` tokens (the tiny ChatML tokenizer saved with the target)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(f"{WORK}/target")
    rng = random.Random(seed)
    words = ["the", "number", "of", "apples", "is", "what", "total", "cost", "each", "has", "many", "how"]
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(input_len))
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        head, tail = ids[:4], ids[-6:]
        body = ids[4:-6][: max(0, input_len - len(head) - len(tail))]
        out.append(tok.decode(head + body + tail))
    return out


def serverlib():
    """tests/gpu/serverlib.py: the server process helpers the GPU checks share. A checkout's (the wheel has no tests/):
    the one beside this file (a checkout, an editable install), else the working directory's (an installed wheel run
    from a checkout's root, as tests/gpu/launch.sh does)."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu")
    paths = [here, os.path.join(os.getcwd(), "tests", "gpu")]
    path = next((p for p in paths if os.path.isfile(os.path.join(p, "serverlib.py"))), None)
    if path is None:
        raise SystemExit(f"{prog('bench')}: error: no tests/gpu/serverlib.py in {' or '.join(dict.fromkeys(paths))}: "
                         "the servers start from a checkout of the repository (run from its root)")
    if path not in sys.path:
        sys.path.insert(0, path)
    import serverlib as lib

    return lib


# The running limit is twice the largest concurrency measured (`max_bs`, also the largest CUDA-graph batch). At a limit
# equal to the concurrency, SGLang 0.5.17's scheduler sometimes admitted one request of a level's second wave only when
# the rest of that wave had finished (likely: a prefill pass that finds no request slot free sets `batch_is_full`,
# and only a running request finishing clears it). Every slow c = 64 repeat of the 2026-12-02 and 2026-12-04 FA3 runs
# had such a request (`bench.held_requests`), in every kind of arm: c = 64 medians moved by 10-25% with no difference
# between the servers (docs/benchmarks.md). Clients never exceed the concurrency, so a higher limit changes nothing
# else.
RUNNING_HEADROOM = 2


def server_args(arm: str, max_bs: int, mem_fraction: float, backend: str | None = None,
                max_total_tokens: int | None = None) -> tuple[list[str], dict]:
    """`backend` None: no --attention-backend, SGLang's own choice (fa3 for this MLA target on Hopper)."""
    head, drafting, env, simulated = ARMS[arm]
    tp_args = serverlib().tp_args
    bs = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if b <= max_bs]
    args = ["--model-path", f"{WORK}/target", "--load-format", "dummy",
            *(["--attention-backend", backend] if backend else []),
            "--mem-fraction-static", str(mem_fraction), "--max-running-requests", str(RUNNING_HEADROOM * max_bs),
            "--cuda-graph-bs-decode", *map(str, bs), "--disable-prefill-cuda-graph",
            *(["--max-total-tokens", str(max_total_tokens)] if max_total_tokens else []),
            *tp_args(int(os.environ.get("SPEC_BENCH_TP", "1")))]  # TP=2 on nvidia-h200-x2 (the TP issue)
    if head is not None:
        args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", f"{WORK}/head-{head}",
                 *drafting]
    env = dict(env, SGLANG_LOG_MS="1")  # log times to the millisecond: the policy's probes against each repeat
    if simulated:
        env[SIM] = os.environ.get("SPEC_BENCH_SIM", "3.0")
    return args, env


def pool_facts(log: str) -> dict:
    out = {}
    m = re.search(r"draft KV pool allocated: (\d+) tokens, ([\d.]+) GiB, (\d+) B/token", log)
    if m:
        out.update(draft_pool_tokens=int(m.group(1)), draft_pool_gib=float(m.group(2)),
                   draft_bytes_per_token=int(m.group(3)))
    m = re.search(r"max_total_num_tokens=(\d+)", log)
    if m:
        out["max_total_num_tokens"] = int(m.group(1))
    m = re.search(r"max_running_requests=(\d+)", log)
    if m:
        out["max_running_requests"] = int(m.group(1))
    # SGLang retracts decoding requests when the next decode step's KV does not fit (they are prefilled again
    # later): requests counted once per retraction, so a server that retracts pays prefills the others do not
    retracted = [int(n) for n in re.findall(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)", log)]
    out["retracted_requests"] = sum(retracted)
    return out


def trace_summary(path: str, steps: int, top: int = 12) -> dict:
    """From a torch profiler trace (chrome JSON, as SGLang's /start_profile writes it): the profiled
    window, how much of it the GPU was busy (union of kernel intervals), and the top kernels by time --
    a GPU far less busy than the window says the step is bound by the host, not by kernels."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "?")) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not kernels:
        return {"error": f"no GPU events in {path}"}
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("ph") == "X" and "ts" in e]
    window = max(b for _, b in spans) - min(a for a, _ in spans)
    busy, end = 0.0, -1.0
    for a, b, _ in kernels:  # union of intervals (kernels of several streams may overlap)
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name: dict[str, float] = {}
    for a, b, name in kernels:
        by_name[name] = by_name.get(name, 0.0) + (b - a)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"window_ms": window / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_busy_fraction": busy / window if window else 0,
            "steps": steps, "top_kernels_ms_per_step": [(n[:90], round(t / 1e3 / steps, 3)) for n, t in ranked]}


def repeat_seed(concurrency: int, repeat: int) -> int:
    """Each repeat of a level sends prompts no earlier request sent, the same in every arm. With one prompt set
    per level (runs 1-4), the second repeat found its prefixes in the radix cache: its first tokens came
    3-5x sooner, and output tokens/s rose 10-54% at 32-128 requests in every arm. That is a cold-cache/warm-cache
    difference, not run-to-run noise."""
    return 1000 * concurrency + repeat


def profile_level(srv, ps: list[str], concurrency: int, output_len: int, steps: int, out_dir: str,
                  delay_s: float = 3.0) -> dict:
    """Profile `steps` scheduler steps `delay_s` seconds into a run at `concurrency` (SGLang's /start_profile)."""
    import glob
    import threading

    from sglang_ext.eval.bench import run_arm as measure

    os.makedirs(out_dir, exist_ok=True)
    before = set(glob.glob(f"{out_dir}/**/*.json*", recursive=True))
    load = threading.Thread(target=measure, args=(srv.url, ps, concurrency, [output_len] * len(ps)))
    load.start()
    time.sleep(delay_s)  # past the prefills (3 s: the first wave's decode at full concurrency)
    # without stacks and shapes (SGLang's defaults record both): their host cost would make the steps look
    # more host-bound than they are; kernel times are unaffected
    srv.post("/start_profile", {"output_dir": out_dir, "num_steps": steps, "activities": ["CPU", "GPU"],
                                "with_stack": False, "record_shapes": False})
    load.join()
    for _ in range(120):  # the trace is written after the last profiled step
        new = sorted(set(glob.glob(f"{out_dir}/**/*.json*", recursive=True)) - before)
        if new:
            time.sleep(2)
            return dict(trace_summary(new[0], steps), trace=os.path.basename(new[0]))
        time.sleep(1)
    return {"error": "no trace written"}


def level_seed(concurrency: int, purpose: str) -> int:
    """Prompt seeds of a level's untimed passes, apart from every repeat's (`repeat_seed`)."""
    return 1000 * concurrency + {"warmup": 900, "prefill": 800}[purpose]


def exit_error(srv, run: dict) -> str | None:
    """A server that died (out of memory, a crash) answers nothing: its requests all fail and its process is gone.
    Then its log's last error line, so that the arm leaves the run with it instead of rows of 0 tokens/s."""
    if not run.get("failed_requests") or srv.proc.poll() is None:
        return None
    return srv.last_error()


class ServerExited(RuntimeError):
    pass


def run_arm(arm: str, levels: list[int], repeats: int, input_len: int, output_len: int, max_bs: int,
            mem_fraction: float, port: int, profile_at: set[int] = frozenset(), waves: int = 2,
            warmup_tokens: int = 32, backend: str | None = None, on_level=None, max_total_tokens: int | None = None,
            profile_delay_s: float = 3.0) -> dict:
    """Each level: a warm-up pass, a prefill pass, then `repeats` timed passes of `waves` requests per client.

    - Warm-up (`warmup_tokens` per request, new prompts, at the level's concurrency; kept as `warmup`): the first
      time a server runs a batch size it pays one-time costs that a server in production pays once in its life
      (in run 4 the protected arm's first steps at 64 requests took 71 ms against 9 ms later, and its adaptive
      slot for that size was set up). Without this pass they landed in the first timed repeat of each level.
    - Prefill (`prefill`): `concurrency` new prompts at once, one output token each: how long the server takes
      to prefill them, which is where a speculative server's own prefill work (the target's aux-state capture
      and the draft's prefill) shows, apart from its decode steps.
    `on_level(row)` after each level: the caller keeps what was measured if the run is stopped before the arm ends.
    """
    os.environ["GPU_CHECK_PORT"] = str(port)
    Server = serverlib().Server

    from sglang_ext.eval.bench import run_arm as measure

    args, env = server_args(arm, max_bs, mem_fraction, backend, max_total_tokens)
    row = {"arm": arm, "args": args, "env": env, "levels": {}, "waves": waves, "warmup_tokens": warmup_tokens,
           "attention_backend": backend or "default"}
    with Server(f"bench-{arm}", args, env) as srv:
        if not srv.wait_ready(420):
            row["error"] = f"server did not start: {srv.last_error()}\n{srv.log()[-3000:]}"
            return row
        row["start_s"] = srv.ready_s

        def checked(run: dict, where: str) -> dict:
            error = exit_error(srv, run)
            if error is not None:
                raise ServerExited(f"server exited {where}: {error}")
            return run

        c = None
        try:
            # first-use kernel compiles, not timed: a batched prefill and a single one (in an earlier run the first
            # request at concurrency 1 still waited 0.3-0.45 s for its first token after only the batched warm-up)
            checked(measure(srv.url, prompts(8, input_len, seed=99), 8, [32] * 8), "at warm-up")
            checked(measure(srv.url, prompts(1, input_len, seed=98), 1, [32]), "at warm-up")
            for c in levels:
                if warmup_tokens > 0:
                    row.setdefault("warmup", {})[str(c)] = checked(measure(
                        srv.url, prompts(c, input_len, seed=level_seed(c, "warmup")), c, [warmup_tokens] * c),
                        f"in the warm-up pass at concurrency {c}")
                row.setdefault("prefill", {})[str(c)] = checked(measure(
                    srv.url, prompts(c, input_len, seed=level_seed(c, "prefill")), c, [1] * c),
                    f"in the prefill pass at concurrency {c}")
                n = max(4, waves * c)
                runs = [checked(measure(srv.url, prompts(n, input_len, seed=repeat_seed(c, r)), c, [output_len] * n),
                                f"at concurrency {c}, repeat {r + 1}") for r in range(repeats)]
                row["levels"][str(c)] = runs
                tps = [r["output_tokens_per_s"] for r in runs]
                print(f"[bench] {arm} c={c}: {statistics.mean(tps):.1f} tok/s (min {min(tps):.1f}, max {max(tps):.1f}), "
                      f"TPOT {1e3 * statistics.mean(r['tpot_mean_s'] for r in runs):.2f} ms, first token "
                      f"{1e3 * statistics.mean(r['ttft_mean_s'] for r in runs):.0f} ms, prefill of {c} "
                      f"{1e3 * row['prefill'][str(c)]['wall_s']:.0f} ms, accepted drafts/step "
                      f"{runs[-1]['accepted_drafts_per_step']}", flush=True)
                if on_level is not None:
                    on_level(row)
                if c in profile_at:
                    prof = profile_level(srv, prompts(4 * c, input_len, seed=c + 1), c, output_len, 10,
                                         f"{WORK}/profiles/{arm}-c{c}", profile_delay_s)
                    row.setdefault("profiles", {})[str(c)] = prof
                    print(f"[bench] {arm} c={c} profile: {json.dumps(prof)}", flush=True)
        except ServerExited as e:  # the levels measured before stay; the next arm may still run
            row["error"] = f"{e}\n{srv.log()[-3000:]}"
            print(f"[bench] {arm}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001 -- the server died mid-run (e.g. out of memory): keep the others
            row["error"] = f"{e!r} at concurrency {c}\n" + srv.log()[-3000:]
        log = srv.log()
        row["pool"] = pool_facts(log)
        adaptive = adaptive_facts(log)
        if adaptive:
            row["adaptive"] = adaptive
            mark_probes(row, log)
    return row


def compare_arms(arms: list[str], levels: list[int], repeats: int, input_len: int, output_len: int, max_bs: int,
                 mem_fraction: float, port: int, waves: int = 2, warmup_tokens: int = 32, backend: str | None = None,
                 max_total_tokens: int | None = None) -> dict[str, dict]:
    """The arms' servers side by side on one GPU, measured in turn: at each level every arm's warm-up and prefill
    passes, then `repeats` rounds in which each arm runs once, the order rotated every round (A B C, B C A, ...), so
    that drift over the run (clocks, a cold cache) falls on every arm alike. `max_total_tokens` caps each server's KV
    pool: SGLang sizes a pool from the memory free when that server starts, which the others are taking."""
    Server = serverlib().Server
    from sglang_ext.eval.bench import run_arm as measure

    rows, servers = {}, {}
    try:
        live = []
        # one start at a time: SGLang reads the free memory when a server starts and sizes that server against it,
        # so a server whose neighbours allocate while it loads finds less than it counted on and refuses to start
        for i, arm in enumerate(arms):
            args, env = server_args(arm, max_bs, mem_fraction, backend, max_total_tokens)
            rows[arm] = {"arm": arm, "args": args, "env": env, "levels": {}, "waves": waves,
                         "warmup_tokens": warmup_tokens, "attention_backend": backend or "default",
                         "side_by_side": list(arms)}
            srv = servers[arm] = Server(f"bench-{arm}", args, env, port_number=port + i)
            if srv.wait_ready(600):
                rows[arm]["start_s"] = srv.ready_s
                live.append(arm)
            else:
                rows[arm]["error"] = f"server did not start: {srv.last_error()}\n{srv.log()[-3000:]}"

        def exited(arm: str, run: dict, where: str) -> bool:
            """A server that died beside the others leaves the run with its log's error (`exit_error`)."""
            last = exit_error(servers[arm], run)
            if last is None:
                return False
            error = f"server exited {where}: {last}"
            rows[arm]["error"] = f"{error}\n{servers[arm].log()[-3000:]}"
            print(f"[bench] {arm}: {error}", flush=True)
            live.remove(arm)
            return True

        for arm in list(live):  # first-use kernel compiles, not timed (run_arm)
            for n, seed in ((8, 99), (1, 98)):
                if arm in live:
                    exited(arm, measure(servers[arm].url, prompts(n, input_len, seed=seed), n, [32] * n), "at warm-up")
        for c in levels:
            for arm in list(live):
                url = servers[arm].url
                if warmup_tokens > 0:
                    run = rows[arm].setdefault("warmup", {})[str(c)] = measure(
                        url, prompts(c, input_len, seed=level_seed(c, "warmup")), c, [warmup_tokens] * c)
                    if exited(arm, run, f"in the warm-up pass at concurrency {c}"):
                        continue
                run = rows[arm].setdefault("prefill", {})[str(c)] = measure(
                    url, prompts(c, input_len, seed=level_seed(c, "prefill")), c, [1] * c)
                exited(arm, run, f"in the prefill pass at concurrency {c}")
            n = max(4, waves * c)
            for r in range(repeats):
                k = r % max(1, len(live))
                for arm in live[k:] + live[:k]:
                    try:
                        run = measure(servers[arm].url, prompts(n, input_len, seed=repeat_seed(c, r)), c,
                                      [output_len] * n)
                    except Exception as e:  # noqa: BLE001 -- a server died mid-run: keep measuring the others
                        rows[arm]["error"] = f"{e!r} at concurrency {c}\n" + servers[arm].log()[-3000:]
                        live.remove(arm)
                        continue
                    if not exited(arm, run, f"at concurrency {c}, repeat {r + 1}"):
                        rows[arm]["levels"].setdefault(str(c), []).append(run)
            first = next((a for a in arms if str(c) in rows[a]["levels"]), None)
            for arm in live:
                tps = [x["output_tokens_per_s"] for x in rows[arm]["levels"][str(c)]]
                ratio = statistics.median(tps) / statistics.median(
                    x["output_tokens_per_s"] for x in rows[first]["levels"][str(c)])
                held = [x.get("held_requests", 0) for x in rows[arm]["levels"][str(c)]]
                print(f"[bench] {arm} c={c}: median {statistics.median(tps):.1f} tok/s (min {min(tps):.1f}, max "
                      f"{max(tps):.1f}); /{first} {ratio:.3f}; accepted drafts/step "
                      f"{rows[arm]['levels'][str(c)][-1]['accepted_drafts_per_step']}; requests held back per repeat "
                      f"{held}", flush=True)
    finally:
        for arm, srv in servers.items():
            srv.stop()
            log = srv.log()
            rows[arm]["pool"] = pool_facts(log)
            adaptive = adaptive_facts(log)
            if adaptive:
                rows[arm]["adaptive"] = adaptive
                mark_probes(rows[arm], log)
    return rows


def compare_table(state: dict, arms: list[str], reference: str) -> str:
    """A markdown table of `arms` (as `compare` measured them): median output tokens/s (min-max over repeats) at
    each level, and the median's ratio to `reference`'s."""
    rows = state.get("arms", {})
    missing = [a for a in [reference, *arms] if a not in rows]
    if missing:
        raise SystemExit(f"not in the state: {missing}; measured: {sorted(rows)}")
    levels = sorted({int(c) for a in arms for c in rows[a].get("levels", {})})

    def med(arm, c):
        runs = rows[arm].get("levels", {}).get(str(c))
        return statistics.median(r["output_tokens_per_s"] for r in runs) if runs else None

    out = ["| arm | " + " | ".join(f"c = {c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for arm in arms:
        cells = []
        for c in levels:
            runs = rows[arm].get("levels", {}).get(str(c))
            if not runs:
                cells.append("—")
                continue
            tps = [r["output_tokens_per_s"] for r in runs]
            ref = med(reference, c)
            ratio = "" if arm == reference or not ref else f", {statistics.median(tps) / ref:.3f}x"
            cells.append(f"{statistics.median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f}{ratio})")
        out.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def repeats_table(state: dict, arms: list[str]) -> str:
    """Each repeat's output tokens/s in the order run, with the cost policy's probes inside it in brackets where the
    server logged them (`mark_probes`): the spread of a protected arm is read against its probes."""
    rows = state.get("arms", {})
    levels = sorted({int(c) for a in arms for c in rows.get(a, {}).get("levels", {})})
    out = ["| arm, each repeat: output tok/s (probes) | " + " | ".join(f"c = {c}" for c in levels) + " |",
           "|---|" + "---|" * len(levels)]
    for arm in arms:
        cells = [" / ".join(f"{r['output_tokens_per_s']:,.0f}" + (f" ({r['probes']})" if "probes" in r else "")
                            for r in rows.get(arm, {}).get("levels", {}).get(str(c), [])) or "—" for c in levels]
        out.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def phases_table(state: dict, arms: list[str]) -> str:
    """Each wave's prefill and decode spans (`bench.wave_phases`), medians over repeats, at each level: how much of a
    gap in output tokens/s is a wave's prefill and how much its decode, for the first wave (arriving together) and
    the next (arriving as the first one's requests finish, into a pool that holds the earlier requests' prefixes)."""
    from sglang_ext.eval.bench import wave_phases

    rows = state.get("arms", {})
    levels = sorted({int(c) for a in arms for c in rows.get(a, {}).get("levels", {})})
    out = ["| arm, wave: prefill span / mean decode span (ms) | " + " | ".join(f"c = {c}" for c in levels)
           + " |", "|---|" + "---|" * len(levels)]
    for arm in arms:
        per_level = {c: [wave_phases(r.get("per_request_ms") or [], c)
                         for r in rows.get(arm, {}).get("levels", {}).get(str(c), [])] for c in levels}
        for w in range(max((len(p) for runs in per_level.values() for p in runs), default=1)):
            cells = []
            for c in levels:
                phases = [p[w] for p in per_level[c] if len(p) > w]
                cells.append(f"{statistics.median(p['prefill_span_ms'] for p in phases):,.0f} / "
                             f"{statistics.median(p['decode_span_ms'] for p in phases):,.0f}" if phases else "—")
            out.append(f"| {arm}, wave {w + 1} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def profile_levels_of(spec: str | None, arm: str) -> set[int]:
    """--profile-at: "64" profiles every arm at 64 requests; "nospec:1,plugin-chain:64" only those arms; an arm
    named twice ("nospec:1,nospec:32") is profiled at both levels."""
    if not spec:
        return set()
    if ":" not in spec:
        return {int(spec)}
    levels: dict[str, set[int]] = {}
    for part in spec.split(","):
        name, _, level = part.partition(":")
        if name not in ARMS or not level.isdigit():
            raise SystemExit(f"--profile-at {spec!r}: {part!r} is not ARM:CONCURRENCY with ARM one of {list(ARMS)}")
        levels.setdefault(name, set()).add(int(level))
    return levels.get(arm, set())


PROBE_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d{3})?\] \[sglang_ext\] adaptive speculation: "
                        r"depth 0 -> \d+: probe", re.M)


def probe_times(log: str) -> list[float]:
    """When the cost policy probed (seconds since the epoch), from a server log's timestamps: SGLang writes the local
    time, to the millisecond under SGLANG_LOG_MS=1 (this harness's servers), else to the second."""
    return [time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + (float(ms) if ms else 0.0)
            for stamp, ms in PROBE_LINE.findall(log)]


def mark_probes(row: dict, log: str) -> None:
    """Each timed repeat's `probes`: how many of the policy's probes began inside it. On FA3 at 128 requests the
    repeats holding one ran at 0.91-0.93x of no speculation and the one without at 0.97x (docs/benchmarks.md,
    2026-12-07): a repeat's speed is read beside its probes."""
    times = probe_times(log)
    for runs in row.get("levels", {}).values():
        for run in runs:
            if run.get("start_unix") is not None:
                run["probes"] = sum(run["start_unix"] <= t <= run["start_unix"] + run["wall_s"] for t in times)


def adaptive_facts(log: str) -> dict | None:
    """The cost policy's decisions and periodic summaries (steps per depth, measured step time per depth) from a
    server log, and how often SGLang switched its runtime state: what a protected arm's speed is made of."""
    decisions = re.findall(r"\[sglang_ext\] adaptive speculation: (.*)", log)
    summaries = re.findall(r"\[sglang_ext\] adaptive speculation summary: (.*)", log)
    if not decisions and not summaries:
        return None
    return {"decisions": len(decisions), "last_decisions": decisions[-10:], "summaries": summaries[-40:],
            "runtime_state_switches": len(re.findall(r"Switch adaptive runtime state", log))}


# ---------------------------------------------------------------------------------- report
def mean_tps(row: dict, c: str) -> float | None:
    runs = row.get("levels", {}).get(c)
    return statistics.mean(r["output_tokens_per_s"] for r in runs) if runs else None


def mean_tpot(row: dict, c: str) -> float | None:
    runs = row.get("levels", {}).get(c)
    return statistics.mean(r["tpot_mean_s"] for r in runs) if runs else None


def spread(row: dict, c: str) -> tuple[float, float] | None:
    runs = row.get("levels", {}).get(c)
    return (min(r["output_tokens_per_s"] for r in runs), max(r["output_tokens_per_s"] for r in runs)) if runs else None


def draft_cost_ratio(nospec_tpot: float, zero_tpot: float, steps: int = STEPS) -> float:
    """c from TPOT at zero acceptance: one token per step costs a target step plus k draft steps."""
    return max(0.0, (zero_tpot / nospec_tpot - 1.0) / steps)


def speedup_bound(accepted: float, c: float, steps: int = STEPS) -> float:
    """Chain drafting with k steps: speedup <= (1 + a) / (1 + k c)."""
    return (1.0 + accepted) / (1.0 + steps * c)


def batch1_bound(no: dict | None, zero: dict | None, chain: dict | None) -> dict | None:
    """The bound on batch 1's speedup and what the chain arm achieved, c from the zero-acceptance arm's TPOT."""
    if not (no and zero and chain and all("1" in r.get("levels", {}) for r in (no, zero, chain))):
        return None
    t_no, t_zero, t_chain = (mean_tpot(r, "1") for r in (no, zero, chain))
    c = draft_cost_ratio(t_no, t_zero)
    a = chain["levels"]["1"][-1]["accepted_drafts_per_step"] or 0.0
    # the bound is on time per output token (TPOT); the throughput ratio also counts prefill and the
    # client's time between requests, so it is reported beside it, not compared with the bound
    achieved = t_no / t_chain if t_chain else 0.0
    return {"c": c, "accepted_drafts_per_step": a, "bound": speedup_bound(a, c), "achieved": achieved,
            "achieved/bound": achieved / speedup_bound(a, c),
            "throughput_ratio": mean_tps(chain, "1") / mean_tps(no, "1")}


def target_step_bytes(cfg: dict, dtype_bytes: int = 2) -> int:
    """Weight bytes a DeepseekV3 (MLA) target reads in one decode step at batch 1: every layer's attention and MLP --
    dense, or the shared experts, the router and the `num_experts_per_tok` routed experts one token selects -- the
    norms and the LM head; of the embedding one row, not counted. At batch 1 and the prompt lengths benchmarked the
    KV cache read is a fraction of a percent of this (16 layers x 1,152 B a token), so weights alone bound a step.
    With fp8 block weights (`FP8_BLOCK`) the layers' matrices count 1 byte a weight plus their 128 x 128 blocks'
    float32 scales, the norms and the LM head `dtype_bytes` (kv_b_proj counted as stored, though SGLang may keep its
    two halves in another dtype after loading)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q = h * cfg["q_lora_rank"] + cfg["q_lora_rank"] * (1 + heads * qk) if cfg.get("q_lora_rank") else h * heads * qk
    attention = (q + h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) + cfg["kv_lora_rank"]
                 + cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
                 + heads * cfg["v_head_dim"] * h + 2 * h)
    dense = 3 * h * cfg["intermediate_size"]
    moe = (h * cfg.get("n_routed_experts", 0) + 3 * h * cfg.get("moe_intermediate_size", 0)
           * (cfg.get("n_shared_experts", 0) + cfg.get("num_experts_per_tok", 0)))
    layers = cfg["num_hidden_layers"]
    n_dense = min(cfg.get("first_k_dense_replace", layers), layers)
    norms = 2 * h + (cfg["q_lora_rank"] if cfg.get("q_lora_rank") else 0) + cfg["kv_lora_rank"]
    matrices = layers * (attention - norms) + n_dense * dense + (layers - n_dense) * moe
    plain = layers * norms + h + cfg["vocab_size"] * h
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" and quant.get("weight_block_size"):
        bh, bw = quant["weight_block_size"]
        return matrices + math.ceil(4 * matrices / (bh * bw)) + dtype_bytes * plain
    return dtype_bytes * (matrices + plain)


def draft_cycle_bytes(head_cfg: dict, fmt: str, steps: int = STEPS, dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes of one draft forward, bytes read once per verify cycle) for a head, from its format's weight map. A cycle
    runs the head `steps` times (the draft extend over the accepted tokens, then steps - 1 draft steps, as SGLang's
    EAGLE worker does); only the extend projects the target's aux states, so `fc` is read once a cycle; the
    embedding is the target's (one row)."""
    from sglang_ext.config import Eagle3DraftConfig, weight_map

    required, _ = weight_map(fmt).expected(Eagle3DraftConfig.from_dict(head_cfg))
    per_forward = sum(math.prod(shape) for name, shape in required.items() if name not in ("fc.weight", "d2t", "t2d"))
    return dtype_bytes * per_forward, dtype_bytes * math.prod(required["fc.weight"])


def weight_bytes_bound(target_cfg: dict, head_cfg: dict, fmt: str, accepted: float, steps: int = STEPS) -> dict:
    """Batch 1's speedup bound from the weights read: a step of no speculation reads the target's weights once (T); a
    chain's cycle reads them once to verify steps + 1 tokens (still memory-bound at batch 1) and the head's `steps`
    times (D each, plus fc once: F), and yields 1 + accepted tokens. Speedup <= (1 + a) T / (T + steps D + F): the
    bound of `speedup_bound` with the draft cost per step c = (D + F / steps) / T."""
    t = target_step_bytes(target_cfg)
    d, f = draft_cycle_bytes(head_cfg, fmt, steps)
    return {"target_step_bytes": t, "draft_forward_bytes": d, "fc_bytes": f, "accepted_drafts_per_step": accepted,
            "bound": speedup_bound(accepted, (d + f / steps) / t, steps)}


def bound_rows(state: dict, arms: list[str], reference: str = "nospec") -> list[dict]:
    """Each chain arm at concurrency 1 against the weight-bytes bound: the bound at the arm's measured acceptance,
    and what it achieved as the ratio of time per output token (what the bound is about) and of throughput (which
    also counts prefill and the client's time between requests)."""
    layers, weights = state["build"]["layers"], state["build"].get("target_weights", "bf16")
    ref = state["arms"].get(reference)
    if not ref or "1" not in ref.get("levels", {}):
        raise SystemExit(f"bound: the state has no {reference!r} arm measured at concurrency 1")
    rows = []
    for arm in arms:
        row = state["arms"].get(arm)
        head = ARMS[arm][0]
        if head is None or not row or "1" not in row.get("levels", {}):
            raise SystemExit(f"bound: {arm!r} is not a drafting arm measured at concurrency 1 in this state")
        fmt = head.split("-")[0]
        b = weight_bytes_bound(target_config(layers, weights), head_config(fmt, layers), fmt,
                               _median_at_1(row, "accepted_drafts_per_step"))
        tpot = _median_at_1(ref, "tpot_mean_s") / _median_at_1(row, "tpot_mean_s")
        tps = _median_at_1(row, "output_tokens_per_s") / _median_at_1(ref, "output_tokens_per_s")
        rows.append({"arm": arm, **b, "tpot_speedup": tpot, "throughput_speedup": tps,
                     "tpot_speedup/bound": tpot / b["bound"], "throughput_speedup/bound": tps / b["bound"]})
    return rows


def _median_at_1(row: dict, key: str) -> float:
    return statistics.median(r[key] or 0.0 for r in row["levels"]["1"])


def bound_table(rows: list[dict]) -> str:
    lines = ["| arm | target step GB | draft forward GB (+ fc once) | accepted drafts / step | bound | speedup by TPOT "
             "(of bound) | by throughput (of bound) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['target_step_bytes'] / 1e9:.2f} | {r['draft_forward_bytes'] / 1e9:.2f} "
                     f"(+ {r['fc_bytes'] / 1e9:.2f}) | {r['accepted_drafts_per_step']:.2f} | {r['bound']:.3f}x | "
                     f"{r['tpot_speedup']:.3f}x ({r['tpot_speedup/bound']:.3f}) | {r['throughput_speedup']:.3f}x "
                     f"({r['throughput_speedup/bound']:.3f}) |")
    return "\n".join(lines)


def ratio_rows(state: dict) -> list[dict]:
    arms = state.get("arms", {})
    levels = sorted({int(c) for r in arms.values() for c in r.get("levels", {})})
    rows = []
    for c in map(str, levels):
        def r(a, b):
            x, y = mean_tps(arms.get(a, {}), c), mean_tps(arms.get(b, {}), c)
            return x / y if x and y else None

        def band(a, b):
            x, y = spread(arms.get(a, {}), c), spread(arms.get(b, {}), c)
            return (x[0] / y[1], x[1] / y[0]) if x and y else None

        def r_tpot(a, b):  # b's speed relative to a's from time per output token (a's TPOT over b's)
            x, y = mean_tpot(arms.get(a, {}), c), mean_tpot(arms.get(b, {}), c)
            return x / y if x and y else None

        rows.append({"concurrency": int(c), "plugin/upstream": r("plugin-chain", "upstream-chain"),
                     "plugin/upstream band": band("plugin-chain", "upstream-chain"),
                     "chain/nospec": r("plugin-chain", "nospec"),
                     "verify-decode chain/nospec": r("plugin-chain-verify-decode", "nospec"),
                     "verify-decode zero/nospec": r("zero-accept-verify-decode", "nospec"),
                     "verify-decode tree/nospec": r("plugin-tree-verify-decode", "nospec"),
                     "mla/nospec": r("plugin-mla-chain", "nospec"),
                     "tree/nospec": r("plugin-tree", "nospec"), "fp8/nospec": r("plugin-fp8", "nospec"),
                     "zero/nospec": r("zero-accept", "nospec"),
                     "zero-protected/nospec": r("zero-accept-protected", "nospec"),
                     "zero-protected-verify-decode/nospec": r("zero-accept-protected-verify-decode", "nospec"),
                     "chain-protected/chain": r("chain-protected-decode0", "plugin-chain-verify-decode"),
                     # the protection as shipped, over no speculation: (tok/s ratio, its min-max, TPOT ratio)
                     "protected": {arm: (r(arm, "nospec"), band(arm, "nospec"), r_tpot("nospec", arm))
                                   for arm in PROTECTED_COLUMNS}})
    return rows


# the protection's table: a draft that never accepts (without and with depth 0's draft extend before probes, the
# shipped default), then 0.5 and 2 accepted drafts per step
PROTECTED_COLUMNS = {"zero-accept-protected-decode0": "zero acceptance, no depth-0 draft extend",
                     "zero-accept-protected-warm": "zero acceptance, as shipped (draft extend before probes)",
                     "low-accept-protected-decode0": "0.5 accepted drafts/step",
                     "chain-protected-decode0": "2 accepted drafts/step"}


def prefill_lines(arms: dict) -> list[str]:
    """Each arm's prefill pass (`concurrency` new prompts at once, one output token each) against no
    speculation's: the speculative server's own prefill work (aux-state capture, the draft's prefill)."""
    have = {k: v["prefill"] for k, v in arms.items() if v.get("prefill")}
    if not have:
        return []
    levels = sorted({int(c) for p in have.values() for c in p})
    base = have.get("nospec", {})
    lines = ["", "Prefill of `concurrency` new prompts at once (one output token each): wall ms (/ no speculation's):",
             "", "| arm | " + " | ".join(f"c = {c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for k, p in have.items():
        cells = []
        for c in map(str, levels):
            if c not in p:
                cells.append("—")
                continue
            ms = 1e3 * p[c]["wall_s"]
            ratio = f" ({p[c]['wall_s'] / base[c]['wall_s']:.2f})" if k != "nospec" and c in base else ""
            cells.append(f"{ms:.0f}{ratio}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def report(out_md: str) -> dict:
    state = json.load(open(f"{WORK}/state.json"))
    arms = state.get("arms", {})
    rows = ratio_rows(state)
    # the bound at batch 1 for each verify kernel, c measured from the zero-acceptance arm of that kernel
    bounds = {kernel: b for kernel, zero, chain in (("upstream's verify kernel", "zero-accept", "plugin-chain"),
                                                   ("verify as decode", "zero-accept-verify-decode",
                                                    "plugin-chain-verify-decode"))
              if (b := batch1_bound(arms.get("nospec"), arms.get(zero), arms.get(chain)))}
    bound = bounds.get("upstream's verify kernel") or bounds.get("verify as decode")
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["# Benchmarks: Eagle3 on a Kimi-K2.5-shaped target (one H200)", "",
             f"Generated by `eagle3-spec-bench report` on {datetime.date.today()} from {WORK}/state.json; "
             f"build: {json.dumps(state.get('build', {}))}."]
    general = ["plugin/upstream", "chain/nospec", "verify-decode chain/nospec", "mla/nospec", "tree/nospec",
               "verify-decode tree/nospec", "fp8/nospec", "zero/nospec", "verify-decode zero/nospec",
               "zero-protected/nospec", "zero-protected-verify-decode/nospec"]
    if any(r[k] is not None for r in rows for k in general):  # a run of only the protection's arms has none
        lines += ["", "| concurrency | plugin/upstream (min-max) | chain/no-spec | chain, verify as decode/no-spec | "
                  "MLA head/no-spec | tree/no-spec | tree, verify as decode/no-spec | "
                  "fp8 draft KV/no-spec | zero acceptance/no-spec | zero acceptance, verify as decode/no-spec | "
                  "zero acceptance, protected/no-spec | zero acceptance, protected, verify as decode/no-spec |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            b = r["plugin/upstream band"]
            lines.append(f"| {r['concurrency']} | {fmt(r['plugin/upstream'])}"
                         f"{'' if not b else f' ({b[0]:.3f}-{b[1]:.3f})'} | {fmt(r['chain/nospec'])} | "
                         f"{fmt(r['verify-decode chain/nospec'])} | "
                         f"{fmt(r['mla/nospec'])} | {fmt(r['tree/nospec'])} | {fmt(r['verify-decode tree/nospec'])} | "
                         f"{fmt(r['fp8/nospec'])} | "
                         f"{fmt(r['zero/nospec'])} | {fmt(r['verify-decode zero/nospec'])} | "
                         f"{fmt(r['zero-protected/nospec'])} | {fmt(r['zero-protected-verify-decode/nospec'])} |")
    for kernel, b in bounds.items():
        lines += ["", f"Batch 1, {kernel}: measured draft/target step-cost ratio c = {b['c']:.3f}; accepted drafts "
                      f"per step {b['accepted_drafts_per_step']:.2f}; bound (1 + a)/(1 + k c) = {b['bound']:.3f}; "
                      f"achieved (TPOT no-spec / TPOT chain) {b['achieved']:.3f} = {b['achieved/bound']:.2f} "
                      f"of the bound (output tokens/s ratio {b['throughput_ratio']:.3f})."]
    protected = [r for r in rows if any(v[0] for v in r["protected"].values())]
    if protected:
        def cell(v):
            ratio, b, tpot = v
            return "—" if ratio is None else (f"{ratio:.3f}" + ("" if not b else f" ({b[0]:.3f}-{b[1]:.3f})")
                                              + ("" if tpot is None else f", TPOT {tpot:.3f}"))

        lines += ["", "The protection as shipped (depth 0 a plain decode step), over no speculation: output tokens/s "
                      "(min-max over pairs of repeats), TPOT ratio:", "",
                  "| concurrency | " + " | ".join(PROTECTED_COLUMNS.values())
                  + " | protected chain / unprotected chain (verify as decode) |",
                  "|---|" + "---|" * (len(PROTECTED_COLUMNS) + 1)]
        for r in protected:
            lines.append(f"| {r['concurrency']} | " + " | ".join(cell(r["protected"][arm]) for arm in PROTECTED_COLUMNS)
                         + f" | {fmt(r['chain-protected/chain'])} |")
    lines += prefill_lines(arms)
    pools = {k: v.get("pool") for k, v in arms.items() if v.get("pool")}
    if pools:
        lines += ["", "| arm | draft B/token | draft pool tokens | draft pool GiB | max running requests |",
                  "|---|---|---|---|---|"]
        for k, p in pools.items():
            lines.append(f"| {k} | {p.get('draft_bytes_per_token', '—')} | {p.get('draft_pool_tokens', '—')} | "
                         f"{p.get('draft_pool_gib', '—')} | {p.get('max_running_requests', '—')} |")
    profiles = [(k, c, p) for k, v in arms.items() for c, p in v.get("profiles", {}).items() if "window_ms" in p]
    if profiles:
        lines += ["", "Profiles (10 scheduler steps at full concurrency; GPU busy = union of kernel time / window):", "",
                  "| arm | concurrency | window ms/step | GPU busy ms/step | busy fraction | top kernels (ms/step) |",
                  "|---|---|---|---|---|---|"]
        for k, c, p in profiles:
            tops = "; ".join(f"{n[:40]} {t}" for n, t in p["top_kernels_ms_per_step"][:4])
            lines.append(f"| {k} | {c} | {p['window_ms'] / p['steps']:.2f} | {p['gpu_busy_ms'] / p['steps']:.2f} | "
                         f"{p['gpu_busy_fraction']:.2f} | {tops} |")
    adaptive = {k: v["adaptive"] for k, v in arms.items() if v.get("adaptive")}
    for k, a in adaptive.items():  # what a protected arm's speed is made of
        lines += ["", f"`{k}`: {a['decisions']} depth decisions, {a['runtime_state_switches']} runtime-state "
                      "switches; the policy's last summaries (steps and measured step time per depth):", ""]
        lines += [f"- {x}" for x in a["summaries"][-6:]] or ["- (none logged)"]
    failed = {k: v["error"].splitlines()[0][:160] for k, v in arms.items() if v.get("error")}
    if failed:
        lines += ["", "Arms that failed: " + "; ".join(f"`{k}`: {e}" for k, e in failed.items())]
    lines += ["", "Commands: `eagle3-spec-bench build`, `eagle3-spec-bench run <arms>`, "
                  "`eagle3-spec-bench report` (docs/benchmarks.md explains the arms)."]
    os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
    open(out_md, "w").write("\n".join(lines) + "\n")
    _plot(state, os.path.splitext(out_md)[0] + ".png")
    return {"rows": rows, "bound": bound, "bounds": bounds}


def _plot(state: dict, path: str) -> None:
    plt = pyplot("eval", path)
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, row in state.get("arms", {}).items():
        xs = sorted(int(c) for c in row.get("levels", {}))
        if xs:
            ax.plot(xs, [mean_tps(row, str(c)) for c in xs], marker="o", label=arm)
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Kimi-K2.5-shaped target, one H200")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)


def arms_to_run(state: dict, wanted: list[str], redo: list[str]) -> list[str]:
    """`wanted` in order, less the arms the state already measured without error (unless in `redo`)."""
    done = {a for a, row in state.get("arms", {}).items() if "error" not in row and a not in redo}
    return [a for a in wanted if a not in done]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("spec-bench"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=VERSION)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--layers", type=int, default=16)
    b.add_argument("--target-weights", choices=TARGET_WEIGHTS, default="bf16",
                   help="the target's weight format: bf16, or fp8 in 128 x 128 blocks as DeepSeek-V3 ships (half the "
                        "memory: 61 layers fit an 80 GB card); the heads stay bf16")
    r = sub.add_parser("run")
    r.add_argument("arms", nargs="+", choices=list(ARMS))
    r.add_argument("--concurrency", default="1,8,32,64,128")
    r.add_argument("--repeats", type=int, default=2)
    r.add_argument("--input-len", type=int, default=256)
    r.add_argument("--output-len", type=int, default=256)
    r.add_argument("--max-bs", type=int, default=128)
    r.add_argument("--waves", type=int, default=2, help="timed requests per client in each repeat (at least 4 in all)")
    r.add_argument("--warmup-tokens", type=int, default=32,
                   help="output tokens of each level's untimed warm-up pass (0: none, as in runs 1-4)")
    # 0.6: with the Triton MLA backend at 128 requests, SGLang's target-verify CUDA graphs take 17 GiB (chain) /
    # 34 GiB (tree) and an MLA head's draft graphs 25 GiB more (H200, Kimi-K2.5 shapes); at 0.8 upstream ran out
    # of memory capturing them, and at 0.7 the MLA head did at 32 requests
    r.add_argument("--mem-fraction-static", type=float, default=0.6)
    r.add_argument("--profile-at", default=None,
                   help="also profile 10 scheduler steps (GPU busy fraction, top kernels): a concurrency for every "
                        "arm, or ARM:C[,ARM:C...] for some (e.g. nospec:1,zero-accept-protected-verify-decode:1)")
    r.add_argument("--profile-delay-s", type=float, default=3.0,
                   help="seconds into the profiled load before the profile starts (3: the first wave's decode at 256 "
                        "prompt tokens; later: the next wave's, which arrives as the first one's requests finish)")
    r.add_argument("--max-total-tokens", type=int, default=None,
                   help="cap each server's KV pool (default: SGLang's sizing from --mem-fraction-static)")
    r.add_argument("--port", type=int, default=30177)
    r.add_argument("--deadline-s", type=float, default=1e9, help="start no arm after this many seconds")
    r.add_argument("--attention-backend", default=None,
                   help="the servers' --attention-backend (default: none given, SGLang's own choice: fa3 for this "
                        "MLA target on Hopper)")
    cmp_ = sub.add_parser("compare", help="the arms' servers side by side, measured in rotating order")
    for act in r._actions[1:]:
        if act.dest not in ("arms", "mem_fraction_static", "port", "deadline_s", "profile_at", "profile_delay_s",
                            "max_total_tokens"):
            cmp_._add_action(act)
    cmp_.add_argument("arms", nargs="+", choices=list(ARMS))
    cmp_.add_argument("--mem-fraction-static", type=float, default=0.9,
                      help="per server; each pool is capped by --max-total-tokens")
    cmp_.add_argument("--max-total-tokens", type=int, default=131072)
    cmp_.add_argument("--port", type=int, default=30277)
    tb = sub.add_parser("table", help="a markdown table of measured arms against one of them")
    tb.add_argument("arms", nargs="+")
    tb.add_argument("--reference", required=True, help="the arm the ratios are to")
    tb.add_argument("--state", default=None, help="a state.json (default: the work directory's)")
    bd = sub.add_parser("bound", help="chain arms at concurrency 1 against the weight-bytes bound on batch 1's speedup")
    bd.add_argument("arms", nargs="+", choices=list(ARMS))
    bd.add_argument("--reference", default="nospec", help="the arm without speculation")
    bd.add_argument("--state", default=None, help="a state.json (default: the work directory's)")
    rp = sub.add_parser("report")
    rp.add_argument("--out", default="docs/benchmarks.md")
    al = sub.add_parser("all", help="build, run ARMS (default: all, in priority order) and report")
    al.add_argument("--layers", type=int, default=16)
    al.add_argument("--target-weights", choices=TARGET_WEIGHTS, default="bf16", help="as for build")
    al.add_argument("--out", default="docs/benchmarks.md")
    for a in r._actions[1:]:  # the run options
        if a.dest != "arms":
            al._add_action(a)
    al.add_argument("--redo", default="", help="comma-separated arms to measure again even if the state has them")
    al.add_argument("arms", nargs="*", metavar="ARM", help=f"default: {' '.join(PRIORITY)}")
    args = ap.parse_args(argv)
    profile_levels_of(getattr(args, "profile_at", None), "nospec")  # a malformed value fails before any server
    if args.cmd == "all":
        unknown = [a for a in args.arms if a not in ARMS]
        if unknown:
            ap.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
        state = {}
        if os.path.exists(f"{WORK}/state.json"):
            state = json.load(open(f"{WORK}/state.json"))
        built = all(os.path.exists(f"{WORK}/{d}/config.json") for d in ("target", "head-mha", "head-mla"))
        build_ = state.get("build")
        have = (build_.get("layers"), build_.get("target_weights", "bf16")) if build_ else None
        if built and have and have != (args.layers, args.target_weights):
            ap.error(f"{WORK} holds a {have[0]}-layer {have[1]} target, not --layers {args.layers} --target-weights "
                     f"{args.target_weights}: set SPEC_BENCH_WORK to another directory, or run build")
        if "build" not in state or not built:  # own process: this one must hold no GPU memory while servers run
            import subprocess

            # -P: no working directory first on the path (a checkout's root would hide an installed sglang_ext)
            subprocess.run([sys.executable, "-P", "-m", "sglang_ext.eval.spec_bench", "build",
                            "--layers", str(args.layers), "--target-weights", args.target_weights], check=True)
        state = json.load(open(f"{WORK}/state.json"))
        todo = arms_to_run(state, args.arms or PRIORITY, [a for a in args.redo.split(",") if a])
        run_opts = ["--concurrency", args.concurrency, "--repeats", str(args.repeats), "--input-len",
                    str(args.input_len), "--output-len", str(args.output_len), "--max-bs", str(args.max_bs),
                    "--waves", str(args.waves), "--warmup-tokens", str(args.warmup_tokens),
                    "--mem-fraction-static", str(args.mem_fraction_static), "--port", str(args.port),
                    "--deadline-s", str(args.deadline_s), "--profile-delay-s", str(args.profile_delay_s)] + \
                   ([] if args.profile_at is None else ["--profile-at", args.profile_at]) + \
                   ([] if args.max_total_tokens is None else ["--max-total-tokens", str(args.max_total_tokens)]) + \
                   ([] if args.attention_backend is None else ["--attention-backend", args.attention_backend])
        if todo:
            main(["run", *todo, *run_opts])
        return main(["report", "--out", args.out])
    state_path = getattr(args, "state", None) or f"{WORK}/state.json"
    state = json.load(open(state_path)) if os.path.exists(state_path) else {}
    if args.cmd == "table":
        print(compare_table(state, args.arms, args.reference))
        print()
        print(repeats_table(state, args.arms))
        print()
        print(phases_table(state, args.arms))
        return 0
    if args.cmd == "bound":
        print(bound_table(bound_rows(state, args.arms, args.reference)))
        return 0
    if args.cmd == "build":
        state["build"] = build(args.layers, weights=args.target_weights)
        print(json.dumps(state["build"]))
    elif args.cmd == "compare":
        rows = compare_arms(args.arms, [int(c) for c in args.concurrency.split(",")], args.repeats, args.input_len,
                            args.output_len, args.max_bs, args.mem_fraction_static, args.port, args.waves,
                            args.warmup_tokens, args.attention_backend, args.max_total_tokens)
        state.setdefault("arms", {}).update(rows)
    elif args.cmd == "run":
        t0 = time.time()
        for arm in args.arms:
            if time.time() - t0 > args.deadline_s:
                print(f"[bench] {arm}: not started (deadline)")
                continue
            def keep(row, arm=arm):  # a run stopped mid-arm (a time limit) keeps its levels, marked unfinished
                done = list(row["levels"])
                state.setdefault("arms", {})[arm] = dict(row, error=f"unfinished: stopped after concurrency {done[-1]}")
                os.makedirs(os.path.dirname(os.path.abspath(state_path)), exist_ok=True)
                json.dump(state, open(state_path, "w"))

            row = run_arm(arm, [int(c) for c in args.concurrency.split(",")], args.repeats, args.input_len,
                          args.output_len, args.max_bs, args.mem_fraction_static, args.port,
                          profile_levels_of(args.profile_at, arm), args.waves, args.warmup_tokens,
                          args.attention_backend, on_level=keep, max_total_tokens=args.max_total_tokens,
                          profile_delay_s=args.profile_delay_s)
            state.setdefault("arms", {})[arm] = row
            json.dump(state, open(state_path, "w"))
            if "error" in row:  # the next arm may still run (each arm is its own server)
                print(f"[bench] {arm}: FAILED\n{row['error']}")
    else:
        print(json.dumps(report(args.out), indent=1))
        return 0
    os.makedirs(WORK, exist_ok=True)
    json.dump(state, open(state_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
