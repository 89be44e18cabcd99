"""What every adapter reads of the server it runs in: SGLang's server args (compat.server_args), local model
directories, and the server's Eagle3 draft (its typed config and safetensors shapes), read once per process."""

from __future__ import annotations

import functools
import os

from sglang_ext import checkpoint
from sglang_ext.config import Eagle3DraftConfig


def local_dir(path: str | None) -> str | None:
    """A local directory for a model (a path, or a hub id already in the local cache); None if neither."""
    if not path:
        return None
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["config.json", "*.json"], local_files_only=True)
    except Exception:  # noqa: BLE001 -- not cached: SGLang downloads it later; adapters fall back to upstream behaviour
        return None


def server_args():
    """The server's arguments in this process, as resolved (None: no server context, a bare model in a test);
    where SGLang keeps them depends on the release (compat.server_args)."""
    from sglang_ext.serving import compat

    return compat.server_args()


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
def load_draft(path: str) -> tuple[Eagle3DraftConfig, dict]:
    """(config, safetensors shapes) of a draft directory, read once per process."""
    return Eagle3DraftConfig.load(path, strict=False), checkpoint.weight_shapes(path)


def server_draft() -> tuple[Eagle3DraftConfig, dict] | None:
    """(config, safetensors shapes) of the server's Eagle3 draft, or None if there is none."""
    path = local_dir(server_draft_path())
    return load_draft(path) if path else None
