"""Target features for draft training, per conversation: token ids, loss mask, the aux hidden states
at the convention's layers and the target's final (normed) hidden state, from which the target's
logits over the draft vocabulary are recomputed with its lm_head (storing full-vocab logits would
cost vocab/hidden times more).

Offline: sharded safetensors under a directory with `manifest.json`; an interrupted capture resumes
at the first missing shard. Online: the same records computed in memory as training asks for them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from sglang_ext.core.capture import AuxCapture
from training.chat import render
from training.data import Conversation

MANIFEST = "manifest.json"


@dataclasses.dataclass
class Features:
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] uint8
    aux: torch.Tensor  # [T, num_aux * hidden]
    last_hidden: torch.Tensor  # [T, hidden], after the target's final norm


def cut_by_length(ascending: list[int], length, budget: int) -> list[list[int]]:
    """Indices already sorted by ascending length, cut greedily into right-padded batches whose rows x
    longest (padding included) stays within `budget`; a row longer than the budget is a batch alone.
    Shared by feature capture and the trainer."""
    out, cur = [], []
    for i in ascending:  # ascending: the newest member sets the padded width
        if cur and length(i) * (len(cur) + 1) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


class FeatureExtractor:
    def __init__(self, target, tokenizer, aux_output_ids, max_tokens: int = 2048, reasoning: str = "drop",
                 dtype=torch.bfloat16):
        self.target, self.tok = target.eval(), tokenizer
        self.aux_output_ids = list(aux_output_ids)
        self.max_tokens, self.reasoning, self.dtype = max_tokens, reasoning, dtype
        self.capture = AuxCapture(target, aux_output_ids)
        self.device = next(target.parameters()).device
        # a GPU is launch-bound on one short sequence: batch; a CPU is compute-bound, and one unpadded
        # sequence keeps attention on the causal fast path (padded batches were 5x slower there)
        self.batch_tokens = 16384 if self.device.type == "cuda" else 0

    def __call__(self, conv: Conversation) -> Features | None:
        return self.many([conv])[0]

    def _last_hidden(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        if hasattr(self.target, "model"):
            return self.target.model(input_ids=ids, attention_mask=attention).last_hidden_state
        return self.target(ids, attention_mask=attention, output_hidden_states=True).hidden_states[-1]

    @torch.no_grad()
    def many(self, convs: list[Conversation], batch_tokens: int | None = None) -> list[Features | None]:
        """Features of several conversations (None where nothing is trainable), computed in right-padded
        batches of similar lengths: one target forward per batch, not per conversation (a GPU is
        launch-bound on one short sequence at a time)."""
        batch_tokens = self.batch_tokens if batch_tokens is None else batch_tokens
        rendered = [render(self.tok, c.messages, self.reasoning, self.max_tokens) for c in convs]
        out: list[Features | None] = [None] * len(convs)
        todo = sorted((i for i, r in enumerate(rendered) if sum(r.loss_mask) and len(r.input_ids) >= 4),
                      key=lambda i: len(rendered[i].input_ids))
        batches = cut_by_length(todo, lambda i: len(rendered[i].input_ids), batch_tokens)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else (self.tok.eos_token_id or 0)
        for batch in batches:
            lengths = [len(rendered[i].input_ids) for i in batch]
            ids = torch.full((len(batch), max(lengths)), pad, dtype=torch.long)
            attention = torch.zeros_like(ids)
            for row, (i, n) in enumerate(zip(batch, lengths)):
                ids[row, :n] = torch.tensor(rendered[i].input_ids)
                attention[row, :n] = 1
            # alone: no mask at all, so attention takes the causal fast path
            last = self._last_hidden(ids.to(self.device), attention.to(self.device) if len(batch) > 1 else None)
            aux = self.capture.concat()
            for row, (i, n) in enumerate(zip(batch, lengths)):
                r = rendered[i]
                out[i] = Features(torch.tensor(r.input_ids), torch.tensor(r.loss_mask, dtype=torch.uint8),
                                  aux[row, :n].to(self.dtype).cpu(), last[row, :n].to(self.dtype).cpu())
        return out

    def close(self):
        self.capture.remove()


def _pack(records: list[Features]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(r.input_ids) for r in records])
    return {"lengths": lengths, "input_ids": torch.cat([r.input_ids for r in records]),
            "loss_mask": torch.cat([r.loss_mask for r in records]), "aux": torch.cat([r.aux for r in records]),
            "last_hidden": torch.cat([r.last_hidden for r in records])}


def _unpack(t: dict[str, torch.Tensor]) -> list[Features]:
    out, start = [], 0
    for n in t["lengths"].tolist():
        sl = slice(start, start + n)
        out.append(Features(t["input_ids"][sl], t["loss_mask"][sl], t["aux"][sl], t["last_hidden"][sl]))
        start += n
    return out


def write_shards(extractor: FeatureExtractor, convs: list[Conversation], out_dir: str, shard_size: int = 64,
                 meta: dict | None = None) -> dict:
    """Capture features for `convs` into out_dir/shard-NNNNN.safetensors (+ manifest); resumable."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, MANIFEST)
    manifest = json.load(open(path)) if os.path.exists(path) else {"shards": [], "skipped": 0, **(meta or {})}
    chunks = [convs[i: i + shard_size] for i in range(0, len(convs), shard_size)]
    with tqdm(total=len(convs), desc="capture target features", unit="conv", mininterval=5) as bar:
        for k, chunk in enumerate(chunks):
            name = f"shard-{k:05d}.safetensors"
            if any(s["file"] == name for s in manifest["shards"]):  # already captured
                bar.update(len(chunk))
                continue
            found = extractor.many(chunk)
            records = [f for f in found if f is not None]
            manifest["skipped"] += len(found) - len(records)
            bar.update(len(chunk))
            if records:
                save_file(_pack(records), os.path.join(out_dir, name))
                manifest["shards"].append({"file": name, "records": len(records),
                                           "tokens": int(sum(len(r.input_ids) for r in records))})
            with open(path + ".tmp", "w") as fh:
                json.dump(manifest, fh, indent=1)
            os.replace(path + ".tmp", path)  # the manifest only ever names complete shards
    return manifest


def read_shards(out_dir: str) -> list[Features]:
    manifest = json.load(open(os.path.join(out_dir, MANIFEST)))
    records = []
    for s in manifest["shards"]:
        records += _unpack(load_file(os.path.join(out_dir, s["file"])))
    return records


def online(extractor: FeatureExtractor, convs: list[Conversation], chunk: int = 64) -> Iterator[Features]:
    for k in range(0, len(convs), chunk):
        for f in extractor.many(convs[k: k + chunk]):
            if f is not None:
                yield f
