"""`python -m sglang_ext inspect-draft DRAFT_DIR --target TARGET_DIR_OR_CONFIG_JSON`

Run before launching a server: which target layers a draft will read under our plugin and under
upstream SGLang, vLLM and TRT-LLM, and every reason the pair would be refused. Reads only
config.json files and safetensors headers: no weights, no GPU, no SGLang import.
Exit status: 0 accepted, 1 refused, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from sglang_ext import checkpoint, settings
from sglang_ext.commands import VERSION, prog
from sglang_ext.config import Eagle3DraftConfig, TargetConfig, kv, pair, resolve_with_errors
from sglang_ext.config.architectures import PLUGIN_HOOKED
from sglang_ext.config.aux_layers import CONVENTION_FIELD, ENGINES, OVERRIDE_FIELD, engine_output_ids
from sglang_ext.config.values import load_json
from sglang_ext.errors import ConfigError

ENGINE_LABELS = {"sglang-ext": "sglang_ext (ours)", "sglang": "upstream SGLang 0.5.17",
                 "vllm": "vLLM / ATOM", "trtllm": "TRT-LLM"}


def inspect(draft_path: str, target_path: str, override: str | None = None, pools: dict | None = None) -> dict:
    """Everything inspect-draft reports, as a JSON-able dict; `errors` empty means accepted.
    `pools`: {gpu_memory_gib, mem_fraction_static, tp_size, kv_cache_dtype, draft_kv_cache_dtype}."""
    report: dict = {"draft": draft_path, "target": target_path, "errors": [], "notes": [], "weights_checked": False}
    pools = dict(pools or {})
    backend = pools.pop("attention_backend", None)

    def fail(e: ConfigError):
        report["errors"].append({"field": e.field, "value": e.value, "problem": e.problem, "fix": e.fix,
                                 "message": str(e)})

    try:
        target = TargetConfig.from_dict(load_json(target_path))
    except ConfigError as e:
        fail(e)
        return report
    report["target_info"] = {"architecture": target.architecture, "num_hidden_layers": target.num_hidden_layers,
                             "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
                             "attention": "mla" if target.is_mla else "mha",
                             "text_config_nested": target.nested_text_config, "family": target.family}
    try:
        draft = Eagle3DraftConfig.from_dict(load_json(draft_path))
    except ConfigError as e:
        fail(e)
        return report
    draft_dir = checkpoint.directory_of(draft_path)
    try:
        shapes = checkpoint.weight_shapes(draft_dir)
        fc_in = checkpoint.fc_in_features(shapes)
    except ConfigError as e:
        fail(e)
        shapes, fc_in = {}, None
    pickled = checkpoint.pickle_weight_files(draft_dir)
    if shapes:
        report["weights_checked"] = True
        if fc_in is None and draft.use_aux_hidden_state:
            fail(ConfigError("fc.weight", None, "missing from the checkpoint",
                             "an Eagle3 head needs fc.weight (aux states -> hidden)"))
    elif pickled:
        report["notes"].append(f"weights not checked: only pickle-format files ({', '.join(pickled[:3])}); "
                               "inspect-draft never unpickles. Convert them to safetensors to have them checked")
    elif not report["errors"]:
        report["notes"].append("no safetensors next to the draft config: weight checks skipped")
    report["draft_info"] = {"architecture": draft.architecture, "head_format": draft.head_format,
                            "hidden_size": draft.hidden_size, "draft_vocab_size": draft.draft_vocab_size,
                            "aux_layer_ids": list(draft.aux_layer_ids) if draft.aux_layer_ids else None,
                            "aux_ids_source": draft.aux_ids_source,
                            "vllm_layer_ids": list(draft.vllm_layer_ids) if draft.vllm_layer_ids else None,
                            "declared_convention": draft.aux_layer_convention, "fc_in_features": fc_in}
    if not draft.use_aux_hidden_state:
        report["notes"].append("eagle_config.use_aux_hidden_state is false: SGLang captures no aux states and feeds "
                               "the head the target's last hidden state; the aux layers below are not captured")
    family = target.family
    if family == "unsupported":
        fail(ConfigError("target.architectures", target.architecture,
                         "SGLang 0.5.17 has no EAGLE3 aux-state capture for this architecture (the model has no "
                         "set_eagle3_layers_to_capture), so an EAGLE3 server fails at start",
                         "serve the head on a target SGLang captures for (DeepSeek-V2/V3, Kimi-K2.5, Llama, Qwen, "
                         "...) or use another --speculative-algorithm"))
    elif family == "unknown":
        report["notes"].append(f"{target.architecture} is not among SGLang 0.5.17's EAGLE3 targets this tool knows; "
                               "the layer rows assume it adds 1 to each id, as most SGLang models do")
    hooked = target.architecture in PLUGIN_HOOKED
    if not hooked and family != "unsupported":
        report["notes"].append(f"the plugin's aux-layer hook is not on {target.architecture}'s path: upstream "
                               f"SGLang's reading applies ({OVERRIDE_FIELD} and eagle_config.{CONVENTION_FIELD} "
                               "are not applied)")
    plan, errors = resolve_with_errors(target, draft, override, fc_in)
    for e in errors:
        fail(e)
    schema_errors = pair.pair_errors(target, draft, shapes)
    for e in schema_errors:
        fail(e)
    tp = pools.get("tp_size", 1)
    if not draft.errors():
        for e in pair.tp_errors(target, draft, tp):
            fail(e)
    for e in pair.triton_pair_errors(target, draft):
        if backend == "triton":
            fail(e)
        else:
            report["notes"].append(f"with --attention-backend triton: {e}")
    if draft.head_format == "mla" and draft.q_lora_rank is None and not schema_errors:
        report["notes"].append("an MLA head without q_lora_rank serves only with this plugin: upstream SGLang 0.5.17's "
                               "Eagle3DeepseekV2ForCausalLM and vLLM's deepseek_eagle3 require q_lora_rank")
    try:
        kvd = kv.target_kv_dtype(pools.get("kv_cache_dtype"))
        dkv = kv.canonical_kv_dtype(pools.get("draft_kv_cache_dtype"), "--draft-kv-cache-dtype")
        if kv.TARGET_KV_DTYPES[kvd] is not None:
            for e in kv.kv_dtype_errors(draft, dkv, kvd):
                fail(e)
    except ConfigError as e:
        fail(e)
        kvd = None
    if schema_errors:
        report["notes"].append("KV pool report skipped: fix the errors above first")
    elif kvd is not None and kv.TARGET_KV_DTYPES[kvd] is None:
        report["notes"].append(f"KV pool report skipped: a {kvd} KV cache is a packed 4-bit recipe this tool does "
                               "not size")
    elif kvd is not None:
        try:
            on_disk = checkpoint.checkpoint_bytes(checkpoint.directory_of(target_path))
        except ConfigError as e:
            report["notes"].append(f"target weights not sized from its checkpoint ({e}); estimated from the config")
            on_disk = None
        try:
            report["kv_pools"] = kv_pool_report(target, draft, shapes, target_checkpoint_bytes=on_disk, **pools)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # a target config too sparse for it
            report["notes"].append(f"KV pool report skipped: a target config field the arithmetic needs is missing, "
                                   f"zero or not a number ({type(e).__name__}: {e})")
        k = report.get("kv_pools")
        if k and k["split"]["tokens"] == 0:
            need = k.get("min_tp_size")
            report["notes"].append(
                f"no KV budget left: the target's weights (~{k['target_weights_gib_estimate']:.1f} GiB per rank) fill "
                f"{k['gpu_memory_gib']:g} GiB x --mem-fraction-static {k['mem_fraction_static']:g} at TP {k['tp_size']}"
                + (f"; the server needs --tp-size {need} or more on this GPU" if need else
                   "; no TP size up to 64 fits on this GPU"))
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
                   tp_size: int = 1, kv_cache_dtype: str | None = "bf16", draft_kv_cache_dtype: str | None = None,
                   target_checkpoint_bytes: int | None = None) -> dict:
    """Bytes per token of each pool (per TP rank) and the split of the KV budget, ours vs upstream's. The
    target's weights per rank: its checkpoint's bytes / TP when given, else estimated from its config
    (quantization included)."""
    kvd = kv.target_kv_dtype(kv_cache_dtype)
    dkv = kv.canonical_kv_dtype(draft_kv_cache_dtype, "--draft-kv-cache-dtype") or kvd
    t_bytes = kv.target_kv_bytes_per_token(target, kvd, tp_size)
    d_bytes = kv.draft_kv_bytes_per_token(draft, dkv, tp_size)
    upstream_d = kv.upstream_draft_bytes_per_token(target, kvd, tp_size)

    def weights_per_rank(tp):
        if target_checkpoint_bytes is not None:
            return target_checkpoint_bytes // tp
        return kv.estimate_weight_bytes(target.text_config, 2, tp, config=target.config)

    target_weights = weights_per_rank(tp_size)
    draft_weights = checkpoint.tensor_bytes(shapes)

    def budget_at(tp):
        return int(gpu_memory_gib * 2 ** 30 * mem_fraction_static) - weights_per_rank(tp) - draft_weights // tp

    budget = budget_at(tp_size)
    ours = kv.PoolSplit(max(budget, 0), t_bytes, d_bytes)
    upstream_tokens = kv.PoolSplit(max(budget, 0), t_bytes, upstream_d).tokens
    overshoot = upstream_tokens * (d_bytes - upstream_d)
    min_tp = next((tp for tp in (1, 2, 4, 8, 16, 32, 64) if budget_at(tp) > 0), None)
    return {"head_format": draft.head_format, "tp_size": tp_size, "kv_cache_dtype": kvd, "draft_kv_cache_dtype": dkv,
            "target_bytes_per_token": t_bytes, "draft_bytes_per_token": d_bytes,
            "upstream_draft_bytes_per_token": upstream_d, "gpu_memory_gib": gpu_memory_gib,
            "mem_fraction_static": mem_fraction_static, "target_weights_gib_estimate": target_weights / 2 ** 30,
            "target_weights_source": "checkpoint" if target_checkpoint_bytes is not None else "config",
            "draft_weights_gib": draft_weights / 2 ** 30, "split": ours.to_dict(),
            "upstream_tokens": upstream_tokens, "upstream_overshoot_gib": overshoot / 2 ** 30, "min_tp_size": min_tp}


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
                     f"\n  aux ids in config: {d['aux_layer_ids']} (convention: {conv}"
                     + ("; from the top-level field only, vLLM's" if d.get("aux_ids_source") == "top-level" else "")
                     + ")" + (f"; vLLM's field: {d['vllm_layer_ids']}" if d.get("vllm_layer_ids") else ""))
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
                     + ("from its checkpoint):" if k["target_weights_source"] == "checkpoint"
                        else "estimated from the config):"))
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
    elif report.get("weights_checked"):
        lines.append("OK: the server would accept this pair.")
    else:
        lines.append("OK by the configs: the server would accept them; the weights were not checked (see the notes).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog("inspect-draft"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=VERSION)
    ap.add_argument("draft", help="draft checkpoint directory (config.json [+ safetensors])")
    ap.add_argument("--target", required=True, help="target directory or its config.json")
    ap.add_argument("--override", default=settings.raw_value("aux_layers"),
                    help=f"output ids as the operator would give {OVERRIDE_FIELD} (default: its variable "
                         f"{settings.BY_ATTR['aux_layers'].env})")
    ap.add_argument("--gpu-memory-gib", type=float, default=141.0, help="GPU memory for the pool split (H200: 141)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", default="bf16", help="the target's (SGLang --kv-cache-dtype)")
    ap.add_argument("--draft-kv-cache-dtype", default=settings.raw_value("draft_kv_cache_dtype"),
                    help=f"as the operator would give {kv.DRAFT_KV_DTYPE_FIELD} (default: its variable "
                         f"{settings.BY_ATTR['draft_kv_cache_dtype'].env})")
    ap.add_argument("--attention-backend", help="the server's (SGLang --attention-backend); triton: refuse MLA "
                                                "latents its decode kernel cannot compile (otherwise a note)")
    ap.add_argument("--json", action="store_true", help="print a JSON report")
    args = ap.parse_args(argv)
    if args.tp_size < 1:
        ap.error(f"--tp-size {args.tp_size}: at least 1")
    if not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        ap.error(f"--gpu-memory-gib {args.gpu_memory_gib}: a positive number of GiB (H200: 141)")
    if not (math.isfinite(args.mem_fraction_static) and 0 < args.mem_fraction_static <= 1):
        ap.error(f"--mem-fraction-static {args.mem_fraction_static}: a fraction in (0, 1], e.g. 0.85")
    pools = dict(gpu_memory_gib=args.gpu_memory_gib, mem_fraction_static=args.mem_fraction_static,
                 tp_size=args.tp_size, kv_cache_dtype=args.kv_cache_dtype,
                 draft_kv_cache_dtype=args.draft_kv_cache_dtype, attention_backend=args.attention_backend)
    report = inspect(args.draft, args.target, args.override, pools)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
