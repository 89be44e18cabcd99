"""`eagle3-demo` (`make demo`): the product end to end on a CPU in about a minute, offline.

1. builds a tiny DeepseekV3 target (MLA attention, one MoE layer, random weights) and its ChatML tokenizer;
2. trains an MLA-format Eagle3 head for it with the trainer (`eagle3-train`): regenerates GSM8K questions with the
   target through its chat template, captures the target's hidden states at the head's aux layers, trains with
   test-time training, exports a checkpoint SGLang loads, and measures acceptance with the reference decoder,
   trained against untrained;
3. checks the exported head against the target as a server would at startup (`eagle3-inspect`).

A random target is hard to predict: acceptance stays low (measured 2026-12-03: 0.083 accepted drafts per step,
untrained 0.064, standard error 0.033, in 43 s on 2 cores); what the demo shows is the pipeline end to end and what
the server would do with the pair. A real chat target is what `make train-draft` trains for (SmolLM2, ~20 minutes).

    eagle3-demo [--out out/demo]
"""

from __future__ import annotations

import argparse
import os
import time

from sglang_ext.commands import VERSION, prog


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("demo"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=VERSION)
    ap.add_argument("--out", default="out/demo", help="where the target, the head and the trainer's work go")
    args = ap.parse_args(argv)
    from sglang_ext import inspect_draft
    from sglang_ext.core import tiny
    from sglang_ext.data import gsm8k
    from sglang_ext.training import train_draft

    t0 = time.time()
    target_dir = os.path.join(args.out, "target")
    print(f"[demo] 1/3 a tiny DeepseekV3 target (MLA, 4 layers, random weights) -> {target_dir}")
    cfg = tiny.deepseek_v3_config(num_layers=4, hidden=128, heads=4, vocab=512, init_std=0.05)
    tiny.save_target(tiny.build_target(cfg, seed=0), tiny.train_tokenizer(512), target_dir)
    head_dir = os.path.join(args.out, "head")
    print("[demo] 2/3 train an MLA-format Eagle3 head for it (eagle3-train)")
    rc = train_draft.main(["--target", target_dir, "--draft-format", "mla", "--device", "cpu", "--aux-layers", "0,1,2",
                           "--data", f"gsm8k:{gsm8k('train')}:240", "--max-new-tokens", "32",
                           "--draft-vocab-size", "256", "--epochs", "6", "--lr", "3e-3", "--grad-accum", "1",
                           "--eval-num-prompts", "8", "--eval-max-new-tokens", "32", "--compare-untrained",
                           "--time-budget-minutes", "3", "--work", os.path.join(args.out, "work"), "--out", head_dir])
    if rc:
        return rc
    print("[demo] 3/3 the exported head against its target, as the server checks them at startup (eagle3-inspect)")
    rc = inspect_draft.main([head_dir, "--target", target_dir])
    print(f"[demo] done in {time.time() - t0:.0f}s. Serve the pair on a GPU with:\n"
          f"  python -m sglang.launch_server --model-path {target_dir} --speculative-algorithm EAGLE3 "
          f"--speculative-draft-model-path {head_dir} --speculative-num-steps 3 --speculative-eagle-topk 1 "
          "--speculative-num-draft-tokens 4")
    return rc
