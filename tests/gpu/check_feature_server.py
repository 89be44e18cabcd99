"""GPU check: draft-training features captured by an SGLang feature server of the target (the plugin with
SGLANG_EXT_FEATURE_DIR, sglang_ext.training.features.ServerFeatureExtractor) against the same features computed
in-process by transformers (sglang_ext.training.features.FeatureExtractor), on the same conversations.

Prints, per tensor (aux states at the convention's layers, final normed hidden), the relative error
|server - transformers| / |transformers| (median and max over conversations) and the cosine similarity,
and the capture rate of both paths. bf16 kernels differ between the two engines, so a relative error of
~1e-2 is expected; a wrong layer, a shifted token or a missing chunk shows as O(1).

    PYTHONPATH=/tmp/site:. python tests/gpu/check_feature_server.py [TARGET_DIR] [--tp 2] [--n 64]
    (default target: the tiny DeepseekV3 of check_serving.py, built if absent)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the checkout last: an installed sglang_ext (a wheel on PYTHONPATH) wins; else the editable install's
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from serverlib import Server, tp_args  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("target", nargs="?", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--data", default=None, help="messages JSONL / sharegpt spec (default: GSM8K-style questions)")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from sglang_ext.config.aux_layers import default_output_ids
    from sglang_ext.core.capture import text_config_of
    from sglang_ext.training import data as D
    from sglang_ext.training.features import FeatureExtractor, ServerFeatureExtractor
    from sglang_ext.core.targets import load_target

    target_dir = args.target
    if target_dir is None:
        import check_serving

        target_dir = f"{check_serving.WORK}/target"
        if not os.path.exists(f"{target_dir}/model.safetensors"):
            os.makedirs(check_serving.WORK, exist_ok=True)
            check_serving.build()
    tok = AutoTokenizer.from_pretrained(target_dir)
    if args.data:
        convs = D.load_source(args.data, D.LoadReport())[: args.n]
    else:
        convs = [D.Conversation(str(i), [{"role": "user", "content": f"What is {i} times {i + 3}? Think step by step."},
                                         {"role": "assistant", "content": f"{i} times {i + 3} is {i * (i + 3)}. "
                                                                          f"So the answer is {i * (i + 3)}."}])
                 for i in range(args.n)]
    feature_dir = "/tmp/feature-server"
    shutil.rmtree(feature_dir, ignore_errors=True)
    os.makedirs(feature_dir)
    server = ["--model-path", target_dir, "--disable-radix-cache", *tp_args(args.tp)]
    out = {"target": target_dir, "tp": args.tp, "conversations": len(convs)}
    with Server("feature-server", server, {"SGLANG_EXT_FEATURE_DIR": feature_dir}) as srv:
        if not srv.wait_ready(400):
            print(srv.log()[-4000:])
            return 1
        out["start_s"] = round(srv.ready_s)
        out["server_line"] = [x for x in srv.log().splitlines() if "[sglang_ext]" in x][:4]
        target = load_target(target_dir, dtype=torch.bfloat16, device=torch.device("cuda"))
        aux_ids = default_output_ids(text_config_of(target).num_hidden_layers)
        width = len(aux_ids) * text_config_of(target).hidden_size
        t = time.time()
        remote = ServerFeatureExtractor(srv.url, tok, feature_dir, aux_width=width, concurrency=32).many(convs)
        out["server_s"] = round(time.time() - t, 2)
    t = time.time()
    local = FeatureExtractor(target, tok, aux_ids).many(convs)
    out["transformers_s"] = round(time.time() - t, 2)
    rel = {"aux": [], "last_hidden": []}
    cos = {"aux": [], "last_hidden": []}
    for a, b in zip(local, remote):
        if a is None or b is None:
            continue
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        for name in rel:
            x, y = getattr(a, name).float(), getattr(b, name).float()
            rel[name].append(((y - x).norm() / x.norm()).item())
            cos[name].append(torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item())
    for name in rel:
        r = sorted(rel[name])
        out[name] = {"relative_error_median": r[len(r) // 2], "relative_error_max": r[-1],
                     "cosine_min": min(cos[name]), "records": len(r)}
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        json.dump(out, open(os.path.join(os.environ["OUT"], "feature_server.json"), "w"), indent=1)
    return 0 if all(out[n]["relative_error_max"] < 0.1 for n in rel) else 1


if __name__ == "__main__":
    sys.exit(main())
