"""Training step time: our Eagle3 trainer against SpecForge's (PyPI `specforge` 0.2.0, its Eagle3 MHA
trainer), on the same head size, sequence length, batch, TTT length and target (an 8B-class Llama
from a config: hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256; only its lm_head and
random aux / final hidden states are needed, as in offline training).

Ours: `sglang_ext.training.trainer.ttt_loss` (bf16 autocast, fp32 master weights) + backward + clip + AdamW, its
inputs held as `sglang_ext.training.trainer.train` holds them (bf16 hidden states resident on the GPU, the lm_head
rows cast to bf16 once); SpecForge gets the same bf16 tensors on the GPU. (The runs of 2026-11-30 gave
ours fp32 features on the host, pinned and copied at every step: a cost the trainer does not pay.)
SpecForge's: `LlamaForCausalLMEagle3` -> `OnlineEagle3Model` (TTT unroll) ->
`Eagle3TrainStrategy.forward_loss` (its offline path, `target_repr=hidden_state`, TargetHead) ->
backward -> `BF16Optimizer.step` (bf16 weights, fp32 masters, clip, AdamW) -- exactly its trainer's
call chain. Both live at once and their timed steps alternate (contention weighs on both alike). Prints a
table (median step ms, tokens/s, memory a step needs) and, for ours, the top CUDA ops.
SpecForge pins other SGLang/transformers versions: install it beside ours without dependencies
(`pip install --no-deps --target /tmp/sfsite specforge-0.2.0-py3-none-any.whl`, PYTHONPATH).

    python -m sglang_ext.training.bench_vs_specforge [--seq-len 2048] [--ttt 7] [--steps 10] [--tiny] [--ours-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256, draft_vocab=32000)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=1000, draft_vocab=256)


def inputs(shape: dict, seq: int, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = shape["hidden"]
    ids = torch.randint(0, shape["vocab"], (seq,), generator=g)
    mask = torch.ones(seq, dtype=torch.uint8)
    mask[: seq // 8] = 0  # a prompt
    aux = torch.randn(seq, 3 * h, generator=g)
    last = torch.randn(seq, h, generator=g)
    lm_head = torch.randn(shape["vocab"], h, generator=g) * h ** -0.5
    hot = torch.randperm(shape["vocab"], generator=g)[: shape["draft_vocab"]].sort().values
    return ids, mask, aux, last, lm_head.to(device), hot


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, device) -> tuple[float, float]:
    """One step's wall time and the memory it needed above what was allocated before it (GiB)."""
    sync(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    step()
    sync(device)
    dt = time.perf_counter() - t
    return dt, (torch.cuda.max_memory_allocated() - base) / 2 ** 30 if device.type == "cuda" else 0.0


def ours(shape, seq, ttt, device, fused_attention: bool | None = None):
    """Our training step (and its warm-up run once)."""
    from sglang_ext.config import Eagle3DraftConfig
    from sglang_ext.core.heads import Eagle3Head
    from sglang_ext.training.features import Features
    from sglang_ext.training.trainer import resident_on_device, ttt_loss

    ids, mask, aux, last, lm_head, hot = inputs(shape, seq, device)
    cfg = Eagle3DraftConfig(head_format="mha", hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                            num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                            head_dim=shape["head_dim"], vocab_size=shape["vocab"], target_hidden_size=shape["hidden"],
                            draft_vocab_size=shape["draft_vocab"])
    head = Eagle3Head(cfg)
    head.set_vocab_mapping(hot)
    head.embed_tokens.weight.requires_grad_(False)
    head = head.to(device)
    bf16 = device.type == "cuda"
    rows = lm_head[hot.to(device)]
    if bf16:  # as sglang_ext.training.trainer.train passes them
        rows = rows.to(torch.bfloat16)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")  # as sglang_ext.training.trainer.train
    dtype = torch.bfloat16 if bf16 else torch.float32  # the features of a bf16 target, as SpecForge gets them
    f = resident_on_device([Features(ids, mask, aux.to(dtype), last.to(dtype))], device)[0]  # as train() does

    def step():
        loss, _, _ = ttt_loss(head, f, rows, ttt, 0.8, device, autocast=bf16, fused_attention=fused_attention)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    return step


def profile_table(step, device) -> str:
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CUDA]) as p:
        step()
        sync(device)
    return p.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)


def specforge(shape, seq, ttt, device, backend: str):
    """SpecForge's training step (and its warm-up run once)."""
    import torch.nn as nn
    from transformers import LlamaConfig

    import specforge.algorithms.eagle3.model as sf_model
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    if device.type != "cuda":  # its loss is a Triton kernel; on the CPU use its own reference formula
        class TorchLogSoftmaxLoss:
            @staticmethod
            def apply(logits, target_p, position_mask):
                return -(position_mask * (target_p * torch.log_softmax(logits.float(), -1))).sum(-1).mean()

        sf_model.LogSoftmaxLoss = TorchLogSoftmaxLoss
    ids, mask, aux, last, lm_head, hot = inputs(shape, seq, device)
    cfg = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=shape["hidden"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      head_dim=shape["head_dim"], intermediate_size=shape["inter"], num_hidden_layers=1,
                      vocab_size=shape["vocab"], max_position_embeddings=max(4096, seq), rms_norm_eps=1e-6,
                      hidden_act="silu", rope_theta=500000.0, pad_token_id=0, tie_word_embeddings=False)
    cfg.draft_vocab_size = shape["draft_vocab"]
    cfg.target_hidden_size = shape["hidden"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    draft = LlamaForCausalLMEagle3(cfg, attention_backend=backend)
    t2d = torch.zeros(shape["vocab"], dtype=torch.bool)
    t2d[hot] = True
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(hot - torch.arange(hot.numel()))
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=dtype)
    model = OnlineEagle3Model(draft_model=draft, length=ttt, attention_backend=backend).to(device=device, dtype=dtype)

    class Head(TargetHead):  # its TargetHead reads a checkpoint; same frozen lm_head, built in memory
        def __init__(self):
            nn.Module.__init__(self)
            self.hidden_size, self.vocab_size = shape["hidden"], shape["vocab"]
            self.fc = nn.Linear(shape["hidden"], shape["vocab"], bias=False)

    head = Head().to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    strategy = Eagle3TrainStrategy(model, target_head=head, ploss_decay=0.8)
    opt = BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, total_steps=1000, warmup_ratio=0.015)
    batch = TrainBatch(sample_ids=["0"], strategy="eagle3", metadata={"target_repr": "hidden_state"}, tensors={
        "input_ids": ids[None].to(device), "attention_mask": torch.ones(1, seq, dtype=torch.long, device=device),
        "loss_mask": mask[None].long().to(device), "hidden_state": aux[None].to(device=device, dtype=dtype),
        "target": last[None].to(device=device, dtype=dtype)})

    def step():
        out = strategy.forward_loss(batch)
        out.loss.backward()
        opt.step()

    step()  # warm-up (and torch.compile of its helpers)
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ext.training.bench_vs_specforge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("--specforge-backend", default="flex_attention", help="sdpa | flex_attention (its default)")
    ap.add_argument("--profile", action="store_true", help="print our top CUDA ops")
    ap.add_argument("--dense-too", action="store_true",
                    help="also time our step with the TTT attention as a dense masked attention")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else LLAMA_8B
    # both trainers live at once and their steps alternate, so that whatever else the GPU and host do
    # (another process, clocks) weighs on both alike
    steps = {"ours": ours(shape, args.seq_len, args.ttt, device)}
    if args.dense_too:  # the unroll's attention as one dense masked attention (our step before 2026-11-30)
        steps["ours, dense TTT attention"] = ours(shape, args.seq_len, args.ttt, device, fused_attention=False)
    if not args.ours_only:
        backend = args.specforge_backend if device.type == "cuda" else "sdpa"
        steps[f"specforge ({backend})"] = specforge(shape, args.seq_len, args.ttt, device, backend)
    rows = {name: {"times": [], "step_gib": 0.0} for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            dt, gib = timed(step, device)
            rows[name]["times"].append(dt)
            rows[name]["step_gib"] = max(rows[name]["step_gib"], gib)
    top = profile_table(steps["ours"], device) if args.profile and device.type == "cuda" else None
    print(f"\nshape {shape}, seq {args.seq_len}, batch 1, TTT {args.ttt}, {args.steps} timed steps on {device}")
    print("trainer                      median ms   min ms   tokens/s   step GiB (memory a step needs above its resident state)")
    for name, r in rows.items():
        med = statistics.median(r["times"])
        r.update(median_ms=1e3 * med, min_ms=1e3 * min(r["times"]), tokens_per_s=args.seq_len / med)
        peak = f"{r['step_gib']:.1f}" if device.type == "cuda" else "—"
        print(f"{name:<28} {r['median_ms']:>9.1f} {r['min_ms']:>8.1f} {r['tokens_per_s']:>10.0f}   {peak}")
    sf = next((r for name, r in rows.items() if name.startswith("specforge")), None)
    if sf:
        a, b = rows["ours"]["median_ms"], sf["median_ms"]
        print(f"ours / specforge step time: {a / b:.3f} ({'ours faster' if a < b else 'ours SLOWER'})")
    if top:
        print(top)
    if args.json:
        json.dump({"config": vars(args), "shape": shape, "rows": rows}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
