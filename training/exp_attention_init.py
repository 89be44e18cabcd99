"""CPU experiment behind `--fit-attention-steps` (#8): how should a head's attention start when it cannot take the
init layer's weights (an MHA head under an MLA target)? On a Llama-layout target, where copying is possible, it
compares the head after the same short training from: `copied` (the layer's attention, what such a target gets),
`random` (what an MHA head under an MLA target got before), `fit` (random, then fitted to the layer's attention
block at t+1, the default) and `fit0` (fitted at t). Prints one JSON line per arm: held-out top-1 per TTT step.

    make train-draft WORK=/tmp/ex/work DRAFT=/tmp/ex/draft TRAIN_ARGS='--max-steps 2'     # features (~16 min)
    python -m sglang_ext.training.exp_attention_init --features /tmp/ex/work/features random,fit,copied  # ~9 min/arm

A research script, not part of the pipeline; docs/results.md ("The MHA head's attention under an MLA target") has its figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from sglang_ext.core.heads import Eagle3Head, head_config_for
from sglang_ext.core.targets import load_target
from sglang_ext.training.features import read_shards
from sglang_ext.training.trainer import (TrainConfig, draft_vocabulary, evaluate, fit_attention_to_target,
                                         init_head_from_target, init_layer_from_target, train)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ext.training.exp_attention_init", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arms", help="comma-separated: copied, random, fit, fit0")
    ap.add_argument("--features", required=True, help="a train_draft work directory's features/")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--held-out", type=int, default=14, help="the first N records (train_draft holds out 1/20)")
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps of training per arm")
    ap.add_argument("--fit-steps", type=int, default=300)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    target = load_target(args.target, dtype=torch.float32, device="cpu")
    manifest = json.load(open(f"{args.features}/manifest.json"))
    records = read_shards(args.features)
    held, train_recs = records[: args.held_out], records[args.held_out:]
    aux = manifest["aux_output_ids"]
    layer = min(aux[-1] + 1, target.config.num_hidden_layers - 1)
    lm = target.get_output_embeddings().weight.detach()
    hot = draft_vocabulary(train_recs, args.draft_vocab_size, target.config.vocab_size)
    print(f"aux {aux}, init layer {layer}; {len(train_recs)} train / {len(held)} held-out records", flush=True)
    for arm in args.arms.split(","):
        torch.manual_seed(0)
        head = Eagle3Head(head_config_for(target.config, "mha", aux, draft_vocab_size=args.draft_vocab_size))
        head.set_vocab_mapping(hot)
        init_head_from_target(head, target)
        init_layer_from_target(head, target, layer)
        if arm != "copied":  # the attention as an MLA target leaves it: the default random init
            torch.manual_seed(1)
            a = head.layer.self_attn
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                lin.reset_parameters()
        t = time.time()
        # lr 0: the arm's own distance from the layer's block at t+1, unchanged
        fit = fit_attention_to_target(head, target, layer, train_recs, steps=args.fit_steps if arm.startswith("fit")
                                      else 20, lr=0.0 if not arm.startswith("fit") else 2e-3,
                                      shift=0 if arm == "fit0" else 1)
        fit_s = time.time() - t
        print(json.dumps({"arm": arm, "fit": fit, "fit_s": round(fit_s, 1)}), flush=True)
        before = evaluate(head, held, lm, 4)
        t = time.time()
        train(head, train_recs, lm, TrainConfig(ttt_steps=4, lr=5e-3, max_steps=args.steps, batch_tokens=2048, seed=0),
              checkpoint_dir=tempfile.mkdtemp(prefix=f"exp-attention-init-{arm}-"))  # never resume another run
        after = evaluate(head, held, lm, 4)
        print(json.dumps({"arm": arm, "fit": fit, "fit_s": round(fit_s, 1),
                          "held_top1_before": [round(x, 3) for x in before],
                          "held_top1": [round(x, 3) for x in after], "train_s": round(time.time() - t, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
