"""Re-measure an exported head's acceptance estimate: load the head from its exported files (as a server would, not
from the trainer's memory), run the core's reference decoder on the same prompts as its training_report.json, and
pair the two per prompt.

    eagle3-remeasure --draft out/draft --target TARGET [--device cpu] [--dtype fp32] [--num-prompts N]

The report's figure is one measurement (another precision, device or batch parts greedy outputs, and a parted prompt
accepts differently from there on), so "the same" means within the paired noise: |difference| <= 2 paired standard
errors (docs/metrics.md). Exit status 0 when within it, 1 when not, 2 on bad input -- including prompts that are not
the report's (each reported prompt keeps a digest of its token ids; reports written before 2026-12-02 have none).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from sglang_ext.commands import VERSION, prog

PROG = prog("remeasure")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class RemeasureError(ValueError):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=VERSION)
    ap.add_argument("--draft", required=True, help="an exported head directory holding training_report.json")
    ap.add_argument("--target", required=True, help="the target it was trained on (directory, hub name or GGUF)")
    ap.add_argument("--dataset-path", help="the report's GSM8K source, where its recorded path is not readable here "
                                        "(e.g. a report written on another machine)")
    ap.add_argument("--num-prompts", type=int, help="only the report's first N prompts (default: all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--out", help="write the comparison, with both sides' per-prompt counts, to this JSON file")
    args = ap.parse_args(argv)
    if args.num_prompts is not None and args.num_prompts < 1:
        ap.error(f"--num-prompts {args.num_prompts}: a number of prompts >= 1")
    return args


def reference_of(draft: str) -> dict:
    """The report's acceptance section, checked for what a paired re-measurement needs."""
    path = os.path.join(draft, "training_report.json")
    if not os.path.isfile(path):
        raise RemeasureError(f"--draft {draft}: no training_report.json (a head exported by eagle3-train "
                             "has one); for another head, measure it with `eagle3-eval-gsm8k --draft ...`")
    try:
        with open(path) as f:
            acc = json.load(f).get("acceptance") or {}
    except (ValueError, AttributeError) as e:  # not JSON, or not an object
        raise RemeasureError(f"{path}: not a training report ({e}); re-export the head with eagle3-train")
    trained = acc.get("trained") or {}
    if not trained.get("per_prompt"):
        raise RemeasureError(f"{path}: acceptance.trained.per_prompt is missing (reports written before 2026-12-01 kept "
                             "totals only, and a --target-weights-only run has no estimate): nothing to pair against")
    for field in ("eval_data", "prompts", "chain_steps", "max_new_tokens"):
        if field not in acc:
            raise RemeasureError(f"{path}: acceptance.{field} is missing; re-export the head with eagle3-train")
    return acc


def eval_source(acc: dict, override: str | None) -> str:
    src = override or acc["eval_data"]
    looks_local = src.startswith((os.sep, ".", "~")) or src.endswith((".json", ".jsonl", ".gz"))  # else a hub name
    if looks_local and not os.path.exists(src):
        if override:
            raise RemeasureError(f"--dataset-path {src!r}: no such file; give the report's GSM8K file "
                                 f"(its acceptance.eval_data was {acc['eval_data']!r})")
        raise RemeasureError(f"acceptance.eval_data {src!r} is not readable here; pass the same file with "
                             "--dataset-path (e.g. the packaged GSM8K test split, sglang_ext/data/gsm8k/test.jsonl)")
    return src


def compare(mine: list[dict], ref: list[dict]) -> dict:
    from sglang_ext.core.accounting import pair_with_reference

    p = pair_with_reference(mine, ref)  # both from the reference decoder: outputs compared as they are
    return {"prompts": len(mine), "remeasured": p["measured"], "report": p["reference"],
            **{k: p[k] for k in ("paired_difference", "paired_se", "within_noise", "identical_outputs")}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        acc = reference_of(args.draft)
        src = eval_source(acc, args.dataset_path)
    except RemeasureError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    import torch

    from sglang_ext.core.heads import Eagle3Head
    from sglang_ext.core.targets import load_target, load_tokenizer
    from sglang_ext.training.train_draft import acceptance_estimate, gsm8k_prompts, prompts_unlike_report

    dtype = getattr(torch, DTYPES[args.dtype])
    tok = load_tokenizer(args.target)
    target = load_target(args.target, dtype=dtype, device=args.device)
    head = Eagle3Head.from_pretrained(args.draft, target.get_input_embeddings().weight, dtype=dtype).to(args.device)
    n = min(args.num_prompts or acc["prompts"], acc["prompts"])
    prompts = gsm8k_prompts(tok, src, acc["prompts"])[:n]
    ref = acc["trained"]["per_prompt"][:n]
    if len(prompts) != len(ref):
        print(f"{PROG}: error: {src} gives {len(prompts)} prompts, the report has {len(ref)}: "
              "not the report's source; pass it with --dataset-path", file=sys.stderr)
        return 2
    unlike = prompts_unlike_report(prompts, ref)
    if unlike:  # same count, other prompts (another file, template or tokenizer): a pairing would mean nothing
        print(f"{PROG}: error: prompt {unlike[0]} ({len(unlike)} of {n} in all) from {src} with "
              f"{args.target}'s tokenizer and chat template is not the report's (acceptance.trained.per_prompt"
              f"[{unlike[0]}].prompt_sha256); pass the report's GSM8K file with --dataset-path and the target the head "
              "was trained on with --target", file=sys.stderr)
        return 2
    t = time.time()
    est = acceptance_estimate(target, head, prompts, acc["chain_steps"], acc["max_new_tokens"], [tok.eos_token_id])
    row = compare(est["per_prompt"], ref)
    row.update(seconds=round(time.time() - t, 1), device=args.device, dtype=args.dtype,
               chain_steps=acc["chain_steps"], max_new_tokens=acc["max_new_tokens"])
    noise = ("no spread to measure noise by (one prompt)" if row["paired_se"] is None else
             f"paired SE {row['paired_se']:.3f}: {'within' if row['within_noise'] else 'OUTSIDE'} the noise (2 SE)")
    print(f"[remeasure] {row['prompts']} prompts, chain {acc['chain_steps']}, greedy, {args.dtype} on {args.device}: "
          f"accepted drafts per step {row['remeasured']:.3f} re-measured vs {row['report']:.3f} in the report; "
          f"difference {row['paired_difference']:+.3f}, {noise}; {row['identical_outputs']}/{row['prompts']} "
          f"outputs identical; {row['seconds']:.0f}s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**row, "per_prompt": {"remeasured": est["per_prompt"], "report": ref}}, f)
    return 0 if row["within_noise"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
