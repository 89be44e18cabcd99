"""`make eval-gsm8k` / `eagle3-eval-gsm8k`: GSM8K accuracy and speculative acceptance, with and
without speculation, always through the target's chat template.

Prompts are k-shot multi-turn chats (each exemplar a user turn and an assistant turn), greedy by
default; answers are extracted strictly (`#### N`) and flexibly (the last number). Backends:
  * `--base-url URL`: an SGLang server (`/generate` with the chat-rendered prompt, so every request
    returns its speculative counters in `meta_info`), many requests in flight;
  * default: the core's in-process reference decoder (target + Eagle3 head, CPU or GPU).
`--compare` runs the same questions without speculation too (a second server URL, or the reference
decoder with speculation off) and adds McNemar's test and the speed/acceptance ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import decimal
import json
import math
import os
import re
import sys
import time

from tqdm import tqdm

from sglang_ext.commands import VERSION, prog
from sglang_ext.core.accounting import AcceptanceStats, accepted_drafts_per_step_se
from sglang_ext.data import HUB_GSM8K, gsm8k as packaged_gsm8k
from sglang_ext.eval.report import write_reports
from sglang_ext.http_client import ServerRefused, add_api_key_argument, get_json, post_json, redacted

# a number starts with a digit that does not continue one ("1.2.3" is not "1.2" then ".3"); commas only as thousands
# separators ("1,000", not the list "1,2,3")
NUM = r"(?<!\d)(?<!\d\.)-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\d.])\.\d+)"  # ".75" too


# ------------------------------------------------------------------------------------- answers


def normalize_number(s: str | None) -> str | None:
    """'$1,234.50' -> '1234.5'; '18.00' -> '18'; None/unparseable -> None."""
    if s is None:
        return None
    s = s.strip().replace(",", "").replace("$", "").rstrip(".")
    try:  # exact: two integers past 2**53 that a float would round together stay apart
        v = decimal.Decimal(s)
    except decimal.InvalidOperation:
        return None
    if not v.is_finite():
        return None
    if v == v.to_integral_value():
        return str(int(v))
    return format(v.normalize(), "f")


def extract_strict(text: str) -> str | None:
    m = re.search(r"####\s*(-?)\s*\$?\s*(" + NUM + ")", text)  # "#### -$5" as "#### $-5"
    return normalize_number(m.group(1) + m.group(2)) if m else None


def extract_flexible(text: str) -> str | None:
    nums = re.findall(NUM, text.replace("$", ""))
    nums = [n for n in nums if re.search(r"\d", n)]
    return normalize_number(nums[-1]) if nums else None


def reference_answer(answer: str) -> str | None:
    return extract_strict(answer)


# ---------------------------------------------------------------------------------------- data


def load_gsm8k(path: str | None, split: str, limit: int | None) -> tuple[list[dict], int]:
    """Rows with question/answer and the number of malformed lines skipped. `path` None: the packaged copy
    (sglang_ext/data); "openai/gsm8k": the same data through `datasets`."""
    local = packaged_gsm8k(split) if path is None else path
    rows, bad = [], 0
    if os.path.exists(local):
        with open(local) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    if isinstance(r.get("question"), str) and reference_answer(str(r.get("answer", ""))) is not None:
                        rows.append(r)
                    else:
                        bad += 1
                except json.JSONDecodeError:
                    bad += 1
                if limit and len(rows) >= limit:
                    break
        return rows, bad
    if path != HUB_GSM8K:
        raise FileNotFoundError(f"--dataset-path {path} does not exist")
    import datasets

    ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
    rows = [dict(r) for r in ds.select(range(min(limit or len(ds), len(ds))))]
    return rows, 0


def fewshot_messages(exemplars: list[dict], question: str) -> list[dict]:
    msgs = []
    for ex in exemplars:
        msgs += [{"role": "user", "content": ex["question"]}, {"role": "assistant", "content": ex["answer"]}]
    return msgs + [{"role": "user", "content": question}]


def render_prompt(tokenizer, messages) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template: GSM8K is evaluated through the chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------ backends


class ServerBackend:
    """SGLang `/generate` with a chat-rendered prompt; meta_info carries the speculative counters."""

    def __init__(self, base_url: str, tokenizer, concurrency: int = 64, retries: int = 3, timeout: float = 600,
                 api_key: str | None = None):
        self.url, self.tok = base_url.rstrip("/"), tokenizer
        self.concurrency, self.retries, self.timeout, self.api_key = concurrency, retries, timeout, api_key

    def _post(self, payload: dict) -> dict:
        return post_json(self.url + "/generate", payload, self.retries, self.timeout, self.api_key)

    def run(self, prompts: list[str], max_new_tokens: int, temperature: float, desc: str) -> list[dict]:
        sp = {"max_new_tokens": max_new_tokens, "temperature": temperature}

        def one(p):
            r = self._post({"text": p, "sampling_params": sp})
            m = r.get("meta_info", {})
            return {"text": r.get("text", ""), "completion_tokens": m.get("completion_tokens", 0),
                    "spec": spec_from_meta(m)}

        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(tqdm(pool.map(one, prompts), total=len(prompts), desc=desc, unit="q", mininterval=5))


def spec_from_meta(meta: dict) -> dict | None:
    """Per-request speculative counters from SGLang's meta_info (None when the server has no
    speculation). SGLang's `spec_correct_drafts_histogram[j]` = verify steps with j accepted drafts."""
    if "spec_verify_ct" not in meta:
        return None
    hist = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram")
    if hist is None:
        accepted = meta.get("spec_accepted_drafts", meta.get("spec_num_correct_drafts"))
        return {"verify_steps": meta["spec_verify_ct"], "accepted_drafts": accepted, "histogram_counts": None}
    return {"verify_steps": meta["spec_verify_ct"], "accepted_drafts": sum(j * c for j, c in enumerate(hist)),
            "histogram_counts": list(hist)}


class ReferenceBackend:
    """The core's reference decoder: one request at a time, exact acceptance counters."""

    def __init__(self, decoder, tokenizer, speculative: bool):
        self.dec, self.tok, self.speculative = decoder, tokenizer, speculative

    def run(self, prompts: list[str], max_new_tokens: int, temperature: float, desc: str) -> list[dict]:
        from sglang_ext.core.verify import SamplingParams

        out = []
        for p in tqdm(prompts, desc=desc, unit="q", mininterval=5):
            ids = self.tok(p, add_special_tokens=False).input_ids
            g = self.dec.generate(ids, max_new_tokens, SamplingParams(temperature=temperature),
                                  eos_token_ids=[self.tok.eos_token_id], speculative=self.speculative)
            spec = None
            if g.stats is not None:
                spec = {"verify_steps": g.stats.verify_steps, "accepted_drafts": g.stats.accepted_drafts,
                        "histogram_counts": list(g.stats.histogram_counts)}
            out.append({"text": self.tok.decode(g.tokens, skip_special_tokens=True),
                        "completion_tokens": len(g.tokens), "spec": spec})
        return out


# ------------------------------------------------------------------------------------- scoring


def accuracy(flags: list[bool]) -> dict:
    n = len(flags)
    p = sum(flags) / n if n else 0.0
    return {"accuracy": p, "stderr": math.sqrt(p * (1 - p) / n) if n else 0.0, "correct": sum(flags), "n": n}


def mcnemar(a: list[bool], b: list[bool]) -> dict:
    """Exact (binomial) McNemar test on paired correctness: b01 = a right / b wrong, b10 = reverse."""
    b01 = sum(x and not y for x, y in zip(a, b))
    b10 = sum(y and not x for x, y in zip(a, b))
    n = b01 + b10
    k = min(b01, b10)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"only_first_correct": b01, "only_second_correct": b10, "p_value": p}


# per drafted token: steps x depth; a guessed depth would make it wrong (per-position figures, P(a >= i), are not)
DEPTH_DEPENDENT = ("draft_acceptance_rate",)


def acceptance(results: list[dict], depth: int | None) -> dict | None:
    """Accepted drafts per step over the requests (a ratio of sums), with its standard error across questions.
    A histogram is read at the larger of the server's depth and its own bins (an adaptive server's depth varies),
    never cut; with the depth unknown, the figures that divide by it are left out. A request whose counters
    lack its accepted drafts is left out and counted, not read as zero drafts."""
    specs = [r["spec"] for r in results if r["spec"] is not None]
    counted = [s for s in specs if s["histogram_counts"] is not None or s["accepted_drafts"] is not None]
    if not counted:
        return None
    if all(s["histogram_counts"] is not None for s in counted):
        per = [AcceptanceStats.from_histogram(s["histogram_counts"], depth) for s in counted]
        d = max([depth or 0] + [p.depth for p in per])
        stats = AcceptanceStats(d)
        for p in per:
            stats = stats.merge(p.resized(d))
        per_q = [(p.accepted_drafts, p.verify_steps) for p in per]
        out = stats.to_dict()
        if depth is None:  # guessed from the bins seen: positions past the largest are unknown, not zero
            for key in DEPTH_DEPENDENT:
                out.pop(key, None)
            out["depth"] = None
    else:
        per_q = [(s["accepted_drafts"], s["verify_steps"]) for s in counted]
        steps, acc = sum(n for _, n in per_q), sum(a for a, _ in per_q)
        out = {"verify_steps": steps, "accepted_drafts": acc,
               "accepted_drafts_per_step": acc / steps if steps else 0.0,
               "tokens_per_step": (acc + steps) / steps if steps else 0.0}
    if len(counted) < len(specs):
        out["requests_without_draft_counts"] = len(specs) - len(counted)
    # the question is the unit of noise (docs/metrics.md, "Noise"); one question has none to measure (null)
    if sum(n for _, n in per_q) > 0:
        se = accepted_drafts_per_step_se([a for a, _ in per_q], [n for _, n in per_q])
        out["standard_error"] = None if math.isnan(se) else se
    return out


def score(rows, results, wall_s: float, depth, want_spec: bool) -> dict:
    strict = [extract_strict(r["text"]) == reference_answer(q["answer"]) for q, r in zip(rows, results)]
    flexible = [extract_flexible(r["text"]) == reference_answer(q["answer"]) for q, r in zip(rows, results)]
    tokens = sum(r["completion_tokens"] for r in results)
    out = {"strict": accuracy(strict), "flexible": accuracy(flexible), "output_tokens": tokens,
           "wall_seconds": wall_s, "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
           "acceptance": acceptance(results, depth), "_strict_flags": strict}
    if want_spec and out["acceptance"] is None:
        out["acceptance_note"] = "the backend reported no speculative decoding (no spec counters in meta_info)"
    return out


def per_question(rows, results) -> list[dict]:
    """What another run is compared against, question by question: correctness, the extracted answer
    and a digest of the output text (greedy runs of one target should give the same text)."""
    import hashlib

    out = []
    for i, (q, r) in enumerate(zip(rows, results)):
        ref = reference_answer(q["answer"])
        row = {"index": i, "strict": extract_strict(r["text"]) == ref, "flexible": extract_flexible(r["text"]) == ref,
               "answer": extract_flexible(r["text"]), "output_tokens": r["completion_tokens"],
               "output_sha1": hashlib.sha1(r["text"].encode()).hexdigest()[:16]}
        if r.get("spec") is not None:  # what the acceptance figures are recounted (and paired) from
            row.update({k: r["spec"][k] for k in ("verify_steps", "accepted_drafts", "histogram_counts")})
        out.append(row)
    return out


def agreement(a: list[dict], b: list[dict]) -> dict:
    """Two runs' per-question records (e.g. the reference decoder and a server, same target, greedy) on the
    questions both answered: accuracy of each, identical outputs, same extracted answer, McNemar."""
    by_index = {r["index"]: r for r in b}
    pairs = [(r, by_index[r["index"]]) for r in a if r["index"] in by_index]
    if not pairs:
        return {"questions": 0}
    n = len(pairs)
    return {"questions": n, "strict_a": sum(x["strict"] for x, _ in pairs) / n,
            "strict_b": sum(y["strict"] for _, y in pairs) / n,
            "identical_outputs": sum(x["output_sha1"] == y["output_sha1"] for x, y in pairs),
            "same_answer": sum(x["answer"] == y["answer"] for x, y in pairs),
            "mcnemar_strict": mcnemar([x["strict"] for x, _ in pairs], [y["strict"] for _, y in pairs])}


# ---------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=prog("eval-gsm8k"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=VERSION)
    ap.add_argument("--base-url", help="SGLang server (default: the in-process reference decoder)")
    ap.add_argument("--nospec-base-url", help="with --compare: the server without speculation")
    ap.add_argument("--compare", action="store_true", help="also run without speculation and compare")
    add_api_key_argument(ap)
    ap.add_argument("--tokenizer", help="tokenizer for the chat template (default: the target)")
    ap.add_argument("--target", default="smollm2", help="reference backend target")
    ap.add_argument("--draft", default="out/draft", help="reference backend Eagle3 head directory")
    ap.add_argument("--speculative-num-steps", type=int, default=3)
    ap.add_argument("--speculative-eagle-topk", type=int, default=1)
    ap.add_argument("--speculative-num-draft-tokens", type=int)
    ap.add_argument("--dataset-path",
                    help=f"GSM8K test JSONL (default: the packaged copy; {HUB_GSM8K}: through datasets)")
    ap.add_argument("--fewshot-path", help="JSONL the exemplars come from (default: the train split)")
    ap.add_argument("--num-shots", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="out/eval-gsm8k")
    args = ap.parse_args(argv)
    for name in ("num_prompts", "speculative_num_steps", "speculative_eagle_topk", "max_new_tokens", "concurrency"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    if args.num_shots < 0:
        ap.error(f"--num-shots {args.num_shots}: 0 or more")
    if args.temperature < 0:
        ap.error(f"--temperature {args.temperature}: 0 (greedy) or more")
    if args.compare and args.base_url and not args.nospec_base_url:
        ap.error("--compare with --base-url needs --nospec-base-url (the server without speculation)")
    for name in ("dataset_path", "fewshot_path"):
        path = getattr(args, name)
        if path and path != HUB_GSM8K and not os.path.exists(path):
            ap.error(f"--{name.replace('_', '-')} {path}: no such file (a GSM8K JSONL; leave it out for the default)")
    if not args.base_url and not os.path.exists(os.path.join(args.draft, "config.json")):
        ap.error(f"--draft {args.draft}: no exported head there; run `make train-draft` first")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (FileNotFoundError, ConnectionError, ServerRefused) as e:  # a path or a server named on the command line
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from sglang_ext.core.targets import load_tokenizer

    rows, bad = load_gsm8k(args.dataset_path, "test", args.num_prompts)
    shots, _ = load_gsm8k(args.fewshot_path, "train", args.num_shots) if args.num_shots else ([], 0)
    tok_name = args.tokenizer or (None if args.base_url else args.target)
    if tok_name is None:
        tok_name = server_model_path(args.base_url, args.api_key)
    tok = load_tokenizer(tok_name)
    prompts = [render_prompt(tok, fewshot_messages(shots, r["question"])) for r in rows]
    arms = []
    # SGLang's per-request histogram stops at the largest count seen: take the depth from the server
    depth = server_spec_depth(args.base_url, args.api_key) if args.base_url else args.speculative_num_steps
    if args.base_url:
        # a lone server without speculation is the no-spec arm (with --compare the first URL is meant to
        # speculate, and the report says so if it does not)
        arms.append(("spec" if depth or args.compare else "no-spec", ServerBackend(args.base_url, tok, args.concurrency,
                                                                                  api_key=args.api_key)))
        if args.compare:
            arms.append(("no-spec", ServerBackend(args.nospec_base_url, tok, args.concurrency,
                                                     api_key=args.api_key)))
    else:
        from sglang_ext.core.decoder import ReferenceDecoder
        from sglang_ext.core.heads import Eagle3Head
        from sglang_ext.core.targets import load_target

        target = load_target(args.target, device=args.device)
        head = Eagle3Head.from_pretrained(args.draft, target.get_input_embeddings().weight).to(args.device)
        dec = ReferenceDecoder(target, head, args.speculative_num_steps, args.speculative_eagle_topk,
                               args.speculative_num_draft_tokens)
        arms.append(("spec", ReferenceBackend(dec, tok, True)))
        if args.compare:
            arms.append(("no-spec", ReferenceBackend(dec, tok, False)))
    report = {"config": redacted(vars(args)), "questions": len(rows), "malformed_lines": bad,
              "num_shots": len(shots), "chat_template": True, "arms": {}}
    report["speculative_num_steps"] = depth
    flags = {}
    for name, backend in arms:
        t = time.time()
        results = backend.run(prompts, args.max_new_tokens, args.temperature, f"gsm8k [{name}]")
        s = score(rows, results, time.time() - t, depth, name == "spec")
        flags[name] = s.pop("_strict_flags")
        report["arms"][name] = s
        report.setdefault("samples", {})[name] = [{"question": q["question"][:200], "output": r["text"][:400]}
                                                  for q, r in list(zip(rows, results))[:3]]
        report.setdefault("per_question", {})[name] = per_question(rows, results)
    if "spec" in report["arms"] and "no-spec" in report["arms"]:
        a, b = report["arms"]["spec"], report["arms"]["no-spec"]
        report["compare"] = {"mcnemar_strict": mcnemar(flags["spec"], flags["no-spec"]),
                             "accuracy_delta_strict": a["strict"]["accuracy"] - b["strict"]["accuracy"],
                             "speedup_output_tokens_per_s": (a["output_tokens_per_s"] / b["output_tokens_per_s"]
                                                             if b["output_tokens_per_s"] else None)}
    paths = write_reports(report, args.out)
    print_summary(report)
    print(f"reports: {', '.join(paths)}")
    return 0


def server_model_path(base_url: str, api_key: str | None = None) -> str:
    try:
        return get_json(base_url.rstrip("/") + "/get_model_info", api_key=api_key)["model_path"]
    except Exception as e:
        raise ConnectionError(f"cannot ask {base_url} for its model ({e}); pass --tokenizer") from None


def server_spec_depth(base_url: str, api_key: str | None = None) -> int | None:
    """speculative_num_steps of a running SGLang server (None without speculation or if unknown)."""
    try:
        info = get_json(base_url.rstrip("/") + "/get_server_info", api_key=api_key)
    except Exception:
        return None
    steps = info.get("speculative_num_steps") or (info.get("server_args") or {}).get("speculative_num_steps")
    return int(steps) if steps else None


def print_summary(report: dict) -> None:
    for name, a in report["arms"].items():
        acc = a["acceptance"]
        line = (f"[{name}] strict {a['strict']['accuracy']:.3f} +- {a['strict']['stderr']:.3f}, flexible "
                f"{a['flexible']['accuracy']:.3f}; {a['output_tokens_per_s']:.1f} output tokens/s")
        if acc:
            line += f"; accepted drafts per step {acc['accepted_drafts_per_step']:.3f}"
            se = acc.get("standard_error")
            if se is not None:  # None: one question
                line += f" +- {se:.3f}"
            if "per_position_acceptance" in acc:
                line += f" (per position {[round(x, 3) for x in acc['per_position_acceptance']]})"
        elif a.get("acceptance_note"):
            line += f"; {a['acceptance_note']}"
        print(line)
    if "compare" in report:
        c = report["compare"]
        print(f"[compare] McNemar p={c['mcnemar_strict']['p_value']:.3g} (only spec right "
              f"{c['mcnemar_strict']['only_first_correct']}, only no-spec right "
              f"{c['mcnemar_strict']['only_second_correct']}); speedup {c['speedup_output_tokens_per_s']}")


if __name__ == "__main__":
    sys.exit(main())
