"""GPU check of the trainer's data parallelism (the trainer issue: `torchrun` for several GPUs): the same
head, features and global batch trained (a) by one process on one GPU with gradient accumulation 2 and (b)
by `torchrun --nproc_per_node 2` on two GPUs (NCCL) with accumulation 1. Each optimizer step sees the same
units, split across ranks and summed, so the weights must agree (fp32: to reduction order), and the two-GPU
run's tokens/s shows what data parallelism buys. Then the same in bf16 autocast, the GPU default, for speed.

    PYTHONPATH=/tmp/site:. python tests/gpu/check_ddp.py [--device cpu]   # cpu: gloo, a dry run of the script

Target: a DeepseekV3 built from a config (hidden 1024, 8 layers, random weights) with the tiny ChatML
tokenizer; 512 synthetic chat conversations; features captured in-process (sglang_ext.training.features); an MHA head
of the convention's layers. Prints a table; writes $OUT/ddp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the checkout last: an installed sglang_ext (a wheel on PYTHONPATH) wins; else the editable install's
sys.path.append(REPO)


def prepare(work: str, device: str, conversations: int, hidden: int) -> None:
    import torch
    from safetensors.torch import save_file

    from sglang_ext.config.aux_layers import default_output_ids
    from sglang_ext.core import tiny
    from sglang_ext.core.heads import Eagle3Head, head_config_for
    from sglang_ext.training import data as D
    from sglang_ext.training.features import FeatureExtractor, read_shards, write_shards
    from sglang_ext.training.trainer import draft_vocabulary, init_head_from_target

    tok = tiny.train_tokenizer(512)
    cfg = tiny.deepseek_v3_config(num_layers=8, hidden=hidden, heads=8, vocab=len(tok), moe_layers=0,
                                  q_lora_rank=hidden // 4, kv_lora_rank=hidden // 8, qk_nope=64, qk_rope=32, v_head=64)
    target = tiny.build_target(cfg, seed=0).to(device)
    words = ["the", "number", "of", "apples", "is", "what", "total", "cost", "each", "has", "many", "how"]
    convs = [D.Conversation(str(i), [
        {"role": "user", "content": " ".join(words[(i * k) % len(words)] for k in range(1, 40 + i % 60))},
        {"role": "assistant", "content": " ".join(words[(i + k * k) % len(words)] for k in range(30 + i % 90))}])
        for i in range(conversations)]
    aux = default_output_ids(cfg.num_hidden_layers)
    write_shards(FeatureExtractor(target, tok, aux, dtype=torch.float32), convs, os.path.join(work, "features"))
    records = read_shards(os.path.join(work, "features"))
    torch.manual_seed(0)
    head = Eagle3Head(head_config_for(target.config, "mha", aux, draft_vocab_size=256))
    head.set_vocab_mapping(draft_vocabulary(records, 256, len(tok)))
    init_head_from_target(head, target.cpu())
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, os.path.join(work, "head.safetensors"))
    save_file({"w": target.get_output_embeddings().weight.detach().contiguous()}, os.path.join(work, "lm.safetensors"))
    json.dump(head.config.to_dict(), open(os.path.join(work, "head.json"), "w"))


def run_ddp(work: str, device: str, train_cfg: dict, port: int) -> dict:
    json.dump(train_cfg, open(os.path.join(work, "train.json"), "w"))
    env = dict(os.environ, DDP_DEVICE=device, PYTHONPATH=":".join(filter(None, [os.environ.get("PYTHONPATH"), REPO])))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(port), os.path.join(REPO, "tests", "workers", "ddp_worker.py"), work], env=env, capture_output=True,
                       text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"torchrun failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.load(open(os.path.join(work, "ddp_metrics.json")))


def run_single(work: str, device: str, train_cfg: dict) -> tuple[dict, dict]:
    import torch

    sys.path.insert(0, os.path.join(REPO, "tests", "workers"))
    from ddp_worker import train_dir

    cfg = dict(train_cfg, grad_accum=2 * train_cfg["grad_accum"])  # the two ranks' units in one process
    head, metrics = train_dir(work, torch.device("cuda:0" if device == "cuda" else "cpu"), cfg)
    return metrics, {k: v.detach().cpu() for k, v in head.state_dict().items()}


def compare(work: str, single: dict) -> dict:
    from safetensors.torch import load_file

    ddp = load_file(os.path.join(work, "trained.safetensors"))
    start = load_file(os.path.join(work, "head.safetensors"))
    worst, moved = 0.0, 0.0
    for k, v in single.items():
        diff = (ddp[k].float() - v.float()).abs().max().item()
        scale = (v.float() - start[k].float()).abs().max().item()  # how far training moved this tensor
        worst = max(worst, diff / scale if scale > 0 else diff)
        moved = max(moved, scale)
    return {"max_diff_relative_to_update": worst, "max_update": moved}


def steady_rate(metrics: dict) -> float:
    """Tokens/s after the warm-up steps; the whole run's for a run too short to have any after them."""
    s = metrics.get("steady")
    if s and s["seconds"] > 0:
        return s["tokens"] / s["seconds"]
    return metrics["tokens_trained"] / metrics["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--conversations", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--work", default="/tmp/ddp-check")
    ap.add_argument("--speed-steps", type=int, default=60)
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    t = time.time()
    if not os.path.exists(os.path.join(args.work, "head.json")):
        prepare(args.work, args.device, args.conversations, args.hidden)
    out = {"device": args.device, "prepare_s": round(time.time() - t, 1), "runs": {}}
    common = dict(ttt_steps=7, lr=2e-3, grad_accum=1, batch_tokens=8192 if args.device == "cuda" else 1024, seed=3)
    rows = []
    for name, cfg in (("fp32, equality", dict(common, max_steps=6, bf16=False)),
                      ("bf16, speed", dict(common, max_steps=args.speed_steps, bf16=True))):
        ddp = run_ddp(args.work, args.device, cfg, 29641 + len(rows))
        single, weights = run_single(args.work, args.device, cfg)
        agree = compare(args.work, weights)
        # throughput after the warm-up steps (sglang_ext.training.trainer's "steady"): the first steps carry NCCL's
        # communicator setup and kernel autotuning, which in an earlier run made two GPUs look 2-4x slower than one
        r = {"config": cfg, "two_ranks": ddp, "one_process": single, **agree,
             "tokens_per_s_two_ranks": steady_rate(ddp), "tokens_per_s_one_process": steady_rate(single),
             "tokens_per_s_with_warmup": [ddp["tokens_trained"] / ddp["seconds"],
                                          single["tokens_trained"] / single["seconds"]]}
        r["speedup"] = r["tokens_per_s_two_ranks"] / r["tokens_per_s_one_process"]
        out["runs"][name] = r
        rows.append((name, r))
    print("run              steps  tokens (2 ranks / 1 proc)   tok/s 2 ranks  tok/s 1 proc  speedup  "
          "max |w_ddp - w_1| / max |update|   (tok/s after the warm-up steps)")
    for name, r in rows:
        print(f"{name:<17}{r['two_ranks']['step']:<7}{r['two_ranks']['tokens_trained']} / "
              f"{r['one_process']['tokens_trained']:<14}{r['tokens_per_s_two_ranks']:<15.0f}"
              f"{r['tokens_per_s_one_process']:<14.0f}{r['speedup']:<9.2f}{r['max_diff_relative_to_update']:.2e}")
    if os.environ.get("OUT"):
        json.dump(out, open(os.path.join(os.environ["OUT"], "ddp.json"), "w"), indent=1)
    eq = out["runs"]["fp32, equality"]
    # the two runs must train on the same tokens; fp32 weights agree to reduction order (tolerance: 1e-2 of
    # the update, far below a different batch's effect, which moves weights by the order of the update)
    ok = eq["two_ranks"]["tokens_trained"] == eq["one_process"]["tokens_trained"] and \
        eq["max_diff_relative_to_update"] < 1e-2
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
