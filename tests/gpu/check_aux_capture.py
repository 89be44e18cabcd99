"""GPU check for the aux-layer convention (issue: plugin foundation).

Builds a tiny DeepseekV3 (MLA + one MoE layer) target and random Eagle3 MHA drafts whose configs
state aux ids in each convention; for each, starts `python -m sglang.launch_server
--speculative-algorithm EAGLE3` with the plugin, sends one prompt, and compares the aux states the
plugin captured (SGLANG_EXT_AUX_DUMP_DIR) with every decoder layer's output computed by
transformers on the same prompt. Prints a table; writes $OUT/aux_capture.json.

    PYTHONPATH=/tmp/site python tests/gpu/check_aux_capture.py [VARIANT ...]
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(__file__))
from serverlib import Server  # noqa: E402

from sglang_ext.core import tiny  # noqa: E402
from sglang_ext.core.capture import capture_aux  # noqa: E402

WORK = "/tmp/auxcheck"
N_LAYERS = 8
# name: (ids written in eagle_config or None, declared convention or None, override env, expected outputs,
#        cuda graphs on?, expect refusal?)
VARIANTS = {
    "undeclared": ([1, 3, 6], None, None, [1, 3, 6], False, False),
    "output-last": ([0, 3, 7], "output", None, [0, 3, 7], True, False),
    "input": ([2, 4, 6], "input", None, [1, 3, 5], False, False),
    "undeclared-verbatim": ([2, 4, 6], None, None, [1, 3, 5], False, False),
    "default": (None, None, None, [1, 3, 4], False, False),
    "override": ([1, 3, 6], None, "2,5,7", [2, 5, 7], False, False),
    "bad-range": ([1, 3, 9], "output", None, None, False, True),
}
MLA_HEADS = {"output-last", "input"}  # these variants serve an MLA-format head (our export), the rest MHA


def build(work: str):
    cfg = tiny.deepseek_v3_config(num_layers=N_LAYERS, moe_layers=1, hidden=512, heads=8, vocab=512,
                                  q_lora_rank=256, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
                                  init_std=0.05, n_routed_experts=8)
    target = tiny.build_target(cfg, seed=0)
    tok = tiny.train_tokenizer(512)
    tiny.save_target(target, tok, f"{work}/target")
    for name, (ids, conv, *_rest) in VARIANTS.items():
        fmt = "mla" if name in MLA_HEADS else "mha"
        hc = tiny.head_config_for(cfg, fmt, ids or [1, 3, 4], aux_layer_convention=conv or "output")
        head = tiny.random_head(hc, target, seed=1)
        head.save_pretrained(f"{work}/draft-{name}")
        config_path = f"{work}/draft-{name}/config.json"
        d = json.load(open(config_path))
        d["eagle_config"] = {"use_aux_hidden_state": True}
        if ids is not None:
            d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        if conv is not None:
            d["eagle_config"]["aux_layer_convention"] = conv
        json.dump(d, open(config_path, "w"), indent=1)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            os.system(f"cp {work}/target/{f} {work}/draft-{name}/")
    return cfg, tok


def layer_outputs(work: str, prompt_ids: list[int]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(f"{work}/target", dtype=torch.float32).cuda().eval()
    with torch.no_grad(), capture_aux(model, list(range(N_LAYERS))) as cap:
        model(torch.tensor([prompt_ids]).cuda())
        return [cap.states[j][0].float().cpu() for j in range(N_LAYERS)]


def main():
    names = sys.argv[1:] or list(VARIANTS)
    out_dir = os.environ.get("OUT", "/tmp")
    t0 = time.time()
    cfg, tok = build(WORK)
    prompt = tok.apply_chat_template([{"role": "user", "content": "how many apples does the user have in total"}],
                                     add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    ref = layer_outputs(WORK, prompt_ids)
    print(f"built target + drafts and reference in {time.time() - t0:.0f}s; prompt {len(prompt_ids)} tokens")
    rows = []
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", "1e9"))
    for name in names:
        if time.time() - t0 > deadline:
            print(f"--- {name}: skipped (deadline)")
            continue
        ids, conv, override, expected, graphs, refuse = VARIANTS[name]
        dump = f"{WORK}/dump-{name}"
        os.system(f"rm -rf {dump}")
        env = {"SGLANG_EXT_AUX_DUMP_DIR": dump, "SGLANG_EXT_AUX_DUMP_MAX": "8"}
        if override:
            env["SGLANG_EXT_EAGLE3_AUX_LAYERS"] = override
        args = ["--model-path", f"{WORK}/target", "--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", f"{WORK}/draft-{name}", "--speculative-num-steps", "3",
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
        if not graphs:
            args.append("--disable-cuda-graph")
        row = {"variant": name, "head": "mla" if name in MLA_HEADS else "mha", "ids": ids, "declared": conv, "override": override, "expected": expected,
               "cuda_graph": graphs}
        with Server(f"aux-{name}", args, env) as srv:
            ok = srv.wait_ready(240)
            log = srv.log()
            line = next((m for m in re.findall(r"\[sglang_ext\][^\n]*", log) if "aux hidden states" in m), None)
            row["startup_line"] = line
            if refuse:
                err = next((m for m in re.findall(r"ConfigError[^\n]*|[^\n]*out of range[^\n]*", log)), None)
                row.update(started=ok, refused=not ok, error=err,
                           passed=(not ok) and err is not None and "eagle_aux_hidden_state_layer_ids" in err)
                rows.append(row)
                print(json.dumps(row))
                continue
            row["started"] = ok
            row["start_s"] = round(getattr(srv, "ready_s", -1))
            if not ok:
                row["passed"] = False
                rows.append(row)
                print(json.dumps(row))
                print(f"!!! {name}: server did not start; log tail:\n{log[-4000:]}\nstopping here")
                break
            res = srv.post("/generate", {"input_ids": prompt_ids,
                                         "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
            row["meta"] = {k: v for k, v in res["meta_info"].items() if "spec" in k or k == "completion_tokens"}
        # find the dump of our prompt's prefill
        match = None
        for f in sorted(os.listdir(dump)) if os.path.isdir(dump) else []:
            d = load_file(os.path.join(dump, f))
            if d["input_ids"].tolist() == prompt_ids:
                match = d
        if match is None:
            row.update(passed=False, error="no dump of the prompt's prefill")
        else:
            aux = match["aux_hidden_states"]
            chunks = aux.chunk(aux.shape[-1] // ref[0].shape[-1], dim=-1)
            found, errs = [], []
            for c in chunks:
                rel = [((c - r).norm() / r.norm()).item() for r in ref]
                best = min(range(N_LAYERS), key=lambda j: rel[j])
                second = sorted(rel)[1]
                found.append(best)
                errs.append({"layer": best, "rel_err": round(rel[best], 4), "next_best_rel_err": round(second, 4)})
            row.update(captured=found, match=errs, passed=found == expected and line is not None)
        rows.append(row)
        print(json.dumps(row))
    print("\n| variant | head | ids in config | declared | override | expected outputs | captured (matched) | "
          "rel err (next best) | cuda graph | pass |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        errs = ", ".join(f"{m['rel_err']} ({m['next_best_rel_err']})" for m in r.get("match", []))
        cap = r.get("captured", "refused at startup" if r.get("refused") else "-")
        print(f"| {r['variant']} | {r['head']} | {r['ids']} | {r['declared']} | {r['override']} | {r['expected']} | {cap} | "
              f"{errs} | {r['cuda_graph']} | {'PASS' if r['passed'] else 'FAIL'} |")
    for r in rows:
        print(f"{r['variant']}: startup line: {r.get('startup_line')}" + (f"\n   error: {r.get('error')}"
                                                                          if r.get("error") else ""))
    json.dump(rows, open(os.path.join(out_dir, "aux_capture.json"), "w"), indent=1)
    print(f"total {time.time() - t0:.0f}s; {sum(r['passed'] for r in rows)}/{len(rows)} passed")


if __name__ == "__main__":
    main()
