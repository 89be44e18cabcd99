"""Data the product ships for offline use: GSM8K's test and train splits (MIT, see gsm8k/LICENSE; the
`openai/gsm8k` dataset, main configuration, as JSONL rows with `question` and `answer`)."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
HUB_GSM8K = "openai/gsm8k"  # the same data through `datasets`, when asked for by name


def gsm8k(split: str) -> str:
    """The packaged GSM8K JSONL of `split` ("test" or "train")."""
    if split not in ("test", "train"):
        raise ValueError(f"GSM8K split {split!r}: 'test' or 'train'")
    return os.path.join(HERE, "gsm8k", f"{split}.jsonl")
