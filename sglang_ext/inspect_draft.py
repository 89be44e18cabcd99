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

from sglang_ext import checkpoint
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


def inspect(draft_path: str, target_path: str, override: str | None = None) -> dict:
    """Everything inspect-draft reports, as a JSON-able dict; `errors` empty means accepted."""
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
    ap.add_argument("--json", action="store_true", help="print a JSON report")
    args = ap.parse_args(argv)
    report = inspect(args.draft, args.target, args.override)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
