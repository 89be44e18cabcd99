"""GPU check of the MLA scale target (issue: MLA scale target).

1. `python -m sglang_ext.training.scale_target` with the GPU defaults on ShareGPT and GSM8K (tests/gpu/gpu_data.py:
   the packages, or the files of GPU_DATA), timed end to end (loading SmolLM2 and data included).
2. Greedy outputs on GSM8K chat prompts: transformers (fp32, with top-2 logprob gaps) vs SGLang 0.5.17
   serving the checkpoint with the plugin and without it (no speculation).
Prints a table; writes $OUT/scale_target.json (and the target's report).

    PYTHONPATH=/tmp/site:. python tests/gpu/check_scale_target.py [--skip-build]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the checkout last: an installed sglang_ext (a wheel on PYTHONPATH) wins; else the editable install's
sys.path.append(REPO)
from serverlib import Server  # noqa: E402

WORK = os.environ.get("SCALE_WORK", "/tmp/scale")
import gpu_data  # noqa: E402
OUT = os.environ.get("OUT", "/tmp")
N_PROMPTS = int(os.environ.get("N_PROMPTS", "32"))
MAX_NEW = 64


def build() -> dict:
    t = time.time()
    cmd = [sys.executable, "-P", "-m", "sglang_ext.training.scale_target", "--out", f"{WORK}/target",
           "--data", gpu_data.sharegpt_spec(), "--gsm8k-data", gpu_data.gsm8k("test"),
           *os.environ.get("SCALE_ARGS", "").split()]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    log = (p.stdout + p.stderr).replace("\r", "\n")
    print("\n".join(line for line in log.splitlines() if "[scale-target]" in line or "---" in line
                    or "SmolLM2:" in line or "student:" in line or "Error" in line)[-6000:], flush=True)
    if p.returncode != 0:
        print(log[-4000:])
        raise SystemExit("scale-target build failed")
    report = json.load(open(f"{WORK}/target/scale_target_report.json"))
    report["wall_s_including_process_start"] = time.time() - t
    return report


def prompts(tok) -> list[list[int]]:
    from sglang_ext.training.chat import prompt_ids

    rows = [json.loads(line) for line in open(gpu_data.gsm8k("test"))][:N_PROMPTS]
    return [prompt_ids(tok, [{"role": "user", "content": r["question"]}]) for r in rows]


@torch.no_grad()
def transformers_greedy(ps: list[list[int]]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(f"{WORK}/target", dtype=torch.float32).cuda().eval()
    out = []
    for p in ps:
        ids = torch.tensor([p]).cuda()
        gen, gaps = [], []
        for _ in range(MAX_NEW):
            logits = model(ids).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            top = lp.topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            nxt = int(top.indices[0])
            gen.append(nxt)
            if nxt == model.config.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]]).cuda()], dim=1)
        out.append({"ids": gen, "gaps": gaps})
    return out


def greedy_ids(srv: Server, ps: list[list[int]]) -> list[list[int]]:
    """Greedy outputs, one request at a time: batch composition changes bf16 numerics."""
    return [srv.post("/generate", {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}})
            ["output_ids"] for p in ps]


def served(name: str, env: dict, ps: list[list[int]]) -> tuple[list[list[int]], float]:
    args = ["--model-path", f"{WORK}/target", "--max-running-requests", "32"]
    with Server(name, args, env) as srv:
        if not srv.wait_ready(300):
            print(srv.log()[-3000:])
            raise SystemExit(f"{name}: server did not start")
        return greedy_ids(srv, ps), srv.ready_s


def compare(ref: list[dict], rows: list[list[int]]) -> dict:
    same = tie = other = 0
    gaps = []
    for r, y in zip(ref, rows):
        x = r["ids"]
        if x == y[: len(x)] and (len(y) == len(x) or len(x) == MAX_NEW):
            same += 1
            continue
        k = next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y)))
        g = r["gaps"][k] if k < len(r["gaps"]) else None
        gaps.append(g)
        if g is not None and g <= 0.02:
            tie += 1
        else:
            other += 1
    return {"identical": same, "near_tie_partings": tie, "other_partings": other,
            "gaps": sorted(x for x in gaps if x is not None)}


def main():
    os.makedirs(WORK, exist_ok=True)
    result = {}
    if "--skip-build" not in sys.argv:
        result["build"] = build()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(f"{WORK}/target")
    ps = prompts(tok)
    ref = transformers_greedy(ps)
    for name, env in (("plugin", {}), ("upstream", {"SGLANG_PLUGINS": "none"})):
        rows, start = served(f"scale-{name}", env, ps)
        result[name] = dict(compare(ref, rows), start_s=start)
    json.dump(result, open(f"{OUT}/scale_target.json", "w"), indent=1)
    b = result.get("build", {})
    if b:
        print(f"\nbuild: {b['wall_s_including_process_start']:.0f}s wall; top-1 agreement {b['agreement']['all_tokens']:.3f} "
              f"(assistant {b['agreement']['assistant_tokens']:.3f}) after {b['steps']} steps; "
              f"at initialisation {b['agreement_init']['all_tokens']:.3f}")
    print("serving   identical  near-tie  other  gaps of other partings")
    for name in ("plugin", "upstream"):
        r = result[name]
        print(f"{name:<10}{r['identical']:<11}{r['near_tie_partings']:<10}{r['other_partings']:<7}"
              f"{[round(g, 3) for g in r['gaps'] if g > 0.02][:10]}")


if __name__ == "__main__":
    main()
