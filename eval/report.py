"""Report writers shared by the evaluations: JSON (machines), Markdown (people), PNG (plots)."""

from __future__ import annotations

import json
import os

from sglang_ext.plotting import pyplot


def _md(report: dict) -> str:
    lines = ["# GSM8K evaluation", "",
             f"{report['questions']} questions, {report['num_shots']}-shot multi-turn chat (chat template applied), "
             f"{report['malformed_lines']} malformed data lines skipped.", "",
             "| arm | strict acc. | flexible acc. | output tok/s | accepted drafts / step | tokens / step | "
             "per-position acceptance |", "|---|---|---|---|---|---|---|"]
    for name, a in report["arms"].items():
        acc = a.get("acceptance") or {}
        per = acc.get("per_position_acceptance")
        cells = [name, f"{a['strict']['accuracy']:.3f} ± {a['strict']['stderr']:.3f}",
                 f"{a['flexible']['accuracy']:.3f} ± {a['flexible']['stderr']:.3f}", f"{a['output_tokens_per_s']:.1f}"]
        if acc:
            cells += [f"{acc['accepted_drafts_per_step']:.3f}", f"{acc.get('tokens_per_step', 0):.3f}",
                      ", ".join(f"{x:.3f}" for x in per) if per else "—"]
        else:
            cells += [a.get("acceptance_note", "no speculation"), "—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    if "compare" in report:
        c = report["compare"]
        lines += ["", f"McNemar (strict, paired): p = {c['mcnemar_strict']['p_value']:.3g}; only spec correct "
                      f"{c['mcnemar_strict']['only_first_correct']}, only no-spec correct "
                      f"{c['mcnemar_strict']['only_second_correct']}; accuracy delta "
                      f"{c['accuracy_delta_strict']:+.3f}; output tokens/s ratio spec/no-spec "
                      f"{c['speedup_output_tokens_per_s'] or 0:.3f}"]
    lines += ["", "Accepted drafts per step exclude the bonus token (docs/metrics.md)."]
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: str) -> None:
    plt = pyplot("eval", path)
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    spec = (report["arms"].get("spec") or {}).get("acceptance") or {}
    per = spec.get("per_position_acceptance") or []
    axes[0].bar(range(1, len(per) + 1), per, color="tab:blue")
    axes[0].set(title="acceptance per draft position P(a >= i)", xlabel="position i", ylabel="P", ylim=(0, 1))
    hist = spec.get("histogram") or []
    axes[1].bar(range(len(hist)), hist, color="tab:green")
    axes[1].set(title="accepted drafts per step P(a = j)", xlabel="j", ylabel="P", ylim=(0, 1))
    if not per:
        for ax in axes:
            ax.text(0.5, 0.5, "no speculative counters", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(report: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("report.json", "report.md", "acceptance.png")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(_md(report))
    _plot(report, paths[2])
    return paths
