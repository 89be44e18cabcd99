"""Target features for draft training, per conversation: token ids, loss mask, the aux hidden states
at the convention's layers and the target's final (normed) hidden state, from which the target's
logits over the draft vocabulary are recomputed with its lm_head (storing full-vocab logits would
cost vocab/hidden times more).

Two extractors give the same records: `FeatureExtractor` runs the target in this process (transformers);
`ServerFeatureExtractor` asks an SGLang server of the target, started with the plugin as a feature server
(sglang_ext/serving/feature_capture.py: tensor parallel, any size SGLang serves), which writes each
request's hidden states to a directory both can reach.

Offline: sharded safetensors under a directory with `manifest.json`; an interrupted capture resumes
at the first missing shard. Online: the same records computed in memory as training asks for them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from sglang_ext.core.capture import AuxCapture
from sglang_ext.training.chat import ChatTemplateError, render
from sglang_ext.training.data import Conversation

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


def _render_or_none(tok, conv: Conversation, reasoning: str, max_tokens: int):
    try:
        return render(tok, conv.messages, reasoning, max_tokens)
    except ChatTemplateError:  # a row the template refuses is skipped (counted by the callers), not fatal
        return None


def rendered_trainable(tok, convs: list[Conversation], reasoning: str, max_tokens: int):
    """(renderings, indices of those with something to train on): the one rule both extractors apply."""
    rendered = [_render_or_none(tok, c, reasoning, max_tokens) for c in convs]
    return rendered, [i for i, r in enumerate(rendered) if r is not None and sum(r.loss_mask) and len(r.input_ids) >= 4]


def last_turn_only(convs: list[Conversation], rendered: list, trainable: list[int]) -> int:
    """How many of these trainable conversations have several assistant turns but train only the last (their
    template rewrites history: chat.render's as-served rendering): reported, not silent."""
    return sum(1 for i in trainable if rendered[i].as_served
               and sum(m["role"] == "assistant" for m in convs[i].messages) > 1)


class FeatureExtractor:
    def __init__(self, target, tokenizer, aux_output_ids, max_tokens: int = 2048, reasoning: str = "drop",
                 dtype=torch.bfloat16):
        self.last_turn_only = 0  # multi-turn conversations the template let train only on their last turn
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
        rendered, trainable = rendered_trainable(self.tok, convs, self.reasoning, self.max_tokens)
        self.last_turn_only += last_turn_only(convs, rendered, trainable)
        out: list[Features | None] = [None] * len(convs)
        todo = sorted(trainable, key=lambda i: len(rendered[i].input_ids))
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


def read_request(root: str, rid: str, input_ids: list[int], keep: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, last_hidden) of one request from the feature server's chunk files (one per prefill chunk),
    checked to cover every token in order and to hold the ids sent; the files are removed unless `keep`."""
    from sglang_ext.serving.feature_capture import request_dir

    where = request_dir(root, rid)
    names = sorted(f for f in os.listdir(where) if f.endswith(".safetensors")) if os.path.isdir(where) else []
    aux, last, at = [], [], 0
    for name in names:
        start = int(name.split(".")[0])
        if start != at:
            break
        t = load_file(os.path.join(where, name))
        aux.append(t["aux"])
        last.append(t["last_hidden"])
        if t["input_ids"].tolist() != input_ids[at: at + len(t["input_ids"])]:
            raise RuntimeError(f"feature server: request {rid} holds other tokens at {at} than were sent")
        at += len(t["input_ids"])
    if at != len(input_ids):
        raise RuntimeError(
            f"feature server: request {rid} has hidden states for tokens [0, {at}) of {len(input_ids)} in {where} "
            f"(chunks {names}); is the server started with --eagle3-feature-dir {root} and --disable-radix-cache, "
            "and is that directory the same one on both sides?")
    if not keep:
        shutil.rmtree(where, ignore_errors=True)
    return torch.cat(aux), torch.cat(last)


class ServerFeatureExtractor:
    """`FeatureExtractor`'s records from an SGLang feature server: each conversation is sent once as
    input_ids (one token generated), the server writes its prompt's hidden states under `feature_dir`."""

    def __init__(self, base_url: str, tokenizer, feature_dir: str, max_tokens: int = 2048, reasoning: str = "drop",
                 dtype=torch.bfloat16, concurrency: int = 16, retries: int = 3, timeout: float = 600,
                 aux_width: int | None = None, aux_output_ids: list[int] | None = None, api_key: str | None = None):
        from sglang_ext.http_client import post_json

        self.url = base_url.rstrip("/") + "/generate"
        self.tok, self.feature_dir = tokenizer, feature_dir
        self.last_turn_only = 0
        self.max_tokens, self.reasoning, self.dtype = max_tokens, reasoning, dtype
        self.concurrency, self._post = concurrency, lambda payload: post_json(self.url, payload, retries, timeout,
                                                                                 api_key)
        self.aux_width = aux_width  # layers x hidden the trainer expects
        self.aux_output_ids = aux_output_ids  # the layers it expects: checked against the server's recorded plan
        self._plan_checked = False

    def check_server_layers(self) -> None:
        """The layers the feature server captures (its plan, written at load: serving/feature_capture.py) must be
        the trainer's; a server that recorded none is checked by width only."""
        from sglang_ext.config import AuxLayerPlan
        from sglang_ext.serving.feature_capture import PLAN_FILE

        path = os.path.join(self.feature_dir, PLAN_FILE)
        if self.aux_output_ids is None or not os.path.exists(path):
            return
        with open(path) as f:
            served = AuxLayerPlan.from_dict(json.load(f))
        mine = AuxLayerPlan(tuple(self.aux_output_ids), "the trainer's aux layers", "output", None)
        mine.require_same_layers(served, path,
                                   f"start the feature server with --speculative-eagle3-aux-layers "
                                   f"{','.join(map(str, self.aux_output_ids))}, or give the trainer --aux-layers "
                                   f"{','.join(map(str, served.output_ids))}")
        self._plan_checked = True

    def __call__(self, conv: Conversation) -> Features | None:
        return self.many([conv])[0]

    def _one(self, r) -> Features:
        from sglang_ext.serving.feature_capture import RID_PREFIX

        rid = RID_PREFIX + uuid.uuid4().hex
        self._post({"input_ids": list(r.input_ids), "rid": rid,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        aux, last = read_request(self.feature_dir, rid, list(r.input_ids))
        if self.aux_width is not None and aux.shape[1] != self.aux_width:
            raise RuntimeError(
                f"feature server: aux width {aux.shape[1]} = {aux.shape[1] // last.shape[1]} layers x {last.shape[1]}, "
                f"the trainer expects {self.aux_width}; give the server --speculative-eagle3-aux-layers (or "
                "SGLANG_EXT_EAGLE3_AUX_LAYERS) with the trainer's --aux-layers (its startup log names the layers it "
                "captures)")
        return Features(torch.tensor(r.input_ids), torch.tensor(r.loss_mask, dtype=torch.uint8), aux.to(self.dtype),
                        last.to(self.dtype))

    def many(self, convs: list[Conversation], batch_tokens: int | None = None) -> list[Features | None]:
        if not self._plan_checked:
            self.check_server_layers()
        rendered, todo = rendered_trainable(self.tok, convs, self.reasoning, self.max_tokens)
        self.last_turn_only += last_turn_only(convs, rendered, todo)
        out: list[Features | None] = [None] * len(convs)
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            for i, f in zip(todo, pool.map(lambda i: self._one(rendered[i]), todo)):
                out[i] = f
        return out

    def close(self):
        pass


def _pack(records: list[Features]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(r.input_ids) for r in records])
    return {"lengths": lengths, "input_ids": torch.cat([r.input_ids for r in records]),
            "loss_mask": torch.cat([r.loss_mask for r in records]), "aux": torch.cat([r.aux for r in records]),
            "last_hidden": torch.cat([r.last_hidden for r in records])}


def _unpack(t: dict[str, torch.Tensor]) -> list[Features]:
    n = int(t["lengths"].sum())
    if not n == len(t["input_ids"]) == len(t["loss_mask"]) == len(t["aux"]) == len(t["last_hidden"]):
        raise ValueError(f"a feature shard whose record lengths add to {n} tokens holds {len(t['input_ids'])} ids, "
                         f"{len(t['aux'])} aux rows and {len(t['last_hidden'])} hidden rows")
    out, start = [], 0
    for n in t["lengths"].tolist():
        sl = slice(start, start + n)
        out.append(Features(t["input_ids"][sl], t["loss_mask"][sl], t["aux"][sl], t["last_hidden"][sl]))
        start += n
    return out


def write_shards(extractor: FeatureExtractor, convs: list[Conversation], out_dir: str, shard_size: int = 64,
                 meta: dict | None = None) -> dict:
    """Capture features for `convs` into out_dir/shard-NNNNN.safetensors (+ manifest); resumable. Each shard
    records which conversations it holds, so a resume whose data or order differs (another seed, another
    source, an older version's order) is refused instead of mixing two orders into one training set."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, MANIFEST)
    manifest = json.load(open(path)) if os.path.exists(path) else {"shards": [], "skipped": 0, **(meta or {})}
    for key, value in (meta or {}).items():  # features of another target, other layers, another rendering: refused
        if key in manifest and json.loads(json.dumps(value)) != manifest[key]:
            raise ValueError(f"{out_dir} holds features captured with {key}={manifest[key]!r}, this run asks for "
                             f"{key}={value!r}; capture into a new --work directory, or delete {out_dir} (and the "
                             "checkpoint beside it) to capture again")
    done = {s["file"]: s for s in manifest["shards"]}
    chunks = [convs[i: i + shard_size] for i in range(0, len(convs), shard_size)]
    with tqdm(total=len(convs), desc="capture target features", unit="conv", mininterval=5) as bar:
        for k, chunk in enumerate(chunks):
            name = f"shard-{k:05d}.safetensors"
            key = _conversations_key(chunk)
            if name in done:  # already captured: the same conversations, or refuse
                if done[name].get("conversations") != key:
                    raise ValueError(
                        f"{os.path.join(out_dir, name)} holds other conversations than chunk {k} of this run (the data, "
                        f"its order, the seed or the shard size changed since it was captured, or an older version "
                        f"captured it); capture into a new --work directory, or delete {out_dir} to capture again")
                bar.update(len(chunk))
                continue
            found = extractor.many(chunk)
            records = [f for f in found if f is not None]
            manifest["skipped"] += len(found) - len(records)
            bar.update(len(chunk))
            if records:
                save_file(_pack(records), os.path.join(out_dir, name))
                manifest["shards"].append({"file": name, "records": len(records), "conversations": key,
                                           "ids": [c.id for c, f in zip(chunk, found) if f is not None],
                                           "tokens": int(sum(len(r.input_ids) for r in records))})
            with open(path + ".tmp", "w") as fh:
                json.dump(manifest, fh, indent=1)
            os.replace(path + ".tmp", path)  # the manifest only ever names complete shards
    return manifest


def _conversations_key(chunk: list[Conversation]) -> str:
    """Which conversations, in which order, a shard was captured from."""
    return hashlib.sha256("\n".join(c.id for c in chunk).encode()).hexdigest()[:16]


def records_of(out_dir: str, ids: set[str]) -> int | None:
    """How many records the shards hold of these conversations (None: a manifest from before shards named them).
    Shards keep the conversations' order, so held-out conversations first means their records first -- but a
    conversation with nothing to train on has no record, and counting conversations would shift the split."""
    manifest = json.load(open(os.path.join(out_dir, MANIFEST)))
    if any("ids" not in s for s in manifest["shards"]):
        return None
    return sum(cid in ids for s in manifest["shards"] for cid in s["ids"])


def read_shards(out_dir: str) -> list[Features]:
    """Every record the manifest names, each shard checked against it (present, its record count, one aux width)."""
    manifest = json.load(open(os.path.join(out_dir, MANIFEST)))
    records, width = [], None
    for s in manifest["shards"]:
        file = os.path.join(out_dir, s["file"])
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file}, named in {out_dir}/{MANIFEST}, is missing; delete {out_dir} to capture "
                                    "the features again")
        got = _unpack(load_file(file))
        widths = {(r.aux.shape[-1], r.last_hidden.shape[-1]) for r in got}
        if len(got) != s["records"] or len(widths) > 1 or (width is not None and widths != {width}):
            raise ValueError(f"{file} does not match {out_dir}/{MANIFEST} ({len(got)} records of widths {sorted(widths)}, "
                             f"the manifest says {s['records']}{'' if width is None else f' of width {width}'}); "
                             f"delete {out_dir} to capture the features again")
        width = next(iter(widths), width)
        records += got
    return records


def online(extractor: FeatureExtractor, convs: list[Conversation], chunk: int = 64) -> Iterator[Features]:
    for k in range(0, len(convs), chunk):
        for f in extractor.many(convs[k: k + chunk]):
            if f is not None:
                yield f
