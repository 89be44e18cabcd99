"""GPU check of the GSM8K evaluation's server path against a real SGLang 0.5.17 server with the
plugin: a tiny DeepseekV3 target and an MHA Eagle3 head exported by the core; `sglang_ext.eval.gsm8k` with
`--base-url` writes the three reports and reads acceptance from meta_info; the reference decoder
(transformers, same weights) runs the same prompts so the two can be compared.

    PYTHONPATH=/tmp/site python tests/gpu/check_eval_server.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
# the checkout last: an installed sglang_ext (a wheel on PYTHONPATH) wins; else the editable install's
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from serverlib import Server  # noqa: E402

from sglang_ext.core import tiny  # noqa: E402

WORK = "/tmp/evalcheck"
GSM8K = os.path.join(WORK, "gsm8k.jsonl")


def main():
    t0 = time.time()
    out = os.environ.get("OUT", "/tmp")
    cfg = tiny.deepseek_v3_config(num_layers=8, moe_layers=1, hidden=512, heads=8, vocab=512, q_lora_rank=256,
                                  kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128, n_routed_experts=8)
    target = tiny.build_target(cfg, seed=0)
    tok = tiny.train_tokenizer(512)
    tiny.save_target(target, tok, f"{WORK}/target")
    head = tiny.random_head(tiny.head_config_for(cfg, "mha", [1, 3, 6]), target, seed=1)
    head.save_pretrained(f"{WORK}/draft")
    with open(GSM8K, "w") as f:  # GSM8K-shaped rows the tiny tokenizer can encode
        for i in range(8):
            f.write(json.dumps({"question": f"how many apples does the user have {i}",
                                "answer": f"the total is {i} apples\n#### {i}"}) + "\n")
    args = ["--model-path", f"{WORK}/target", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
            f"{WORK}/draft", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4"]
    from sglang_ext.eval import gsm8k as G

    with Server("eval-spec", args) as srv:
        if not srv.wait_ready(300):
            print(srv.log()[-4000:])
            return 1
        print(f"server ready in {srv.ready_s:.0f}s")
        rc = G.main(["--base-url", srv.url, "--tokenizer", f"{WORK}/target", "--dataset-path", GSM8K,
                     "--fewshot-path", GSM8K, "--num-shots", "1", "--num-prompts", "8", "--max-new-tokens", "32",
                     "--out", f"{out}/eval-server"])
        print("eval rc", rc)
    rc2 = G.main(["--target", f"{WORK}/target", "--draft", f"{WORK}/draft", "--device", "cuda", "--dataset-path", GSM8K,
                  "--fewshot-path", GSM8K, "--num-shots", "1", "--num-prompts", "8", "--max-new-tokens", "32",
                  "--out", f"{out}/eval-reference"])
    a = json.load(open(f"{out}/eval-server/report.json"))
    b = json.load(open(f"{out}/eval-reference/report.json"))
    same = sum(x["output"] == y["output"] for x, y in zip(a["samples"]["spec"], b["samples"]["spec"]))
    print(f"server strict acc {a['arms']['spec']['strict']['accuracy']:.3f}, reference {b['arms']['spec']['strict']['accuracy']:.3f}; "
          f"first-3 outputs identical: {same}/3; server acceptance {a['arms']['spec']['acceptance']}; "
          f"reference acceptance {b['arms']['spec']['acceptance']['accepted_drafts_per_step']:.3f}; rc {rc2}; "
          f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
