"""The server's draft, as every adapter reads it: the path from SGLang's global server args,
resolved to a local directory, parsed once per process by sglang_ext.conventions."""

from __future__ import annotations

import functools
import os

from sglang_ext import checkpoint
from sglang_ext.conventions import DraftSpec, load_json, parse_draft


def draft_dir(path: str | None) -> str | None:
    """A local directory for the draft (a path, or a hub id already in the local cache)."""
    if not path:
        return None
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["config.json", "*.json"], local_files_only=True)
    except Exception:  # not cached: SGLang downloads it later; adapters fall back to upstream behaviour
        return None


def server_args():
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:  # no server context (a bare model in a test)
        return None


def decode_backends() -> tuple[str | None, str | None]:
    """(target, draft) decode attention backends as configured (None: SGLang picks at start)."""
    args = server_args()
    if args is None:
        return None, None
    target = getattr(args, "decode_attention_backend", None) or getattr(args, "attention_backend", None)
    return target, getattr(args, "speculative_draft_attention_backend", None) or target


def server_draft_path() -> str | None:
    args = server_args()
    return getattr(args, "speculative_draft_model_path", None) if args is not None else None


@functools.lru_cache(maxsize=8)
def _load(path: str) -> tuple[DraftSpec, dict]:
    return parse_draft(load_json(path)), checkpoint.weight_shapes(path)


def server_draft() -> tuple[DraftSpec, dict] | None:
    """(DraftSpec, safetensors shapes) of the server's Eagle3 draft, or None if there is none."""
    path = draft_dir(server_draft_path())
    return _load(path) if path else None
