"""Training an Eagle3 head (MHA or MLA format) on target features with the training-time-test unroll.

For a sequence x_0..x_{T-1} with target aux states A_t and target next-token logits L_t:
  step 0: the head at position t reads (A_t, x_{t+1}) and predicts x_{t+2} (target: L_{t+1});
  step k: it reads its own step-(k-1) hidden state and x_{t+k+1} at position t+k, attending to the
          step-0 keys up to t and to its own steps 1..k at t -- exactly what it sees while drafting
          depth k+1 at inference -- and predicts x_{t+k+2} (target: L_{t+k+1}).
Loss: soft cross-entropy against the target's distribution over the draft vocabulary, on positions
whose predicted token is an assistant token, weighted decay^k. AdamW, cosine schedule with warmup,
gradient clipping and accumulation; checkpoints hold the full state (weights, optimizer, schedule,
step, RNG) in safetensors and resume exactly; data parallel under torchrun when WORLD_SIZE > 1 (each
rank takes its share of a step's units, gradients are summed before clipping).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from collections import Counter

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from sglang_ext.core.heads import Eagle3Head
from sglang_ext.core.ttt_attention import PATHS_USED as TTT_PATHS_USED, TTTCache
from sglang_ext.training.features import Features, cut_by_length
from sglang_ext.training.losses import soft_cross_entropy


@dataclasses.dataclass
class TrainConfig:
    ttt_steps: int = 7
    decay: float = 0.8
    lr: float = 1e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; None: epochs
    max_tokens: int = 2048
    seed: int = 0
    checkpoint_every: int = 0  # optimizer steps; 0: only at the end
    bf16: bool = False  # autocast on CUDA
    batch_tokens: int = 0  # > 0: conversations batched (right-padded) into forwards of up to this many tokens
    max_seconds: float | None = None  # stop early (checkpoint written, logged) after this much training time
    profile_steps: int = 0  # > 0: profile this many optimizer steps (after 2 warm-up steps) and log the top ops


def draft_vocabulary(records: list[Features], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent assistant tokens (target ids, sorted): the draft's lm_head rows."""
    counts = Counter()
    for r in records:
        counts.update(r.input_ids[r.loss_mask.bool()].tolist())
    ids = [t for t, _ in counts.most_common(size)]
    if len(ids) < size:  # pad with the lowest unused ids so the size is what the config says
        used = set(ids)
        ids += [t for t in range(vocab_size) if t not in used][: size - len(ids)]
    return torch.tensor(sorted(ids))


def init_head_from_target(head: Eagle3Head, target) -> None:
    """Embedding (frozen), lm_head rows of the draft vocabulary and the final norm from the target."""
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        rows = head.target_logits_index()
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[rows])
        norm = getattr(getattr(target, "model", None), "norm", None)
        if norm is not None and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight)
    head.embed_tokens.weight.requires_grad_(False)


@torch.no_grad()
def init_layer_from_target(head: Eagle3Head, target, layer: int) -> list[str]:
    """Start the head's decoder layer from one of the target's, part by part: the attention weights when
    the head has the source layer's attention layout (MHA head under a Llama-style target, MLA head with
    the target's MLA dims under a DeepSeek one), the MLP when both are dense with equal sizes (so an MHA
    head under an MLA target still starts from the target's MLP), and each norm. A part is copied whole
    or not at all; projections that read the doubled Eagle3 input (embedding, hidden) get the target's
    weights in both halves at half weight. When the attention or the MLP was copied, fc passes the last
    aux state through. Returns the parts copied ([] : nothing changed)."""
    layers = getattr(getattr(target, "model", None), "layers", None)
    if layers is None or not -len(layers) <= layer < len(layers):
        return []
    src, dst = layers[layer], head.layer
    h = head.config.hidden_size
    if head.config.target_hidden_size != h:
        return []
    source = dict(src.named_parameters())
    groups: dict[str, list] = {}
    for name, p in dst.named_parameters():
        part = name.split(".")[0] if name.startswith(("self_attn.", "mlp.")) else name.rsplit(".", 1)[0]
        name_src = "input_layernorm.weight" if name == "hidden_norm.weight" else name
        t = source.get(name_src)
        if t is not None and p.shape == t.shape:
            copy = t
        elif t is not None and p.dim() == 2 and p.shape == (t.shape[0], 2 * t.shape[1]):
            copy = torch.cat([0.5 * t, 0.5 * t], dim=1)
        else:
            copy = None
        groups.setdefault(part, []).append((p, copy))
    copied = []
    for part, plan in groups.items():
        if all(c is not None for _, c in plan):
            for p, c in plan:
                p.copy_(c)
            copied.append(part)
    if {"self_attn", "mlp"} & set(copied):
        fc = head.fc.weight
        fc.zero_()
        fc[:, fc.shape[1] - h:].copy_(torch.eye(h))
    return copied


class TargetAttention:
    """The output of one target decoder layer's attention block, `self_attn(input_layernorm(h))`, for a
    sequence of that layer's input states `h` [T, hidden]: what the head's attention is fitted to when its
    layout cannot take the layer's weights (an MHA head under an MLA target). Works for any transformers
    decoder whose layers have `input_layernorm` and `self_attn(hidden_states, position_embeddings,
    attention_mask)` and whose model has `rotary_emb` (Llama, Qwen, DeepseekV3, ...). Copies the layer's
    norm and attention in fp32 to `device`, and builds the rotary embedding there from the config (a
    `load_target_weights` target has only those weights; its rotary buffers are on the meta device)."""

    def __init__(self, target, layer: int, device):
        import copy

        model = target.model
        block = model.layers[layer]
        self.norm = copy.deepcopy(block.input_layernorm).to(device=device, dtype=torch.float32).eval()
        self.attn = copy.deepcopy(block.self_attn).to(device=device, dtype=torch.float32).eval()
        self.rotary = type(model.rotary_emb)(config=model.rotary_emb.config, device=device).eval()
        self.device = device

    @torch.no_grad()
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        x = self.norm(h.to(self.device, torch.float32)[None])
        positions = torch.arange(t, device=self.device)[None]
        # an explicit additive causal mask: eager attention would otherwise attend to later positions
        mask = torch.full((t, t), torch.finfo(torch.float32).min, device=self.device).triu(1)[None, None]
        out = self.attn(hidden_states=x, position_embeddings=self.rotary(x, positions), attention_mask=mask)[0]
        return out[0]


def fit_attention_to_target(head: Eagle3Head, target, layer: int, records: list[Features], steps: int,
                            lr: float = 2e-3, max_tokens: int = 512, seed: int = 0, shift: int = 1) -> dict:
    """Start the head's attention as a regression of target layer `layer`'s attention block, for heads whose
    attention cannot be copied from it (an MHA head under an MLA target: the latent RMSNorms between MLA's
    low-rank factors leave no exact conversion). The head at position t reads (h_t, token t+1), h_t the
    layer's input (the last aux state, passed through by fc after init_layer_from_target); it is fitted to
    the block's output at position t+1, where the target reads token t+1 (EAGLE's shifted input). Adam on
    the attention's weights only, one conversation (up to `max_tokens`) per step, on the head's device.
    Returns the fit's relative squared error (error / target power) at the start and the end, or why it was
    skipped ({"skipped": reason}; the attention then stays as it was)."""
    aux_ids = head.config.aux_layer_ids or []
    h_size = head.config.hidden_size
    if steps <= 0:
        return {"skipped": f"{steps} steps"}
    if head.config.target_hidden_size != h_size:
        return {"skipped": f"the head's hidden size {h_size} is not the target's {head.config.target_hidden_size}"}
    usable = [r for r in records if len(r.input_ids) > 2]
    if not usable:
        return {"skipped": "no training conversation of more than 2 tokens"}
    device = next(head.parameters()).device
    try:
        ref = TargetAttention(target, layer, device)
    except (AttributeError, TypeError) as e:  # a decoder this class does not know: train from the random start
        return {"skipped": f"target layer {layer}'s attention block cannot be run alone ({e})"}
    attn, blk = head.layer.self_attn, head.layer
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(attn.parameters(), lr=lr)
    history = []
    for step in range(steps):
        r = usable[int(torch.randint(len(usable), (1,), generator=g))]
        t = min(len(r.input_ids), max_tokens)
        h = r.aux[:t, -h_size:].to(device, torch.float32)  # the last aux state: the fitted layer's input
        y = ref(h)[1:] if shift else ref(h)[:-1]  # the block's output at t+1 (shift) or at t
        ids = r.input_ids[1:t].to(device)
        with torch.no_grad():
            x = blk.attention_input(head.embed_tokens(ids).float(), h[:-1])
        positions = torch.arange(t - 1, device=device)[None]
        pred = attn(x[None], positions, None, None)[0]
        err = (pred - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-12)
        opt.zero_grad(set_to_none=True)
        err.backward()
        opt.step()
        history.append(float(err.detach()))
    k = max(1, min(20, steps // 5))
    return {"steps": steps, "relative_error_start": sum(history[:k]) / k, "relative_error_end": sum(history[-k:]) / k,
            "aux_layer_ids": list(aux_ids), "layer": layer}


def _truncated(f: Features, max_tokens: int) -> Features:
    if len(f.input_ids) <= max_tokens:
        return f
    return Features(f.input_ids[:max_tokens], f.loss_mask[:max_tokens], f.aux[:max_tokens], f.last_hidden[:max_tokens])


def batches(records: list[Features], order: list[int], batch_tokens: int, max_tokens: int,
            bucket: int = 64) -> list[list[int]]:
    """Record indices grouped into right-padded batches of at most `batch_tokens` tokens (rows x longest,
    padding included): `order` is cut into buckets of `bucket` records, each sorted by length so that a
    batch's rows are alike and little is padding. Attention then costs sum(B x T^2) per batch, not the
    (B x T)^2 of one packed sequence."""
    out = []
    for b in range(0, len(order), bucket):
        group = sorted(order[b: b + bucket], key=lambda i: len(records[i].input_ids))
        out += cut_by_length(group, lambda i: min(len(records[i].input_ids), max_tokens), batch_tokens)
    return out


def attention_kernels(device):
    """SDPA on CUDA without its cuDNN backend: cuDNN builds an execution plan for every new shape
    (~70 ms of host time each in the backward, 41% of a step's host time in an H200 profile), and a
    padded batch's shape changes from one step to the next; the fused kernels left need no plan."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def target_logits(final: torch.Tensor, lm_rows: torch.Tensor, autocast: bool) -> torch.Tensor:
    """The target's fp32 logits over the draft vocabulary from its final hidden states. Under bf16 autocast on
    a GPU: one bf16 GEMM with an fp32 output. The hidden states and lm_head rows of a bf16 target are exact
    in bf16, so only the accumulation matters, and it stays fp32; the fp32 GEMM of the same product took
    10.8 ms of a 140 ms step at 8B shapes (H200, 2026-11-30)."""
    if autocast and final.is_cuda:
        a = final.reshape(-1, final.shape[-1]).to(torch.bfloat16)
        out = torch.mm(a, lm_rows.to(torch.bfloat16).T, out_dtype=torch.float32)  # torch >= 2.8 (pinned: 2.11)
        return out.view(*final.shape[:-1], -1)
    return final.float() @ lm_rows.T


def ttt_loss(head: Eagle3Head, f: Features | list[Features], lm_rows: torch.Tensor, steps: int, decay: float, device,
             autocast: bool = False, pad_multiple: int | None = None, fused_attention: bool | None = None,
             ) -> tuple[torch.Tensor, list[float], list[int]]:
    """(loss, per-step accuracy sums, per-step counts) for one sequence, or for a right-padded batch of
    them (rows never see each other; padding lanes are never selected, and a real lane only ever
    attends to real lanes), the loss being the mean over all selected lanes of the batch.
    fused_attention=False: the unroll's attention through a dense mask (the reference; same function)."""
    recs = [f] if isinstance(f, Features) else list(f)
    B = len(recs)
    lens = [len(r.input_ids) for r in recs]
    T = max(lens)
    if pad_multiple is None:  # on CUDA few distinct shapes, so kernels tuned per shape are reused
        pad_multiple = 64 if device.type == "cuda" else 1
    T = -(-T // pad_multiple) * pad_multiple
    L = T - 1  # lanes t = 0..T-2
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    where = recs[0].aux.device  # the host, or the GPU when the records are resident there
    aux = torch.zeros(B, L, recs[0].aux.shape[-1], dtype=recs[0].aux.dtype, device=where)
    final = torch.zeros(B, T, recs[0].last_hidden.shape[-1], dtype=recs[0].last_hidden.dtype, device=where)
    for b, (r, n) in enumerate(zip(recs, lens)):
        ids[b, :n], mask[b, :n], aux[b, : n - 1], final[b, :n] = r.input_ids, r.loss_mask.bool(), r.aux[: n - 1], \
            r.last_hidden
    # which lanes each TTT step trains on is known on the host (lengths and loss masks), so the GPU
    # never has to be asked (no synchronisation inside the unroll)
    pos_cpu = torch.arange(L)[None].expand(B, L)
    last_cpu = torch.tensor(lens)[:, None] - 1  # each row's last token index
    selected = []
    for k in range(steps):
        pred = pos_cpu + k + 2  # the token predicted at lane t: x_{t+k+2}
        valid = pred <= last_cpu
        if not valid.any():
            break
        sel = valid & mask.gather(1, pred.clamp(max=T - 1))
        b_sel, t_sel = sel.nonzero(as_tuple=True)
        selected.append((b_sel, t_sel, pred[b_sel, t_sel] - 1))
    pin = device.type == "cuda"

    def dev(x):
        if x.is_cuda:  # resident records: already there (a no-op move)
            return x.to(device, non_blocking=True)
        return (x.pin_memory() if pin else x).to(device, non_blocking=pin)

    ids, hidden = dev(ids), dev(aux)
    if not autocast:  # under autocast the head's first layer casts it to bf16 anyway (exact for a bf16 target)
        hidden = hidden.float()
    with torch.no_grad():  # the target's distribution over the draft vocabulary at every position
        tgt = F.softmax(target_logits(dev(final), lm_rows, autocast), dim=-1)  # [B, T, Vd]
        tgt_top = tgt.argmax(-1)  # [B, T]: the target's top token, for the accuracy
    pos = torch.arange(L, device=device)[None].expand(B, L)
    rows = torch.arange(B, device=device)[:, None]
    # lane t of step k attends to x_0..x_t and to its own lane in steps 1..k (core/ttt_attention.py)
    cache = TTTCache(fused=fused_attention)
    total, hits, cnt = 0.0, [], []
    # one autocast region for the whole unroll: each weight is cast to bf16 once per call, not once per step
    with attention_kernels(device), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
        for k, (b_sel, t_sel, target_pos) in enumerate(selected):
            tok = ids[rows, (pos + k + 1).clamp(max=T - 1)]  # the token fed at lane t: x_{t+k+1}
            out = head(tok, hidden, pos + k, cache)
            cnt.append(len(b_sel))
            if len(b_sel):
                b_sel, t_sel, target_pos = dev(b_sel), dev(t_sel), dev(target_pos)
                chosen = out.logits[b_sel, t_sel]  # the selected lanes, in the logits' dtype
                # soft CE against tgt[b_sel, target_pos], keeping no fp32 copies for the backward (training/losses.py)
                loss_k = soft_cross_entropy(chosen, tgt, b_sel, target_pos).mean()
                total = total + (decay ** k) * loss_k
                hits.append((chosen.argmax(-1) == tgt_top[b_sel, target_pos]).sum())
            else:
                hits.append(torch.zeros((), device=device))
            hidden = out.hidden
    if not torch.is_tensor(total):
        total = torch.zeros((), device=device, requires_grad=True)
    acc = torch.stack(hits).tolist() if hits else []  # the one synchronisation of the call
    return total, [float(a) for a in acc], cnt


clock = time.monotonic  # the training time limit's clock (a test replaces it)


def fit_total(step: int, planned: int, seconds_left: float, seconds_per_step: float) -> int:
    """The optimizer steps a time-limited run can still finish: the planned schedule, or fewer when the
    measured pace says the time limit comes first (at least one more step). The cosine schedule is then
    laid over what will really run, so the learning rate has decayed when time is up instead of being
    cut off half-way (seen on an H200: both heads stopped at 42-45% of their schedules, lr 1.2e-3 of 2e-3)."""
    if seconds_per_step <= 0:
        return planned
    return max(step + 1, min(planned, step + int(seconds_left / seconds_per_step)))


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ------------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: str, head: Eagle3Head, opt: torch.optim.Optimizer, step: int, extra: dict) -> None:
    """Full training state in safetensors + JSON (never pickled)."""
    os.makedirs(path, exist_ok=True)
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    names = {id(p): n for n, p in head.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for key, val in st.items():
                tensors[f"optim.{names[id(p)]}.{key}"] = (val if torch.is_tensor(val) else torch.tensor(val)).cpu()
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    # the step and identity travel inside the weights file too: safetensors writes it whole (temp file, rename), so
    # a run killed between the two files resumes from what the weights are, not from an older trainer.json
    meta = json.dumps({"step": step, **extra})
    save_file(tensors, os.path.join(path, "state.safetensors"), metadata={"trainer": meta})
    tmp = os.path.join(path, "trainer.json.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(json.loads(meta), indent=1))
    os.replace(tmp, os.path.join(path, "trainer.json"))  # readable copy; never half-written


def checkpoint_meta(path: str) -> dict:
    """The checkpoint's step and identity: from its weights file (what the state is), else trainer.json (older runs)."""
    from safetensors import safe_open

    try:
        with safe_open(os.path.join(path, "state.safetensors"), "pt") as f:
            meta = (f.metadata() or {}).get("trainer")
    except Exception as e:  # safetensors' own error type for a cut or damaged file
        raise ValueError(f"checkpoint {path}/state.safetensors cannot be read ({type(e).__name__}: {e}); delete {path} "
                         "to train from the start") from None
    if meta is not None:
        return json.loads(meta)
    try:
        return json.load(open(os.path.join(path, "trainer.json")))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}/trainer.json is damaged ({e}); delete {path} to train from the start") from None


def load_checkpoint(path: str, head: Eagle3Head, opt: torch.optim.Optimizer) -> dict:
    t = load_file(os.path.join(path, "state.safetensors"))
    head.load_state_dict({k[len("model."):]: v for k, v in t.items() if k.startswith("model.")})
    params = dict(head.named_parameters())
    for k, v in t.items():
        if k.startswith("optim."):
            name, key = k[len("optim."):].rsplit(".", 1)
            on_device = key != "step" or opt.defaults.get("fused")  # fused AdamW keeps its step beside the weights
            opt.state[params[name]][key] = v.to(params[name].device) if on_device else v
    torch.set_rng_state(t["rng.cpu"])
    if "rng.cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["rng.cuda"])
    return checkpoint_meta(path)


def records_fingerprint(records: list[Features]) -> str:
    """Which token sequences, in which order: a resume on other data of the same size is refused, not continued."""
    h = hashlib.sha256()
    for r in records:
        h.update(r.input_ids.to(torch.int32).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def identity_differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """'field: saved -> now' for every field that differs (nested dicts flattened)."""
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += identity_differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


# ---------------------------------------------------------------------------------- training


def resident_on_device(records: list[Features], device: torch.device, max_fraction: float = 0.3) -> list[Features]:
    """The records' hidden states moved to the GPU once, when they fit in `max_fraction` of its free memory
    (1.2 M tokens of a 576-wide target: 5.4 GB). Each forward then pads its batch with device copies instead
    of assembling and pinning ~100 MB on the host per step, which on a shared host (servers and another
    trainer beside it) was most of the step time. Token ids and loss masks stay on the host: lane
    selection reads them there."""
    if device.type != "cuda" or not records or records[0].aux.device.type == "cuda":
        return records
    need = sum(r.aux.numel() * r.aux.element_size() + r.last_hidden.numel() * r.last_hidden.element_size()
               for r in records)
    free, _ = torch.cuda.mem_get_info(device)
    if need > max_fraction * free:
        return records
    aux = torch.cat([r.aux for r in records]).to(device)  # one transfer per field; records become views
    last = torch.cat([r.last_hidden for r in records]).to(device)
    out, start = [], 0
    for r in records:
        n = len(r.input_ids)
        out.append(Features(r.input_ids, r.loss_mask, aux[start: start + n], last[start: start + n]))
        start += n
    return out


@torch.enable_grad()  # whatever grad mode the caller is in
def train(head: Eagle3Head, records: list[Features], target_lm_head: torch.Tensor, cfg: TrainConfig,
          checkpoint_dir: str | None = None, resume: bool = True, stop_after: int | None = None,
          log=print) -> dict:
    """Train in place. `stop_after` ends early after that many optimizer steps (as an interruption
    would, after writing a checkpoint). Returns the final metrics."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = next(head.parameters()).device
    entered = time.monotonic()  # what precedes the first step (two trainers on one H200: ~140 s)
    records = resident_on_device(records, device)
    if records and records[0].aux.is_cuda:
        log(f"hidden states of {len(records)} conversations resident on {device} "
            f"({time.monotonic() - entered:.1f}s)")
    dist = None
    if world > 1:
        # data parallel by hand: the TTT unroll calls the head several times per backward, which
        # DistributedDataParallel's one-forward-one-backward bookkeeping does not allow; gradients are
        # summed across ranks before clipping, so every rank takes the same optimizer step
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    params = [p for p in head.parameters() if p.requires_grad]
    groups = params
    if cfg.weight_decay > 0:  # decoupled decay on the matrices only, as usual: norms' gains keep their scale
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    # fused on CUDA: one kernel over all parameters instead of a dozen foreach passes
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    lm_rows = target_lm_head.to(device).float()[head.target_logits_index()]
    if cfg.bf16 and device.type == "cuda":  # what target_logits multiplies with under autocast: cast once
        lm_rows = lm_rows.to(torch.bfloat16)
    # units of one forward: a conversation, or a batch of them (fixed once, from the seed)
    if cfg.batch_tokens > 0:
        seeded = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        units = batches(records, seeded, cfg.batch_tokens, cfg.max_tokens)
    else:
        units = [[i] for i in range(len(records))]
    per_epoch = math.ceil(len(units) / (cfg.grad_accum * world))
    total = cfg.max_steps or per_epoch * cfg.epochs
    step = 0
    identity = {"train_config": {k: v for k, v in dataclasses.asdict(cfg).items()
                                 if k not in ("max_seconds", "profile_steps", "checkpoint_every")},
                "head_config": head.config.to_dict(), "records": len(records),
                "records_fingerprint": records_fingerprint(records), "world_size": world}
    if checkpoint_dir and resume and os.path.exists(os.path.join(checkpoint_dir, "state.safetensors")):
        saved = checkpoint_meta(checkpoint_dir)
        old = json.loads(json.dumps(saved.get("identity") or {}))
        old.get("train_config", {}).pop("checkpoint_every", None)  # not part of a run's identity since 2026-12-01
        differ = identity_differences(old, json.loads(json.dumps(identity)))
        if differ:
            raise ValueError(f"checkpoint {checkpoint_dir} was written by a run with other options or data ("
                             + "; ".join(differ[:6]) + "); resume with the same ones, or use a new --work directory "
                             f"(or delete {checkpoint_dir})")
        step = load_checkpoint(checkpoint_dir, head, opt)["step"]
        # a schedule fitted to a time limit keeps its length: a resumed run ends where the interrupted one was
        # going to (and a finished run stays finished), instead of climbing back up a longer cosine
        total = min(total, int(saved.get("total_steps") or total))
        log(f"resumed from {checkpoint_dir} at optimizer step {step} of {total}")
    if dist is not None:  # one starting point on every rank
        for p in params:
            dist.broadcast(p.data, src=0)
    metrics, history = {}, []  # history: one point per optimizer step (record_history)
    t_start, tokens_trained = clock(), 0
    seconds_before_first_step = time.monotonic() - entered
    bar = tqdm(total=total, initial=step, desc="train draft", unit="step", disable=rank != 0,
               mininterval=5)
    profiler, first_step, order_epoch = None, step, None
    planned, pace_from = total, None  # pace: measured after the warm-up and profiled steps
    pace_start = first_step + 2 + (cfg.profile_steps + 2 if cfg.profile_steps else 0)
    # throughput after the first steps (CUDA and NCCL initialisation, kernel autotuning, the TTT attention's
    # self-check): what a long run sustains, and what data parallelism is compared on
    steady_from = None
    while step < total:
        if step == pace_start:
            resident = 0
            if device.type == "cuda":  # the warm-up steps' kernels end before the clock starts
                torch.cuda.synchronize(device)
                # what a step needs above what stays allocated between steps (weights, optimizer state,
                # resident features): the peak from here on, less this
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)
            steady_from = (step, clock(), tokens_trained, resident)
        if cfg.max_seconds is not None and step == pace_start:
            pace_from = (step, clock())
        if pace_from is not None and step > pace_from[0] and (step - pace_from[0]) % 10 == 0:
            per_step = (clock() - pace_from[1]) / (step - pace_from[0])
            left = cfg.max_seconds - (clock() - t_start)
            if dist is not None:  # one schedule on every rank: the slowest rank's pace
                pace = torch.tensor([per_step, -left], device=device)
                dist.all_reduce(pace, op=dist.ReduceOp.MAX)
                per_step, left = float(pace[0]), -float(pace[1])
            fitted = fit_total(step, planned, left, per_step)
            if fitted != total:
                if total == planned:
                    log(f"schedule fitted to the time limit: {fitted} optimizer steps of the {planned} planned "
                        f"({per_step:.2f}s per step, {left:.0f}s left)")
                total = fitted
                bar.total = total  # the bar shows the fitted schedule, not the planned one
                bar.refresh()
        if cfg.profile_steps and step == first_step + 2 and profiler is None:
            profiler = _start_profiler(device)
        if profiler is not None and step == first_step + 2 + cfg.profile_steps:
            _log_profile(profiler, device, cfg.profile_steps, log)
            profiler = None
        epoch, within = divmod(step, per_epoch)
        if epoch != order_epoch:  # the epoch's shuffle, drawn once (not at every step)
            order_epoch = epoch
            order = torch.randperm(len(units), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        full = order[within * cfg.grad_accum * world: (within + 1) * cfg.grad_accum * world]  # this step's units
        batch = full[rank::world]  # this rank's share
        if not full:
            step += 1
            continue
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, cfg)
        opt.zero_grad(set_to_none=True)
        acc_sum, cnt_sum, loss_sum = [0.0] * cfg.ttt_steps, [0] * cfg.ttt_steps, 0.0
        for u in batch:
            fs = [_truncated(records[i], cfg.max_tokens) for i in units[u]]
            tokens_trained += sum(len(x.input_ids) for x in fs)
            loss, acc, cnt = ttt_loss(head, fs, lm_rows,
                                      cfg.ttt_steps, cfg.decay, device, cfg.bf16 and device.type == "cuda")
            value = float(loss.detach())  # one read of the loss per forward
            if not math.isfinite(value):  # stop before a NaN reaches the weights, the checkpoint or the export
                raise FloatingPointError(f"non-finite TTT loss ({value}) at optimizer step {step}, records "
                                         f"{units[u]}; "
                                         f"nothing was saved for this step. Lower --lr (now {cfg.lr}) or train "
                                         "without bf16 autocast")
            (loss / len(full)).backward()  # the mean over the step's units, whichever rank holds them
            loss_sum += value
            for k in range(len(acc)):
                acc_sum[k] += acc[k]
                cnt_sum[k] += cnt[k]
        if dist is not None:  # one all-reduce of all gradients (flattened), not one per parameter
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            for g, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(summed)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm at optimizer step {step}; the weights were not "
                                     f"updated. Lower --lr (now {cfg.lr}) or train without bf16 autocast")
        opt.step()
        step += 1
        bar.update(1)
        metrics = {"step": step, "loss": loss_sum / max(1, len(batch)), "lr": opt.param_groups[0]["lr"],
                   "accuracy_per_step": [a / c if c else 0.0 for a, c in zip(acc_sum, cnt_sum)],
                   "tokens_trained": tokens_trained, "total_steps": total, "planned_steps": planned,
                   "epochs": round(step / per_epoch, 3)}
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['accuracy_per_step'][0]:.2f}")
        record_history(history, {k: metrics[k] for k in ("step", "epochs", "loss", "lr", "accuracy_per_step")})
        out_of_time = cfg.max_seconds is not None and clock() - t_start > cfg.max_seconds
        if dist is not None and cfg.max_seconds is not None:  # every rank stops at the same step, or one hangs
            flag = torch.tensor([float(out_of_time)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            out_of_time = bool(flag.item())
        if checkpoint_dir and rank == 0 and ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                                             or step == total or step == stop_after or out_of_time):
            save_checkpoint(checkpoint_dir, head, opt, step, {"total_steps": total, "identity": identity})
        if stop_after is not None and step >= stop_after:
            break
        if out_of_time:
            log(f"stopped at optimizer step {step} of {total}: the training time limit ({cfg.max_seconds:.0f}s) "
                "was reached (the schedule did not finish)")
            metrics["stopped_early"] = True
            break
    bar.close()
    if steady_from is not None and step > steady_from[0]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        metrics["steady"] = {"steps": step - steady_from[0], "seconds": clock() - steady_from[1],
                             "tokens": tokens_trained - steady_from[2]}  # this rank's
        if device.type == "cuda":
            metrics["steady"]["resident_gib"] = round(steady_from[3] / 2**30, 3)
            metrics["steady"]["step_peak_above_resident_gib"] = round(
                (torch.cuda.max_memory_allocated(device) - steady_from[3]) / 2**30, 3)
    if profiler is not None:
        _log_profile(profiler, device, step - first_step - 2, log)
    if step == first_step:  # a resumed run that had already finished: nothing trained now
        metrics.update({"step": step, "total_steps": total, "planned_steps": planned, "tokens_trained": 0,
                        "epochs": round(step / per_epoch, 3), "resumed_finished": True})
    metrics["seconds_before_first_step"] = round(seconds_before_first_step, 1)
    metrics["ttt_attention"] = sorted(TTT_PATHS_USED)  # "fused" unless the kernel was unavailable
    metrics["history"] = history
    return metrics


HISTORY_POINTS = 2000  # a report's loss history keeps at most about this many steps (evenly thinned)


def record_history(history: list[dict], point: dict) -> None:
    """Append one optimizer step's figures. The points lie on an even grid of steps (the newest one excepted);
    past HISTORY_POINTS every other point goes and the grid's spacing doubles, so the curve keeps its shape over
    the whole run and ends at the last step."""
    history.append(point)
    if len(history) < 3:
        return
    first, spacing = history[0]["step"], history[1]["step"] - history[0]["step"]
    if (history[-2]["step"] - first) % spacing:  # the previous newest point, off the grid: superseded
        del history[-2]
    if len(history) > HISTORY_POINTS:
        kept = history[::2]
        if kept[-1] is not history[-1]:
            kept.append(history[-1])
        history[:] = kept


def _start_profiler(device):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    p = profile(activities=acts)
    p.__enter__()
    return p


def _log_profile(p, device, steps: int, log) -> None:
    """Where a training step's time goes: the top operators over `steps` optimizer steps."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    p.__exit__(None, None, None)
    table = p.key_averages()
    # on CUDA both views: a GPU far less busy than the host points at launch or synchronisation costs
    for key in (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        log(f"profile of {steps} optimizer steps (top operators by {key}):\n"
            + table.table(sort_by=key, row_limit=15, max_name_column_width=60))


@torch.no_grad()
def evaluate(head: Eagle3Head, records: list[Features], target_lm_head: torch.Tensor, steps: int) -> list[float]:
    """Per-TTT-step top-1 accuracy (draft argmax == target argmax over the draft vocabulary)."""
    device = next(head.parameters()).device
    lm_rows = target_lm_head.to(device).float()[head.target_logits_index()]
    acc, cnt = [0.0] * steps, [0] * steps
    for f in records:
        _, a, c = ttt_loss(head, f, lm_rows, steps, 1.0, device)
        for k in range(len(a)):
            acc[k] += a[k]
            cnt[k] += c[k]
    return [a / c if c else 0.0 for a, c in zip(acc, cnt)]
