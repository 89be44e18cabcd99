"""Compare two check_serving runs of the same target, heads and prompts -- e.g. TP=1 and TP=2 (the TP
issue): per arm, greedy outputs token for token (a parting scored by the first run's target top-2 logprob
gap there, as check_serving scores partings), and accepted drafts per step and per-position counts.

    # all of it, with the benchmark arms at TP=1 and TP=2 too: bash tests/gpu/launch_tp.sh
    # by hand, on nvidia-h200-x2, after `bash .devbundle/install.sh` (docs/results.md, "Tensor parallelism")
    ARMS="target mha-chain mla-chain mha-tree mla-tree"
    GPU_CHECK_WORK=/tmp/tp1 python tests/gpu/check_serving.py $ARMS && cp /tmp/tp1/state.json /tmp/tp1.json
    GPU_CHECK_RESTORE=/tmp/tp1 GPU_CHECK_WORK=/tmp/tp2 GPU_CHECK_TP=2 GPU_CHECK_NO_TRAIN=1 \\
        python tests/gpu/check_serving.py $ARMS
    python tests/gpu/compare_tp.py /tmp/tp1.json /tmp/tp2/state.json      # prints a table, writes $OUT/tp.json
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def compare_runs(first: dict, second: dict) -> dict:
    """Per arm of the second run: against the same arm of the first run, or, where the first run lacks
    it, against the first run's target alone (`first_is_target`: in deterministic mode a speculative arm's
    outputs are its target's, so that is the same comparison)."""
    from check_serving import compare

    out = {}
    for arm, ids_b in second.get("outputs", {}).items():
        # deterministic-mode arms are read against the deterministic target (check_serving's ref_key)
        ref_key, target_arm = (("reference-deterministic", "target-deterministic") if arm.endswith("deterministic")
                               else ("reference", "target"))
        ids_a = first.get("outputs", {}).get(arm)
        first_is_target = ids_a is None
        if first_is_target:
            ids_a = first.get("outputs", {}).get(target_arm)
            if ids_a is None:
                continue
        ref = first.get(ref_key) or []
        # score partings by the first run's target logprobs at the parting position
        rows_a = [{"ids": a, "top2": r.get("top2", [])} for a, r in zip(ids_a, ref)] if ref else \
            [{"ids": a, "top2": []} for a in ids_a]
        row = {"vs_first_run": compare(rows_a, [{"ids": b} for b in ids_b]), "first_is_target": first_is_target}
        # the second run's speculation against its own target alone (TP changes the target's reductions too)
        ref_b = second.get(ref_key)
        if ref_b and arm != target_arm:
            row["vs_second_target"] = compare(ref_b, [{"ids": b} for b in ids_b])
        if arm == target_arm:
            for name, run in (("first", first), ("second", second)):
                row[f"batch_noise_floor_{name}"] = run.get("results", {}).get(arm, {}).get("batch_noise_floor")
        for name, run in (("first", first), ("second", second)):
            res = run.get("results", {}).get(arm, {})
            row[f"accepted_drafts_per_step_{name}"] = res.get("accepted_drafts_per_step")
            row[f"position_{name}"] = res.get("views", {}).get("meta_info", {}).get("position")
            row[f"views_agree_{name}"] = res.get("all_views_agree")
            row[f"invariant_failures_{name}"] = res.get("invariant_failures")
        out[arm] = row
    return out


def main() -> int:
    first, second = (json.load(open(p)) for p in sys.argv[1:3])
    result = compare_runs(first, second)
    print("arm                                    identical  near-tie  other(max gap)  acc/step 1st -> 2nd   per-position 1st -> 2nd   "
          "views agree  invariant failures")
    for arm, r in result.items():
        v = r["vs_first_run"]
        print(f"{arm + (' (*)' if r['first_is_target'] else ''):<39}{v['identical']:<11}{v['near_tie_partings']:<10}"
              f"{str(v['other_partings']) + '(' + str(v['other_gaps_max']) + ')':<16}"
              f"{r['accepted_drafts_per_step_first']} -> {r['accepted_drafts_per_step_second']}   "
              f"{r['position_first']} -> {r['position_second']}   "
              f"{r['views_agree_first']}/{r['views_agree_second']}   "
              f"{r['invariant_failures_first']}/{r['invariant_failures_second']}")
    print("(*) the first run lacks this arm: compared with its target alone\n")
    print("against each run's own target alone (identical / near-tie / other (max gap)); for the target: its batch "
          "noise floor, one request at a time vs 64 in flight, first run | second run")

    def brief(v):
        return f"{v['identical']} / {v['near_tie_partings']} / {v['other_partings']} ({v['other_gaps_max']})" if v else "-"

    for arm, r in result.items():
        if arm in ("target", "target-deterministic"):
            print(f"{arm:<39}{brief(r.get('batch_noise_floor_first'))}  |  {brief(r.get('batch_noise_floor_second'))}")
        else:
            first_v = first.get("results", {}).get(arm, {}).get("vs_target")
            print(f"{arm:<39}{brief(first_v)}  |  {brief(r.get('vs_second_target'))}")
    out = os.environ.get("OUT", "/tmp")
    json.dump(result, open(os.path.join(out, "tp.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
