"""Replace every assistant turn with the target's own answer, turn by turn (turn i is generated
from the conversation with turns < i already regenerated), so the draft learns the distribution it
will be served on.

Two engines with one output format (JSONL, one {"id", "messages"} per conversation, flushed as
they finish, so an interrupted run resumes by skipping ids already written):
  * `ServerRegenerator`: any OpenAI-compatible server (SGLang's /v1/chat/completions), requests in
    flight concurrently, bounded retries with backoff.
  * `LocalRegenerator`: an in-process transformers target, batched generation (small models, CPU).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from collections import Counter

import torch
from tqdm import tqdm

from sglang_ext.http_client import post_json
from sglang_ext.training.chat import prompt_ids
from sglang_ext.training.data import Conversation


@dataclasses.dataclass
class GenerationOptions:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0


def load_done(path: str) -> dict[str, Conversation]:
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    done[row["id"]] = Conversation(row["id"], row["messages"])
                except (json.JSONDecodeError, KeyError):
                    continue  # a line cut by an interruption: regenerate that conversation
    return done


def _context(messages: list[dict]) -> list[tuple]:
    """What regeneration keeps of a conversation: every turn but the assistant's answers."""
    return [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"]


def resumable(done: dict[str, Conversation], convs: list[Conversation], path: str) -> None:
    """Refuse to resume from a file whose conversation of the same id was regenerated from other user turns (the
    data changed under the same --work): training would silently take the old data. Ids must be unique (the file
    is keyed by them; data.unique_ids renames repeats)."""
    dup = next((i for i, n in Counter(c.id for c in convs).items() if n > 1), None)
    if dup is not None:
        raise ValueError(f"conversation id {dup!r} appears more than once; regeneration writes and resumes by id, so "
                         "one would overwrite the other (sglang_ext.training.data.unique_ids renames repeats)")
    for c in convs:
        old = done.get(c.id)
        if old is not None and _context(old.messages) != _context(c.messages):
            raise ValueError(f"{path} holds conversation {c.id!r} regenerated from other user turns than the data gives "
                             "now (the data changed under the same --work); use a new --work directory, or delete "
                             f"{path} to regenerate")


def open_for_append(path: str):
    """The output file for appending, cut back to its last complete line first: an interrupted run's half-written
    last line would otherwise glue onto the next record, and both would be lost."""
    if os.path.exists(path):
        with open(path, "rb+") as f:
            end = f.seek(0, os.SEEK_END)
            at = end
            while at > 0:  # back from the end, a block at a time, to the last newline
                start = max(0, at - (1 << 16))
                f.seek(start)
                block = f.read(at - start)
                nl = block.rfind(b"\n")
                if nl >= 0:
                    at = start + nl + 1
                    break
                at = start
            if at < end:
                f.truncate(at)
    return open(path, "a")


def _write(f, conv: Conversation) -> None:
    f.write(json.dumps({"id": conv.id, "messages": conv.messages}) + "\n")
    f.flush()


class LocalRegenerator:
    def __init__(self, model, tokenizer, options: GenerationOptions, batch_size: int = 16):
        self.model, self.tok, self.opt, self.batch_size = model, tokenizer, options, batch_size

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]]) -> list[str]:
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        width = max(len(p) for p in prompts)
        device = next(self.model.parameters()).device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        kw = dict(max_new_tokens=self.opt.max_new_tokens, pad_token_id=pad, eos_token_id=self.tok.eos_token_id)
        if self.opt.temperature > 0:
            kw.update(do_sample=True, temperature=self.opt.temperature, top_p=self.opt.top_p)
        else:
            kw.update(do_sample=False)
        out = self.model.generate(input_ids=ids, attention_mask=attn, **kw)[:, width:]
        return [self.tok.decode(row, skip_special_tokens=True).strip() for row in out]

    def run(self, convs: list[Conversation], out_path: str) -> list[Conversation]:
        done = load_done(out_path)
        resumable(done, convs, out_path)
        todo = [c for c in convs if c.id not in done]
        work = {c.id: [m for m in c.messages] for c in todo}
        last_turn = {c.id: max(i for i, m in enumerate(c.messages) if m["role"] == "assistant") for c in todo}
        n_turns = max((sum(m["role"] == "assistant" for m in c.messages) for c in todo), default=0)
        bar = tqdm(total=sum(sum(m["role"] == "assistant" for m in c.messages) for c in todo),
                   desc="regenerate (in-process)", unit="turn", mininterval=5)
        with open_for_append(out_path) as f:
            self._waves(work, last_turn, n_turns, done, f, bar)
        bar.close()
        return [done[c.id] for c in convs]

    def _waves(self, work: dict, last_turn: dict, n_turns: int, done: dict, f, bar) -> None:
        for turn in range(n_turns):  # wave by wave: turn i of every conversation that has one
            jobs = []
            for cid, msgs in work.items():
                idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
                if turn < len(idx):
                    jobs.append((cid, idx[turn]))
            jobs.sort(key=lambda j: len(prompt_ids(self.tok, work[j[0]][: j[1]])))  # similar lengths together
            for b in range(0, len(jobs), self.batch_size):
                chunk = jobs[b: b + self.batch_size]
                answers = self._generate([prompt_ids(self.tok, work[cid][:i]) for cid, i in chunk])
                for (cid, i), text in zip(chunk, answers):
                    work[cid][i] = {"role": "assistant", "content": text}
                    if i == last_turn[cid]:  # complete: written now, so an interruption keeps it
                        done[cid] = Conversation(cid, work[cid])
                        _write(f, done[cid])
                bar.update(len(chunk))


class ServerRegenerator:
    def __init__(self, base_url: str, model: str = "default", options: GenerationOptions | None = None,
                 concurrency: int = 32, retries: int = 3, timeout: float = 600, api_key: str | None = None):
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.api_key = api_key
        self.model, self.opt = model, options or GenerationOptions()
        self.concurrency, self.retries, self.timeout = concurrency, retries, timeout

    def _complete(self, messages: list[dict]) -> dict:
        """The answer as an assistant turn; with a server's reasoning parser, its `reasoning_content` too (chat.py's
        --reasoning keep/drop decides; the answer sent back as history is the content alone, as clients do)."""
        history = [{"role": m["role"], "content": m["content"]} for m in messages]
        r = post_json(self.url, {"model": self.model, "messages": history, "max_tokens": self.opt.max_new_tokens,
                                 "temperature": self.opt.temperature, "top_p": self.opt.top_p},
                      self.retries, self.timeout, self.api_key)
        msg = r["choices"][0]["message"]
        turn = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("reasoning_content"):
            turn["reasoning_content"] = msg["reasoning_content"]
        return turn

    def _conversation(self, conv: Conversation) -> Conversation:
        msgs = []
        for m in conv.messages:
            if m["role"] == "assistant":
                msgs.append(self._complete(msgs))
            else:
                msgs.append(dict(m))
        return Conversation(conv.id, msgs)

    def run(self, convs: list[Conversation], out_path: str) -> list[Conversation]:
        done = load_done(out_path)
        resumable(done, convs, out_path)
        todo = [c for c in convs if c.id not in done]
        with open_for_append(out_path) as f, concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool, \
                tqdm(total=len(todo), desc="regenerate (server)", unit="conv", mininterval=5) as bar:
            futures = [pool.submit(self._conversation, c) for c in todo]
            for fut in concurrent.futures.as_completed(futures):
                conv = fut.result()
                _write(f, conv)
                done[conv.id] = conv
                bar.update(1)
        return [done[c.id] for c in convs]
