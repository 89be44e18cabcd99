"""GPU check: both Eagle3 head formats served under an MLA target, draft KV pool sizing and dtype,
and acceptance reporting without the bonus token (issues: head formats + KV pool; worker + metrics).

Builds a tiny DeepseekV3 target (8 layers, DeepSeek-V3 MLA dims, one MoE layer) and a ChatML BPE
tokenizer, trains an MHA head and an MLA head with `q_lora_rank: null` under our architecture name
`Eagle3DeepseekV3ForCausalLM` (`python -m sglang_ext.training.train_draft`, in-process regeneration), then for
each arm starts `python -m sglang.launch_server` (CUDA graphs on, --enable-metrics) and sends the
same chat prompts (64 in flight, greedy). Per arm it reports: outputs equal to the target alone
(partings at a near-tie, top-2 logprob gap <= 0.02, counted), the invariant completion_tokens =
accepted drafts + verify steps + 1 per request, whether the sum of meta_info, /metrics, the
/get_server_info ledger and the last decode log line agree exactly, accepted drafts per step, and
the KV pool lines (arithmetic vs what the allocator really holds). An arm passes on its accounting (invariant,
views, pools) and, where the target alone is batch-invariant (its own 1-vs-64-in-flight floor has no parting
beyond a near-tie: deterministic mode, Triton), on greedy equality too. Writes $OUT/serving.json.

The attention backend is SGLang's own choice (FA3 for an MLA target on Hopper) unless
GPU_CHECK_ATTENTION_BACKEND names one (triton, fa3, flashinfer, flashmla); the arms that exercise the
Triton backend's verify (`*verify-decode*`, `*-extend-*`, `target-triton`) run on Triton regardless.
GPU_CHECK_PARALLEL=N starts N arms' servers side by side (a start is most of an arm's time), each with a
capped KV pool (GPU_CHECK_MEM_FRACTION / GPU_CHECK_MAX_TOTAL_TOKENS, defaults in serverlib.launch_args).

    PYTHONPATH=/tmp/site:. python tests/gpu/check_serving.py [ARM ...]   (default: all arms)
    GPU_CHECK_TRAIN_DEVICE=cpu python tests/gpu/check_serving.py prepare   (the target, prompts and both heads only,
        e.g. on a CPU ahead of a GPU run: ~20 min on 2 cores; then carry GPU_CHECK_WORK over)
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
# the checkout last: an installed sglang_ext (a wheel on PYTHONPATH) wins; else the editable install's
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import gpu_data  # noqa: E402
from serverlib import Server, attention_backend, port, tp_args  # noqa: E402

from sglang_ext.config import Eagle3DraftConfig, TargetConfig  # noqa: E402
from sglang_ext.config.kv import draft_kv_bytes_per_token, target_kv_bytes_per_token  # noqa: E402

WORK = os.environ.get("GPU_CHECK_WORK", "/tmp/servecheck")
OUT = os.environ.get("OUT", "/tmp")
# another target (e.g. the MLA scale target, built by tests/gpu/check_scale_target.py): prompts are GSM8K
# test questions and the heads train on ShareGPT (tests/gpu/gpu_data.py: the packages, or GPU_DATA's files)
EXTERNAL_TARGET = os.environ.get("GPU_CHECK_TARGET")
N_PROMPTS = int(os.environ.get("N_PROMPTS", "200"))
# appended to every arm's server arguments, e.g. --enable-fp32-lm-head: fp32 logits make the top-2 gap at a
# parting measurable below one bf16 step (a trained target's logits are ~10-30, where bf16 steps are 0.06-0.125)
EXTRA_ARGS = os.environ.get("GPU_CHECK_EXTRA_ARGS", "").split()
CONCURRENCY = 64
# the tiny target's context: room for the 32k-token prompts of tests/gpu/check_traffic.py's soak (chunked prefill)
TARGET_CONTEXT = 40960
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
TREE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]
FP8 = {"SGLANG_EXT_DRAFT_KV_CACHE_DTYPE": "fp8_e4m3"}
# name: (head or None, drafting args, env, expect refusal, max_new_tokens override)
ARMS = {
    "target": (None, [], {}, False, None),
    # upstream SGLang EAGLE3 (plugin excluded), the MHA head with its ids in upstream's convention
    "upstream-mha-chain": ("mha-upstream", CHAIN, {"SGLANG_PLUGINS": "none"}, False, None),
    "mha-chain": ("mha", CHAIN, {}, False, None),
    "mla-chain": ("mla", CHAIN, {}, False, None),
    "mha-tree": ("mha", TREE, {}, False, None),
    "mla-tree": ("mla", TREE, {}, False, None),
    "mha-chain-fp8": ("mha", CHAIN, FP8, False, None),
    # the arms above run the plugin's defaults: MLA chains verified as decode attention, trees on upstream's
    # kernel; these name the verify mode (=decode: trees too)
    "mha-chain-verify-decode": ("mha", CHAIN, {"SGLANG_EXT_MLA_VERIFY": "decode"}, False, None),
    "mla-chain-verify-decode": ("mla", CHAIN, {"SGLANG_EXT_MLA_VERIFY": "decode"}, False, None),
    "mla-tree-verify-decode": ("mla", TREE, {"SGLANG_EXT_MLA_VERIFY": "decode"}, False, None),
    "simulate-2.5": ("mha", CHAIN, {"SGLANG_SIMULATE_ACC_LEN": "2.5"}, False, 400),
    "mla-fp8-refused": ("mla", CHAIN, FP8, True, None),
    # the non-overlap scheduler path (greedy: still equal to the target alone)
    "mha-chain-no-overlap": ("mha", CHAIN + ["--disable-overlap-schedule"], {}, False, None),
    # sampled verification: outputs are random, so accounting only (invariant, views agree)
    "mha-chain-sampled": ("mha", CHAIN, {}, False, None),
    "mla-tree-sampled": ("mla", TREE, {}, False, None),
}
# the cost-model protection (adaptive depth; depth 0 the target's plain decode step, serving/decode_depth0.py)
ARMS["mha-chain-protected"] = ("mha", CHAIN + ["--speculative-adaptive"], {"SGLANG_EXT_ADAPTIVE_POLICY": "cost"},
                               False, None)
ARMS["mla-chain-protected"] = ("mla", CHAIN + ["--speculative-adaptive"], {"SGLANG_EXT_ADAPTIVE_POLICY": "cost"},
                               False, None)
# SGLang's batch-invariant mode (--enable-deterministic-inference: batch-invariant GEMMs, attention KV split by
# a fixed tile; fa3, flashinfer and triton support it), compared with "target-deterministic", not with the
# default target arm: greedy speculation must then give the target's output exactly, a check bf16 kernel
# differences cannot blur. "<arm>-deterministic" runs on the server's backend (GPU_CHECK_ATTENTION_BACKEND,
# else SGLang's default); "-verify-decode-deterministic" on Triton with MLA verify as decode attention (a verify
# row computed exactly as that token's decode row, tests/serving/test_mla_verify.py) and "-extend-deterministic" on
# Triton with upstream's verify kernel (what remains without it).
DETERMINISTIC = {"target-deterministic"}
ARMS["target-deterministic"] = (None, [], {}, False, None)
# the target alone on Triton: the reference of the Triton-only arms in a run on another backend
ARMS["target-triton"] = (None, [], {}, False, None)
ARMS["target-deterministic-triton"] = (None, [], {}, False, None)
DETERMINISTIC.add("target-deterministic-triton")
SHAPES = ("mha-chain", "mla-chain", "mha-tree", "mla-tree", "mha-chain-fp8", "mha-chain-no-overlap",
          "mha-chain-protected")  # the drafting shapes checked in deterministic mode
for _name in SHAPES:
    ARMS[f"{_name}-deterministic"] = ARMS[_name]
    DETERMINISTIC.add(f"{_name}-deterministic")
for _name in ("mha-chain", "mla-chain"):
    ARMS[f"{_name}-extend-deterministic"] = (ARMS[_name][0], ARMS[_name][1], {"SGLANG_EXT_MLA_VERIFY": "extend"},
                                             False, None)
    DETERMINISTIC.add(f"{_name}-extend-deterministic")
for _name in SHAPES:
    _head, _drafting, _env = ARMS[_name][:3]
    ARMS[f"{_name}-verify-decode-deterministic"] = (_head, _drafting, {**_env, "SGLANG_EXT_MLA_VERIFY": "decode"},
                                                    False, None)
    DETERMINISTIC.add(f"{_name}-verify-decode-deterministic")
# the automatic drafting shape (serving/draft_shape.py): a server started as the tree whose cost policy also chooses
# chain depths and no drafting per batch size; in deterministic mode every state it switches to must give the
# target's greedy output (a state built at the wrong topk would attend causally over a tree, silently)
AUTO_SHAPE_ENV = {"SGLANG_EXT_ADAPTIVE_POLICY": "cost", "SGLANG_EXT_ADAPTIVE_SHAPES": "tree"}
for _head in ("mha", "mla"):
    ARMS[f"{_head}-auto-shape"] = (_head, TREE + ["--speculative-adaptive"], AUTO_SHAPE_ENV, False, None)
    ARMS[f"{_head}-auto-shape-deterministic"] = ARMS[f"{_head}-auto-shape"]
    DETERMINISTIC.add(f"{_head}-auto-shape-deterministic")
# the arms that name SGLANG_EXT_MLA_VERIFY exercise the Triton backend's verify (serving/mla_verify.py): they run on
# Triton whatever the server's backend
TRITON_ONLY = {name for name, arm in ARMS.items() if "SGLANG_EXT_MLA_VERIFY" in arm[2]} | {
    "target-triton", "target-deterministic-triton"}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
WORDS = ["the", "a", "of", "and", "to", "is", "in", "number", "answer", "apples", "cost", "dollars", "what",
         "how", "many", "total", "each", "has"]


def build_external():
    from transformers import AutoTokenizer

    if not os.path.exists(f"{WORK}/target"):
        os.symlink(os.path.abspath(EXTERNAL_TARGET), f"{WORK}/target")
    tok = AutoTokenizer.from_pretrained(f"{WORK}/target")
    from sglang_ext.training.chat import prompt_ids

    rows = [json.loads(line) for line in open(gpu_data.gsm8k("test"))]
    # the last rows: the heads' held-out acceptance uses the first ones
    return [prompt_ids(tok, [{"role": "user", "content": r["question"]}]) for r in rows[-N_PROMPTS:]]


def build():
    if EXTERNAL_TARGET:
        return build_external()
    from sglang_ext.core import tiny

    cfg = tiny.deepseek_v3_config(num_layers=8, moe_layers=1, hidden=512, heads=8, vocab=512, q_lora_rank=256,
                                  kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128, init_std=0.05,
                                  n_routed_experts=8, context=TARGET_CONTEXT)
    target = tiny.build_target(cfg, seed=0)
    tok = tiny.train_tokenizer(512)
    tiny.save_target(target, tok, f"{WORK}/target")
    rng = random.Random(0)

    def question():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + f" {rng.randint(0, 99)}"

    with open(f"{WORK}/train.jsonl", "w") as f:
        for _ in range(600):
            f.write(json.dumps({"messages": [{"role": "user", "content": question()},
                                             {"role": "assistant", "content": "x"}]}) + "\n")
    with open(f"{WORK}/heldout.jsonl", "w") as f:
        for _ in range(16):
            f.write(json.dumps({"question": question(), "answer": "#### 1"}) + "\n")
    prompts = []
    for _ in range(N_PROMPTS):
        ids = tok.apply_chat_template([{"role": "user", "content": question()}], add_generation_prompt=True,
                                      tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def train_heads() -> subprocess.Popen | None:
    """The heads not trained yet, one after the other in the background (the GPU is shared with a
    server start). One work directory: the MLA run reuses the regenerated data, not the checkpoint."""
    common = (f"--target {WORK}/target --work {WORK}/train --eval-dataset-path {WORK}/heldout.jsonl --eval-num-prompts 8 "
              f"--eval-max-new-tokens 48 --max-new-tokens 96 --draft-vocab-size 384 --lr 3e-3 --ttt-steps 4 "
              f"--device {os.environ.get('GPU_CHECK_TRAIN_DEVICE', 'cuda')}")
    mha_data, mla_data = f"messages:{WORK}/train.jsonl --epochs 6", f"messages:{WORK}/train.jsonl:300 --epochs 3"
    mla_extra = "--head-override q_lora_rank=null"
    if EXTERNAL_TARGET:  # a real chat target: real chat data, the GPU defaults (TTT 7), a larger draft vocabulary
        common = (f"--target {WORK}/target --work {WORK}/train --eval-dataset-path {gpu_data.gsm8k('test')} --eval-num-prompts 16 "
                  f"--max-new-tokens 256 --draft-vocab-size 16384 --lr 1e-3 --device cuda "
                  + os.environ.get("GPU_CHECK_TRAIN_ARGS", ""))
        n = os.environ.get("GPU_CHECK_TRAIN_CONVS", "1200")
        mha_data = mla_data = f"{gpu_data.sharegpt_spec(n)} --epochs 3"
        mla_extra = ""
    cmds = []
    if not os.path.exists(f"{WORK}/head-mha/model.safetensors"):
        cmds.append(f"{sys.executable} -P -m sglang_ext.training.train_draft {common} --data {mha_data} "
                    f"--draft-format mha --out {WORK}/head-mha")
    if not os.path.exists(f"{WORK}/head-mla/model.safetensors"):
        mla = (f"rm -rf {WORK}/train/checkpoint {WORK}/train/features && "
               f"{sys.executable} -P -m sglang_ext.training.train_draft {common} "
               f"--data {mla_data} --draft-format mla --out {WORK}/head-mla {mla_extra}")
        cmds.append(f"( ( {mla} ) || ( {mla} --precision fp32 ) )")  # the trainer stops at a non-finite loss
    if not cmds:
        return None
    return subprocess.Popen(" && ".join(cmds), shell=True, stdout=open(f"{WORK}/train.log", "a"),
                            stderr=subprocess.STDOUT,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def server_args(head: str | None, drafting: list[str]) -> list[str]:
    args = ["--model-path", f"{WORK}/target", "--enable-metrics", "--decode-log-interval", "1",
            *tp_args(int(os.environ.get("GPU_CHECK_TP", "1"))),
            "--max-running-requests", "64", "--cuda-graph-bs-decode", "1", "2", "4", "8", "16", "32", "64", *EXTRA_ARGS]
    if head is not None:
        args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", f"{WORK}/head-{head}",
                 *drafting]
    return args


def arm_args(name: str) -> list[str]:
    head, drafting = ARMS[name][:2]
    return (server_args(head, drafting) + (["--enable-deterministic-inference"] if name in DETERMINISTIC else [])
            + (["--attention-backend", "triton"] if name in TRITON_ONLY else []))


def accepted_drafts(meta: dict) -> int:
    """A response's accepted drafts: `spec_accepted_drafts` through SGLang 0.5.18, `spec_num_correct_drafts` (the
    same count under the name kept from 0.5.21 on) after."""
    return meta.get("spec_accepted_drafts", meta.get("spec_num_correct_drafts", 0))


def same_prompts_acceptance(srv: Server, head: str) -> dict | None:
    """The head's own acceptance estimate (reference decoder, written by train_draft) re-measured by the
    server on the same prompts, greedy, same token budget."""
    path = f"{WORK}/head-{head}/training_report.json"
    if not os.path.exists(path):
        return None
    from transformers import AutoTokenizer

    from sglang_ext.training.train_draft import gsm8k_prompts, prompts_unlike_report

    acc = json.load(open(path))["acceptance"]
    tok = AutoTokenizer.from_pretrained(f"{WORK}/target")
    ps = gsm8k_prompts(tok, acc["eval_data"], acc["prompts"])
    unlike = prompts_unlike_report(ps, acc["trained"].get("per_prompt") or [])
    if unlike or len(ps) != acc["prompts"]:  # a pairing with other prompts would mean nothing
        return {"prompts": len(ps), "error": f"{len(unlike)} prompts of {acc['eval_data']} are not the report's "
                                             f"(first: {unlike[:1]}), or fewer than its {acc['prompts']}"}
    sp = {"temperature": 0, "max_new_tokens": acc.get("max_new_tokens", 128)}
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: srv.post("/generate", {"input_ids": p, "sampling_params": sp}), ps))
    return same_prompts_row([{"output_ids": o.get("output_ids") or [],
                              "verify_steps": o["meta_info"].get("spec_verify_ct", 0),
                              "accepted_drafts": accepted_drafts(o["meta_info"])} for o in outs],
                            acc, tok.eos_token_id)


def same_prompts_row(served: list[dict], acc: dict, eos: int | None) -> dict:
    """The same-prompts figures from the server's rows (output_ids, verify_steps, accepted_drafts per prompt) and
    the head's report (`acceptance` of training_report.json). The rows are kept, so the figure can be recounted
    from the outputs (`sglang_ext.core.accounting.pair_with_reference` against the report's per_prompt)."""
    steps = sum(r["verify_steps"] for r in served)
    drafts = sum(r["accepted_drafts"] for r in served)
    row = {"prompts": len(served), "server_accepted_drafts_per_step": drafts / steps if steps else 0.0,
           "server_verify_steps": steps, "reference_accepted_drafts_per_step": acc["trained"]["accepted_drafts_per_step"],
           "reference_chain_steps": acc["chain_steps"]}
    if acc["trained"].get("per_prompt"):  # reports that keep their per-prompt rows
        row.update(pair_with_reference(served, acc["trained"]["per_prompt"], eos))
    row["server_per_prompt"] = served
    return row


def pair_with_reference(server: list[dict], reference: list[dict], eos: int | None) -> dict:
    """The server's and the reference decoder's acceptance on the same prompts, paired per prompt
    (`accounting.pair_with_reference`; the server may or may not return the trailing EOS)."""
    from sglang_ext.core.accounting import pair_with_reference as pair

    p = pair(server, reference, eos)
    return {"paired_difference": p["paired_difference"], "paired_se": p["paired_se"], "within_noise": p["within_noise"],
            "identical_outputs": p["identical_outputs"], "server_on_identical": p["measured_on_identical"],
            "reference_on_identical": p["reference_on_identical"]}


def rename_mla_head():
    path = f"{WORK}/head-mla/config.json"
    cfg = json.load(open(path))
    cfg["architectures"] = ["Eagle3DeepseekV3ForCausalLM"]  # a name upstream SGLang does not know
    json.dump(cfg, open(path, "w"), indent=1)


def run_prompts(srv: Server, prompts: list[list[int]], logprobs: bool, max_new: int | None,
                sampling: dict | None = None, concurrency: int = CONCURRENCY) -> list[dict]:
    def one(i):
        sp = {"temperature": 0, "max_new_tokens": max_new or 24 + (i % 5) * 9, **(sampling or {})}
        if max_new:
            sp["ignore_eos"] = True
        payload = {"input_ids": prompts[i], "sampling_params": sp}
        if logprobs:
            payload.update(return_logprob=True, top_logprobs_num=2, logprob_start_len=-1)
        r = srv.post("/generate", payload, timeout=600)
        meta = r["meta_info"]
        row = {"ids": r.get("output_ids") or [], "meta": {k: v for k, v in meta.items()
                                                          if k.startswith("spec") or k == "completion_tokens"}}
        if logprobs:
            row["top2"] = [[t[0] for t in step[:2]] for step in meta["output_top_logprobs"]]
        return row

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(prompts))))


def batch_noise_floor(srv: Server, prompts: list[list[int]], reference: list[dict]) -> dict:
    """The target alone against itself: the same server and prompts, one request at a time instead of
    CONCURRENCY in flight. Every parting here comes from batch composition alone (GEMM tiling, KV split
    counts, MoE routing ties), none from speculation: the floor a speculative arm's partings are read
    against. Under SGLang's deterministic mode it must be zero."""
    return compare(reference, run_prompts(srv, prompts, logprobs=False, max_new=None, concurrency=1))


def compare(ref: list[dict], rows: list[dict]) -> dict:
    same = near_tie = real = 0
    examples, gaps = [], []
    for i, (a, b) in enumerate(zip(ref, rows)):
        x, y = a["ids"], b["ids"]
        if x == y:
            same += 1
            continue
        k = next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y)))
        top2 = a["top2"][k] if k < len(a["top2"]) else []
        gap = top2[0] - top2[1] if len(top2) == 2 and None not in top2 else None
        if gap is not None and gap <= 0.02:
            near_tie += 1
        else:
            real += 1
            gaps.append(gap)
            if len(examples) < 3:
                examples.append({"prompt": i, "position": k, "gap": gap})
    known = sorted(g for g in gaps if g is not None)
    return {"identical": same, "near_tie_partings": near_tie, "other_partings": real, "examples": examples,
            "other_gaps_max": known[-1] if known else None,
            "other_gaps_median": known[len(known) // 2] if known else None}


def metrics_counters(text: str) -> dict:
    out = {"position": {}, "histogram": {}}
    for line in text.splitlines():
        if not line.startswith("sglang:spec_ext_"):
            continue
        m = re.match(r'(sglang:spec_ext_\w+?)(_total)?\{([^}]*)\} ([-\d.e+]+)', line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3), float(m.group(4))
        if name.endswith("position_accepted"):
            out["position"][re.search(r'position="(\d+)"', labels).group(1)] = value
        elif name.endswith("accepted_drafts_histogram"):
            out["histogram"][re.search(r'accepted="(\d+)"', labels).group(1)] = value
        elif m.group(2) or name.endswith("per_step"):
            out[name[len("sglang:spec_ext_"):]] = value
    return out


LOG_TOTALS = r"finished reqs: (\d+) \(accepted drafts (\d+) over (\d+) verify steps\)"


def plugin_state(srv: Server, key: str):
    """One of the plugin's entries in /get_server_info's first internal state (None: a server without it)."""
    info = json.loads(srv.get("/get_server_info"))
    return (info.get("internal_states") or [{}])[0].get(key)


def snapshot(srv: Server) -> dict:
    """Every view's totals before our prompts (the server's warmup request is already counted)."""
    prom = metrics_counters(srv.get("/metrics"))
    ledger = plugin_state(srv, "sglang_ext_acceptance") or {}
    last = re.findall(LOG_TOTALS, srv.log())
    return {"metrics": {"requests": prom.get("requests", 0.0), "verify_steps": prom.get("verify_steps", 0.0),
                        "accepted_drafts": prom.get("accepted_drafts", 0.0),
                        "position": [prom["position"].get(str(i), 0.0) for i in (1, 2, 3)]},
            "server_info": {"requests": ledger.get("finished_requests", 0), "verify_steps": ledger.get("verify_steps", 0),
                            "accepted_drafts": ledger.get("accepted_drafts", 0),
                            "position": [round(p * ledger.get("verify_steps", 0)) for p in
                                         ledger.get("per_position_acceptance", [0, 0, 0])[:3]]},
            "log_line": ({"requests": int(last[-1][0]), "accepted_drafts": int(last[-1][1]),
                          "verify_steps": int(last[-1][2])} if last else
                         {"requests": 0, "accepted_drafts": 0, "verify_steps": 0})}


def _minus(view, base):
    if view is None:
        return None
    out = {}
    for k, v in view.items():
        if k == "position":
            out[k] = [None if x is None else x - b for x, b in zip(v, base[k])]
        else:
            out[k] = None if v is None else v - base.get(k, 0)
    return out


def accounting(rows: list[dict], srv: Server, log: str, base: dict) -> dict:
    metas = [r["meta"] for r in rows]
    inv_fail = [i for i, m in enumerate(metas)
                if m.get("spec_verify_ct") and m["completion_tokens"] != accepted_drafts(m) + m["spec_verify_ct"] + 1]
    steps = sum(m.get("spec_verify_ct", 0) for m in metas)
    accepted = sum(accepted_drafts(m) for m in metas)
    positions = [0, 0, 0]
    for m in metas:
        for i, c in enumerate(m.get("spec_position_accepted", [])[:3]):
            positions[i] += c
    time.sleep(2)
    prom = metrics_counters(srv.get("/metrics"))
    ledger = plugin_state(srv, "sglang_ext_acceptance") or {}
    last = re.findall(LOG_TOTALS, log)
    sums = {"requests": len(metas), "verify_steps": steps, "accepted_drafts": accepted, "position": positions}
    views = {
        "meta_info": sums,
        "metrics": {"requests": prom.get("requests"), "verify_steps": prom.get("verify_steps"),
                    "accepted_drafts": prom.get("accepted_drafts"),
                    # a Prometheus counter child exists once incremented: absent = 0
                    "position": [prom["position"].get(str(i), 0.0) for i in (1, 2, 3)]},
        "server_info": {"requests": ledger.get("finished_requests"), "verify_steps": ledger.get("verify_steps"),
                        "accepted_drafts": ledger.get("accepted_drafts"),
                        "position": [round(p * ledger.get("verify_steps", 0)) for p in
                                     ledger.get("per_position_acceptance", [])[:3]]},
        "log_line": ({"requests": int(last[-1][0]), "accepted_drafts": int(last[-1][1]),
                      "verify_steps": int(last[-1][2])} if last else None),
    }
    views = {k: (v if k == "meta_info" else _minus(v, base[k])) for k, v in views.items()}

    def agree(view):
        if view is None:
            return False
        for k, v in view.items():
            if k == "position":
                if [None if x is None else int(x) for x in v] != positions:
                    return False
            elif v is None or float(v) != float(sums[k]):
                return False
        return True

    return {"invariant_failures": len(inv_fail), "accepted_drafts_per_step": accepted / steps if steps else 0.0,
            "per_position": [p / steps if steps else 0.0 for p in positions], "views": views,
            "all_views_agree": all(agree(v) for v in views.values()),
            "discarded_drafts": ledger.get("discarded_drafts")}


def pool_lines(log: str, head: str, env: dict) -> dict:
    lines = re.findall(r"\[sglang_ext\] (KV [^\n]*|(?:draft|target) KV pool allocated[^\n]*|draft KV cache dtype[^\n]*)",
                       log)
    target = TargetConfig.load(f"{WORK}/target")
    draft = Eagle3DraftConfig.load(f"{WORK}/head-{head}", strict=False)
    dtype = "fp8_e4m3" if env.get("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE") == "fp8_e4m3" else "bf16"
    tp = int(os.environ.get("GPU_CHECK_TP", "1"))  # per rank: MHA heads shard their KV heads
    expect = {"target_bytes_per_token": target_kv_bytes_per_token(target, "bf16", tp),
              "draft_bytes_per_token": draft_kv_bytes_per_token(draft, dtype, tp)}
    got = {}
    m = re.search(r"KV bytes/token per rank: target (\d+) .*?, draft (\d+)", log)
    if m:
        got.update(target_bytes_per_token=int(m.group(1)), draft_bytes_per_token=int(m.group(2)))
    for who in ("target", "draft"):
        m = re.search(who + r" KV pool allocated: (\d+) tokens, ([\d.]+) GiB, (\d+) B/token", log)
        if m:
            got[f"{who}_allocated"] = {"tokens": int(m.group(1)), "gib": float(m.group(2)),
                                       "bytes_per_token": int(m.group(3))}
    ok = (got.get("target_bytes_per_token") == expect["target_bytes_per_token"]
          and got.get("draft_bytes_per_token") == expect["draft_bytes_per_token"]
          and got.get("draft_allocated", {}).get("bytes_per_token") == expect["draft_bytes_per_token"]
          and got.get("target_allocated", {}).get("bytes_per_token") == expect["target_bytes_per_token"])
    return {"expected": expect, "logged": got, "arithmetic_matches": ok, "lines": lines[:6]}


def prepare_head(head: str | None) -> None:
    if head == "mla":
        rename_mla_head()
    if head == "mha-upstream":  # the same head, its ids written the way upstream reads undeclared ids
        from sglang_ext.eval.spec_bench import upstream_copy

        upstream_copy(f"{WORK}/head-mha", f"{WORK}/head-mha-upstream")
    if head is not None:  # SGLang reads the draft directory's tokenizer files too
        os.system(f"cp -n {WORK}/target/tokenizer*.json {WORK}/target/chat_template.jinja {WORK}/head-{head}/ "
                  "2>/dev/null")


def backend_of(name: str) -> str | None:
    """The attention backend an arm's server runs (None: SGLang's own choice)."""
    return "triton" if name in TRITON_ONLY else attention_backend()


def reference_key(name: str) -> str:
    """Where the target alone's outputs for this arm's comparison live: deterministic mode or not, and the backend
    when it is not the run's own (a Triton-only arm in a run on another backend is read against target-triton)."""
    own = backend_of(name)
    return ("reference-deterministic" if name in DETERMINISTIC else "reference") + \
        ("" if own == attention_backend() else f"-{own}")


def reference_arm(name: str) -> str:
    key = reference_key(name)
    return next(a for a in ARMS if ARMS[a][0] is None and reference_key(a) == key)


def target_noise_floor(state: dict, name: str) -> int | None:
    """The partings beyond near-ties of the target alone against itself (one request at a time vs CONCURRENCY in
    flight) on this arm's reference server; None when that arm has not run."""
    row = state.get("results", {}).get(reference_arm(name), {})
    return (row.get("batch_noise_floor") or {}).get("other_partings")


def arm_passes(accounting_ok: bool, floor: int | None, other_partings: int) -> bool:
    """Accounting always; greedy equality (no parting beyond a near-tie) unless the target's own floor has such
    partings (a floor not measured asks it too)."""
    return accounting_ok and (bool(floor) or other_partings == 0)


def evaluate(name: str, srv: Server, state: dict, t_start: float) -> dict:
    """One arm's server, already started: its checks (module docstring)."""
    head, drafting, env, refuse, max_new = ARMS[name]
    prompts = state["prompts"]
    ref_key = reference_key(name)
    row = {"arm": name, "head": head, "drafting": " ".join(drafting), "env": env,
           "attention_backend": backend_of(name) or "SGLang's default"}
    ok = srv.wait_ready(600)
    row["start_s"] = round(time.time() - t_start)
    log = srv.log()
    if refuse:
        err = next(iter(re.findall(r"ConfigError: [^\n]*", log)), None)
        row.update(refused=not ok, error=err, passed=(not ok) and err is not None
                   and "--speculative-draft-kv-cache-dtype" in err)
        return row
    if not ok:
        row.update(passed=False, log_tail=log[-3000:])
        return row
    resolved = re.findall(r"attention_backend='([\w]+)'", log)
    if resolved:
        row["attention_backend_resolved"] = resolved[0]
    base = snapshot(srv) if head not in (None, "mha-upstream") else None
    t = time.time()
    sampled = name.endswith("-sampled")
    rows = run_prompts(srv, prompts, logprobs=head is None, max_new=max_new, sampling=SAMPLED if sampled else None)
    state.setdefault("outputs", {})[name] = [r["ids"] for r in rows]
    row["requests_s"] = round(time.time() - t, 1)
    row["output_tokens"] = sum(len(r["ids"]) for r in rows)
    log = srv.log()
    if head is None:
        state[ref_key] = rows
        row["batch_noise_floor"] = batch_noise_floor(srv, prompts, rows)
        row["passed"] = True
        return row
    if head == "mha-upstream":
        metas = [r["meta"] for r in rows]
        if ref_key in state:
            row["vs_target"] = compare(state[ref_key], rows)
        row["upstream_invariant_failures"] = sum(
            1 for m in metas if m.get("spec_verify_ct") and m["completion_tokens"] !=
            accepted_drafts(m) + m["spec_verify_ct"] + 1)
        row["accepted_drafts_per_step"] = (sum(accepted_drafts(m) for m in metas) /
                                           max(1, sum(m.get("spec_verify_ct", 0) for m in metas)))
        row["passed"] = True
        return row
    acc = accounting(rows, srv, log, base)
    row.update(acc)
    row["pool"] = pool_lines(log, head, env)
    if "--speculative-adaptive" in drafting:  # which depths ran: depth 0 must have been reached
        row["adaptive"] = {"plain_decode_depth0": "depth 0 runs the target as a plain decode step" in log,
                           "switches": len(re.findall(r"Switch adaptive runtime state", log)),
                           "summaries": re.findall(r"adaptive speculation summary: ([^\n]*)", log)[-6:]}
    accounting_ok = acc["invariant_failures"] == 0 and acc["all_views_agree"] and row["pool"]["arithmetic_matches"]
    if sampled:
        row.update(sampling=SAMPLED, accounting_passed=accounting_ok, passed=accounting_ok)
    elif max_new is None:
        if ref_key not in state:
            row.update(passed=False, error=f"no reference: run {reference_arm(name)} before {name}")
            return row
        row["vs_target"] = compare(state[ref_key], rows)
        up = state.get("outputs", {}).get("upstream-mha-chain")
        if up is not None and name == "mha-chain":
            row["identical_to_upstream"] = sum(a == b for a, b in zip(up, [r["ids"] for r in rows]))
        row["accounting_passed"] = accounting_ok
        floor = target_noise_floor(state, name)
        row["target_noise_floor_other_partings"] = floor
        # greedy equality is asked where the target alone is batch-invariant (its own floor has no partings beyond
        # near-ties: Triton, deterministic mode); elsewhere (FA3's default kernels) the partings are reported
        # beside the floor, which speculation cannot be held to
        row["greedy_equality_asked"] = not floor
        row["passed"] = arm_passes(accounting_ok, floor, row["vs_target"]["other_partings"])
        if EXTERNAL_TARGET:
            row["same_prompts"] = same_prompts_acceptance(srv, head)
            gsm_out = os.environ.get("GPU_CHECK_GSM8K_OUT")
            if gsm_out and name == "mha-chain":  # the GSM8K eval against the server, spec on
                from sglang_ext.eval import gsm8k as G

                row["gsm8k_rc"] = G.main([
                    "--base-url", srv.url, "--tokenizer", f"{WORK}/target",
                    "--dataset-path", gpu_data.gsm8k("test"), "--fewshot-path",
                    gpu_data.gsm8k("train"), "--num-prompts", os.environ.get("GPU_CHECK_GSM8K_LIMIT", "200"),
                    "--out", gsm_out])
    else:
        sim = float(env["SGLANG_SIMULATE_ACC_LEN"]) - 1
        live = re.findall(r"accepted drafts/step: ([\d.]+) \(no bonus; (\d+) req-steps\)", log)
        steps = sum(int(n) for _, n in live)
        row["simulated_accepted_drafts"] = sim
        row["log_live_accepted_drafts_per_step"] = sum(float(a) * int(n) for a, n in live) / steps if steps else 0.0
        row["passed"] = (abs(acc["accepted_drafts_per_step"] - sim) <= 0.02 * sim
                         and acc["invariant_failures"] == 0 and acc["all_views_agree"])
    return row


def groups_of(arms: list[str], parallel: int, headless_apart: bool = False) -> list[list[str]]:
    """Arms in groups whose servers start side by side (GPU_CHECK_PARALLEL; a server start is most of an arm's
    time). The target-alone arms go first: every other arm is read against their outputs. `headless_apart` (heads
    still training): they form groups of their own, which run while the heads train."""
    ordered = sorted(arms, key=lambda a: ARMS[a][0] is not None)
    n = max(1, parallel)
    if not headless_apart:
        return [ordered[i:i + n] for i in range(0, len(ordered), n)]
    headless = [a for a in ordered if ARMS[a][0] is None]
    rest = ordered[len(headless):]
    return [headless[i:i + n] for i in range(0, len(headless), n)] + [rest[i:i + n] for i in range(0, len(rest), n)]


def load_state() -> dict:
    """WORK's state.json (the prompts, the arms' results), the target and prompts built first where missing."""
    os.makedirs(WORK, exist_ok=True)
    state_path = f"{WORK}/state.json"
    state = json.load(open(state_path)) if os.path.exists(state_path) else {}
    if "prompts" not in state or not os.path.exists(f"{WORK}/target/model.safetensors"):
        state["prompts"] = build()
        json.dump(state, open(state_path, "w"))
    return state


def prepare() -> int:
    """The check's target, prompts and heads in WORK, built and trained where missing, and nothing served: what
    check_serving and check_traffic start from (the training runs on GPU_CHECK_TRAIN_DEVICE)."""
    state = load_state()
    trainer = train_heads()
    if trainer is not None and trainer.wait() != 0:
        print(open(f"{WORK}/train.log").read()[-3000:], flush=True)
        return 1
    print(f"[check] {WORK}: target, {len(state['prompts'])} prompts, heads "
          f"{[h for h in ('mha', 'mla') if os.path.exists(f'{WORK}/head-{h}/model.safetensors')]}", flush=True)
    return 0


def main():
    if sys.argv[1:] == ["prepare"]:
        raise SystemExit(prepare())
    os.makedirs(OUT, exist_ok=True)  # the report goes there at the end: a missing folder must not lose a run
    arms = sys.argv[1:] or list(ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    t0 = time.time()
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", "1e9"))  # no new arm after this many seconds
    parallel = int(os.environ.get("GPU_CHECK_PARALLEL", "1"))
    restore = os.environ.get("GPU_CHECK_RESTORE")  # a previous call's $OUT/state (machine went cold)
    if restore and not os.path.exists(f"{WORK}/state.json"):
        os.system(f"mkdir -p {WORK} && cp -r {restore}/. {WORK}/")
    state_path = f"{WORK}/state.json"
    state = load_state()
    trainer = None if os.environ.get("GPU_CHECK_NO_TRAIN") else train_heads()
    print(f"[check] built in {time.time() - t0:.0f}s; {len(state['prompts'])} prompts; backend "
          f"{attention_backend() or 'SGLang default'}; {parallel} server(s) at a time", flush=True)
    results = state.setdefault("results", {})
    for group in groups_of(arms, parallel, headless_apart=trainer is not None):
        if time.time() - t0 > deadline:
            print(f"[check] {' '.join(group)}: not started (deadline {deadline:.0f}s)", flush=True)
            continue
        # the MHA head (restored or trained first) can be served while the MLA head trains
        heads = {ARMS[n][0] for n in group} - {None}
        if trainer is not None and ("mla" in heads or any(not os.path.exists(f"{WORK}/head-{h}/config.json")
                                                          for h in heads if h != "mha-upstream")):
            rc = trainer.wait()
            print(open(f"{WORK}/train.log").read()[-3000:], flush=True)
            if rc != 0:
                print("[check] training failed; stopping")
                break
            trainer = None
        for h in heads:
            prepare_head(h)
        t_start = time.time()
        servers = {n: Server(f"serve-{n}", arm_args(n), ARMS[n][2], port_number=port() + i)
                   for i, n in enumerate(group)}

        def one(name):
            with servers[name] as srv:
                row = evaluate(name, srv, state, t_start)
            row["arm_s"] = round(time.time() - t0)
            return name, row

        try:
            # the target-alone arms first (the others are read against them), then the rest; within each set the
            # servers are checked at once (correctness checks, not timings)
            for batch in ([n for n in group if ARMS[n][0] is None], [n for n in group if ARMS[n][0] is not None]):
                with cf.ThreadPoolExecutor(max(1, len(batch))) as pool:
                    done = list(pool.map(one, batch))
                for name, row in done:
                    results[name] = row
                    brief = {k: v for k, v in row.items() if k not in ("lines",)}
                    if row.get("same_prompts"):  # its per-prompt rows stay in serving.json, out of the log
                        brief["same_prompts"] = {k: v for k, v in row["same_prompts"].items()
                                                 if k != "server_per_prompt"}
                    print(json.dumps(brief, indent=1), flush=True)
                json.dump(state, open(state_path, "w"))
        finally:
            for srv in servers.values():
                srv.stop()
    summary = {k: v for k, v in state.items() if k != "prompts" and not k.startswith("reference")}
    tag = attention_backend() or "default"
    json.dump(summary, open(f"{OUT}/serving.json", "w"), indent=1)
    os.system(f"mkdir -p {OUT}/state && cp {WORK}/state.json {OUT}/state/ && for h in mha mla; do "
              f"mkdir -p {OUT}/state/head-$h && cp {WORK}/head-$h/config.json {WORK}/head-$h/model.safetensors "
              f"{OUT}/state/head-$h/ 2>/dev/null; done")
    os.system(f"cp {WORK}/train.log {OUT}/ 2>/dev/null; mkdir -p {OUT}/logs; "
              f"for f in /tmp/gpu-logs/serve-*.log; do tail -c 200000 $f > {OUT}/logs/$(basename $f); done")
    print(f"\nbackend {tag}\narm                                  backend  pass   acct-ok  identical near-tie other(max gap)  "
          "same-as-upstream  invariant-fail  views-agree  acc/step  draft B/tok  start_s  same prompts: "
          "server/reference (2 se)")
    for name, r in results.items():
        v = r.get("vs_target", {})
        other = f"{v.get('other_partings', '-')}({v.get('other_gaps_max')})" if v else "-"
        print(f"{name:<37}{str(r.get('attention_backend_resolved', r.get('attention_backend', '?')))[:8]:<9}"
              f"{str(r.get('passed')):<7}{str(r.get('accounting_passed', r.get('passed'))):<9}{v.get('identical', '-'):<10}"
              f"{v.get('near_tie_partings', '-'):<9}{other:<15}{r.get('identical_to_upstream', '-'):<18}"
              f"{r.get('invariant_failures', r.get('upstream_invariant_failures', '-')):<16}"
              f"{str(r.get('all_views_agree', '-')):<13}{r.get('accepted_drafts_per_step', 0):<10.3f}"
              f"{r.get('pool', {}).get('logged', {}).get('draft_bytes_per_token', '-'):<13}{str(r.get('start_s')):<9}"
              f"{same_prompts_cell(r.get('same_prompts'))}")


def same_prompts_cell(same: dict | None) -> str:
    if not same:
        return "-"
    if "error" in same:
        return f"NOT PAIRED: {same['error']}"
    cell = f"{same['server_accepted_drafts_per_step']:.3f}/{same['reference_accepted_drafts_per_step']:.3f}"
    if same.get("paired_se") is not None:
        cell += f" ({2 * same['paired_se']:.3f}) {'within noise' if same['within_noise'] else 'OUTSIDE noise'}"
    elif "paired_se" in same:
        cell += " (one prompt: noise unknown)"
    if "identical_outputs" in same:
        cell += f"; {same['identical_outputs']}/{same['prompts']} outputs identical"
    return cell


if __name__ == "__main__":
    main()
