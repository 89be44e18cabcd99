"""`python -m sglang_ext inspect-draft DRAFT_DIR --target TARGET_DIR_OR_CONFIG_JSON`

Run before launching a server: which target layers a draft will read under our plugin and under
upstream SGLang, vLLM and TRT-LLM, and every reason the pair would be refused. Reads only
config.json files and safetensors headers: no weights, no GPU, no SGLang import.
Exit status: 0 accepted, 1 refused, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sglang_ext import checkpoint, draft_schema
from sglang_ext.conventions import (
    ENGINES,
    OVERRIDE_ENV,
    ConfigError,
    aux_layer_errors,
    engine_output_ids,
    load_json,
    parse_draft,
    parse_target,
)

ENGINE_LABELS = {"sglang-ext": "sglang_ext (ours)", "sglang": "upstream SGLang 0.5.17",
                 "vllm": "vLLM / ATOM", "trtllm": "TRT-LLM"}


def inspect(draft_path: str, target_path: str, override: str | None = None, pools: dict | None = None) -> dict:
    """Everything inspect-draft reports, as a JSON-able dict; `errors` empty means accepted.
    `pools`: {gpu_memory_gib, mem_fraction_static, tp_size, kv_cache_dtype, draft_kv_cache_dtype}."""
    report: dict = {"draft": draft_path, "target": target_path, "errors": [], "notes": []}

    def fail(e: ConfigError):
        report["errors"].append({"field": e.field, "value": e.value, "problem": e.problem, "fix": e.fix,
                                 "message": str(e)})

    try:
        target = parse_target(load_json(target_path))
    except ConfigError as e:
        fail(e)
        return report
    report["target_info"] = {"architecture": target.architecture, "num_hidden_layers": target.num_hidden_layers,
                             "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
                             "attention": "mla" if target.is_mla else "mha",
                             "text_config_nested": target.nested_text_config, "family": target.family}
    try:
        draft = parse_draft(load_json(draft_path))
    except ConfigError as e:
        fail(e)
        return report
    shapes = checkpoint.weight_shapes(draft_path) if os.path.isdir(draft_path) else {}
    fc_in = checkpoint.fc_in_features(shapes)
    if not shapes:
        report["notes"].append("no safetensors next to the draft config: weight checks skipped")
    elif fc_in is None:
        report["errors"].append({"field": "fc.weight", "value": None, "problem": "missing from the checkpoint",
                                 "fix": "an Eagle3 head needs fc.weight (aux states -> hidden)",
                                 "message": "fc.weight=None: missing from the checkpoint"})
    report["draft_info"] = {"architecture": draft.architecture, "head_format": draft.head_format,
                            "hidden_size": draft.hidden_size, "draft_vocab_size": draft.draft_vocab_size,
                            "aux_layer_ids": list(draft.aux_layer_ids) if draft.aux_layer_ids else None,
                            "declared_convention": draft.aux_layer_convention, "fc_in_features": fc_in}
    plan, errors = aux_layer_errors(target, draft, override, fc_in)
    for e in errors:
        fail(e)
    for e in draft_schema.pair_errors(target, draft, shapes):
        fail(e)
    backend = (pools or {}).get("attention_backend")
    for e in draft_schema.triton_pair_errors(target, draft):
        if backend == "triton":
            fail(e)
        else:
            report["notes"].append(f"with --attention-backend triton: {e}")
    try:
        report["kv_pools"] = kv_pool_report(target, draft, shapes, **{k: v for k, v in (pools or {}).items()
                                                                       if k != "attention_backend"})
        for e in draft_schema.kv_dtype_errors(draft, report["kv_pools"]["draft_kv_cache_dtype"],
                                              report["kv_pools"]["kv_cache_dtype"]):
            fail(e)
    except ConfigError as e:
        fail(e)
    except (KeyError, TypeError, ValueError) as e:  # a config too sparse for the arithmetic
        report["notes"].append(f"KV pool report skipped: config field {e} missing or not a number")
    engines = {}
    for engine in ENGINES:
        try:
            engines[engine] = engine_output_ids(engine, target, draft)
        except ConfigError as e:
            engines[engine] = None
            report["notes"].append(f"{engine}: {e}")
    report["engines"] = engines
    ours = engines.get("sglang-ext")
    report["disagree"] = sorted(k for k, v in engines.items() if k != "sglang-ext" and v is not None
                                and ours is not None and v != ours)
    if plan is not None:
        report["plan"] = {"output_ids": list(plan.output_ids), "source": plan.source,
                          "convention": plan.convention, "sglang_layers_to_capture": plan.capture_indices}
    return report


def kv_pool_report(target, draft, shapes, gpu_memory_gib: float = 141.0, mem_fraction_static: float = 0.85,
                   tp_size: int = 1, kv_cache_dtype: str = "bf16", draft_kv_cache_dtype: str | None = None) -> dict:
    """Bytes per token of each pool (per TP rank) and the split of the KV budget, ours vs upstream's."""
    kv = draft_schema.canonical_kv_dtype(kv_cache_dtype, "--kv-cache-dtype") or "bf16"
    dkv = draft_schema.canonical_kv_dtype(draft_kv_cache_dtype, "--draft-kv-cache-dtype") or kv
    t_bytes = draft_schema.target_kv_bytes_per_token(target, kv, tp_size)
    d_bytes = draft_schema.draft_kv_bytes_per_token(draft, dkv, tp_size)
    upstream_d = draft_schema.upstream_draft_bytes_per_token(target, kv, tp_size)
    target_weights = draft_schema.estimate_weight_bytes(target.text_config, 2, tp_size)
    draft_weights = sum(_numel(m["shape"]) * _DTYPE_BYTES.get(m["dtype"], 2) for m in shapes.values())
    budget = int(gpu_memory_gib * 2 ** 30 * mem_fraction_static) - target_weights - draft_weights // tp_size
    ours = draft_schema.PoolSplit(max(budget, 0), t_bytes, d_bytes)
    upstream_tokens = draft_schema.PoolSplit(max(budget, 0), t_bytes, upstream_d).tokens
    overshoot = upstream_tokens * (d_bytes - upstream_d)
    return {"head_format": draft.head_format, "tp_size": tp_size, "kv_cache_dtype": kv, "draft_kv_cache_dtype": dkv,
            "target_bytes_per_token": t_bytes, "draft_bytes_per_token": d_bytes,
            "upstream_draft_bytes_per_token": upstream_d, "gpu_memory_gib": gpu_memory_gib,
            "mem_fraction_static": mem_fraction_static, "target_weights_gib_estimate": target_weights / 2 ** 30,
            "draft_weights_gib": draft_weights / 2 ** 30, "split": ours.to_dict(),
            "upstream_tokens": upstream_tokens, "upstream_overshoot_gib": overshoot / 2 ** 30}


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "BOOL": 1, "F8_E4M3": 1, "U8": 1, "I8": 1}


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def render(report: dict) -> str:
    lines = []
    t, d = report.get("target_info"), report.get("draft_info")
    if t:
        nested = " (text_config of a VL wrapper)" if t["text_config_nested"] else ""
        lines.append(f"target: {report['target']}\n  {t['architecture']}{nested}: {t['num_hidden_layers']} layers, "
                     f"hidden {t['hidden_size']}, vocab {t['vocab_size']}, {t['attention'].upper()} attention")
    if d:
        conv = d["declared_convention"] or "undeclared -> read as upstream SGLang 0.5.17 reads it"
        lines.append(f"draft: {report['draft']}\n  {d['architecture']}: {d['head_format'].upper()} head, hidden "
                     f"{d['hidden_size']}, draft vocab {d['draft_vocab_size']}, fc in_features {d['fc_in_features']}"
                     f"\n  aux ids in config: {d['aux_layer_ids']} (convention: {conv})")
    if "engines" in report:
        lines.append("physical target layers read (outputs of 0-based decoder layers):")
        for engine, ids in report["engines"].items():
            flag = "   <-- DIFFERS from sglang_ext" if engine in report["disagree"] else ""
            lines.append(f"  {ENGINE_LABELS[engine]:<24} {ids if ids is not None else 'refused'}{flag}")
    if "plan" in report:
        p = report["plan"]
        lines.append(f"sglang_ext will capture outputs of {p['output_ids']} (from {p['source']}; "
                     f"SGLang layers_to_capture {p['sglang_layers_to_capture']})")
    if "kv_pools" in report:
        k, sp = report["kv_pools"], report["kv_pools"]["split"]
        lines.append(f"KV pools per rank (TP {k['tp_size']}, {k['gpu_memory_gib']:g} GiB GPU, --mem-fraction-static "
                     f"{k['mem_fraction_static']:g}; target weights ~{k['target_weights_gib_estimate']:.1f} GiB "
                     f"estimated from the config):")
        lines.append(f"  target {k['target_bytes_per_token']} B/token ({k['kv_cache_dtype']}); draft "
                     f"{k['draft_bytes_per_token']} B/token ({k['head_format'].upper()} head, "
                     f"{k['draft_kv_cache_dtype']}); upstream SGLang budgets the draft at "
                     f"{k['upstream_draft_bytes_per_token']} B/token")
        lines.append(f"  split: {sp['tokens']} tokens; target {sp['target_gib']:.2f} GiB, draft {sp['draft_gib']:.2f} "
                     f"GiB of {sp['budget_gib']:.2f} GiB")
        if k["upstream_overshoot_gib"] > 0:
            lines.append(f"  upstream sizing ({k['upstream_tokens']} tokens) would overrun the budget by "
                         f"{k['upstream_overshoot_gib']:.2f} GiB")
    lines += [f"note: {n}" for n in report["notes"]]
    if report["errors"]:
        lines.append(f"REFUSED ({len(report['errors'])} error(s)):")
        lines += [f"  - {e['message']}" for e in report["errors"]]
    else:
        lines.append("OK: the server would accept this pair.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ext inspect-draft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("draft", help="draft checkpoint directory (config.json [+ safetensors])")
    ap.add_argument("--target", required=True, help="target directory or its config.json")
    ap.add_argument("--override", default=os.environ.get(OVERRIDE_ENV),
                    help=f"output ids as the operator would set {OVERRIDE_ENV} (default: that variable)")
    ap.add_argument("--gpu-memory-gib", type=float, default=141.0, help="GPU memory for the pool split (H200: 141)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", default="bf16", help="the target's (SGLang --kv-cache-dtype)")
    ap.add_argument("--draft-kv-cache-dtype", default=os.environ.get(draft_schema.DRAFT_KV_DTYPE_ENV),
                    help=f"as the operator would set {draft_schema.DRAFT_KV_DTYPE_ENV} (default: that variable)")
    ap.add_argument("--attention-backend", help="the server's (SGLang --attention-backend); triton: refuse MLA "
                                                "latents its decode kernel cannot compile (otherwise a note)")
    ap.add_argument("--json", action="store_true", help="print a JSON report")
    args = ap.parse_args(argv)
    pools = dict(gpu_memory_gib=args.gpu_memory_gib, mem_fraction_static=args.mem_fraction_static,
                 tp_size=args.tp_size, kv_cache_dtype=args.kv_cache_dtype,
                 draft_kv_cache_dtype=args.draft_kv_cache_dtype, attention_backend=args.attention_backend)
    report = inspect(args.draft, args.target, args.override, pools)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
