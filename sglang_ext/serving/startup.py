"""The server's startup check: every reason this plugin would refuse the server, found once, in the launching
process, before any model is built or weight read.

  * SGLang 0.5.17 - 0.5.20: ``sglang.srt.server_args.ServerArgs.__post_init__`` (AFTER) -- SGLang loads plugins
    before it builds its ServerArgs, and resolves them in ``__post_init__``, so this runs when the server's options
    are parsed.
  * SGLang 0.5.21+: ``sglang.srt.server_args.ServerArgs.resolve_once`` (AFTER) -- ServerArgs is a msgspec Struct
    whose ``__post_init__`` does nothing (a hook on it would never run); resolution is ``resolve_once``, which the
    launcher, the Engine and every process that publishes its config call. The check runs once per record (a mark
    that travels with it to the child processes) and reads the values as resolved (compat.resolved).

It checks the plugin's options (sglang_ext.settings), the SGLang release and the hooks SGLang could not apply, and
for an EAGLE3 server with a local draft (or one in the Hugging Face cache) the whole (target, draft) pair -- configs,
weight names and shapes (safetensors headers), the aux layers, tensor parallelism, the attention backends, the draft
KV dtype. One ConfigError carries everything found.

Where the draft is not readable yet (a hub id to be downloaded), the capture hook (serving/aux_capture.py) resolves
and checks the aux layers when the target loads.
"""

from __future__ import annotations

import logging

from sglang_ext import checkpoint, settings
from sglang_ext.config import Eagle3DraftConfig, TargetConfig, kv, pair, resolve_with_errors
from sglang_ext.errors import ConfigError, combined
from sglang_ext.serving import compat, draft_shape, fa3_verify, hooks
from sglang_ext.serving.context import local_dir
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)


def attention_tp(args) -> int:
    """Ranks an attention layer's heads are split over (tp / dp under DP attention)."""
    tp = int(getattr(args, "tp_size", 1) or 1)
    dp = compat.attention_dp_size(args)
    return max(1, tp // dp) if dp > 1 else tp


def draft_kv_dtype(args, s: settings.Settings) -> tuple[str | None, list[ConfigError]]:
    """(the draft's KV cache dtype, None: the target's; the refusal of an option that contradicts SGLang's own flag
    of that name, SGLang 0.5.18+)."""
    try:
        return compat.draft_kv_dtype(s, args), []
    except ConfigError as e:
        return s.draft_kv_dtype, [e]


def pair_problems(args, s: settings.Settings) -> tuple[list[ConfigError], list[str]]:
    """(errors, warnings) of the server's (target, draft) pair; ([], []) when either is not readable here."""
    if str(getattr(args, "speculative_algorithm", None) or "").upper() != "EAGLE3":
        return [], []
    draft_dir = local_dir(getattr(args, "speculative_draft_model_path", None))
    target_dir = local_dir(getattr(args, "model_path", None))
    if draft_dir is None or target_dir is None:
        return [], []
    target = TargetConfig.load(target_dir)
    draft = Eagle3DraftConfig.load(draft_dir, strict=False)  # pair_errors lists its errors with the rest
    shapes = checkpoint.weight_shapes(draft_dir)
    errors = pair.pair_errors(target, draft, shapes)
    if not errors:  # head counts a TP size cannot split: named here, not a bare assert in a layer later
        errors += pair.tp_errors(target, draft, attention_tp(args))
    backend = getattr(args, "decode_attention_backend", None) or getattr(args, "attention_backend", None)
    draft_backend = getattr(args, "speculative_draft_attention_backend", None) or backend
    topk = int(getattr(args, "speculative_eagle_topk", None) or 1)
    backend_errors, warnings = pair.backend_errors(target, draft, backend, draft_backend, topk,
                                                   bool(getattr(args, "enable_deterministic_inference", False)),
                                                   bool(getattr(args, "speculative_adaptive", False)),
                                                   fa3_verify.server_reason(s, getattr(args, "kv_cache_dtype", None)))
    errors += backend_errors
    target_kv = kv.target_kv_dtype(getattr(args, "kv_cache_dtype", None))
    if kv.TARGET_KV_DTYPES[target_kv] is not None:
        errors += kv.kv_dtype_errors(draft, draft_kv_dtype(args, s)[0], target_kv)
    _, plan_errors = resolve_with_errors(target, draft, s.aux_layers, checkpoint.fc_in_features(shapes))
    return errors + plan_errors, warnings


def adaptive_policy_problems(args, s: settings.Settings, record=None) -> tuple[list[ConfigError], list[str]]:
    """The cost policy decides inside SGLang's adaptive speculation. Where SGLang turns that off (a draft tree,
    attention DP, ...: it logs a warning and serves its fixed shape), a server asked for the policy would run with no
    protection at all: refused, with SGLang's reason. Without --speculative-adaptive the option does nothing: a
    warning."""
    if s.adaptive_policy != "cost":
        return [], []
    option = settings.BY_ATTR["adaptive_policy"]
    flag = option.flag
    if getattr(args, "speculative_algorithm", None):
        reason = compat.adaptive_unsupported_reason(args if record is None else record)
        if reason:
            if "topk" in reason:
                fix = ("serve a chain with the policy (--speculative-adaptive --speculative-eagle-topk 1 "
                       "--speculative-num-draft-tokens = --speculative-num-steps + 1), this tree with it and "
                       f"{settings.BY_ATTR['adaptive_shapes'].flag} tree (the policy then also chooses chains and "
                       "no drafting; SGLang 0.5.17, FA3), or this tree without it (unprotected)")
            elif "DP" in reason or "dp_attention" in reason:
                fix = ("serve without attention DP to have the policy, or without the policy (SGLang's fixed draft "
                       "shape, unprotected) under attention DP")
            else:
                fix = f"drop what SGLang names, or serve without {flag} cost"
            return [ConfigError(option.label, "cost", "the cost policy decides inside SGLang's adaptive speculation, "
                                f"which SGLang turns off on this server ({reason}): the server would draft at its "
                                "fixed shape with no protection", fix)], []
    if not getattr(args, "speculative_adaptive", False):
        return [], [f"{flag} cost has no effect without --speculative-adaptive"]
    return [], []


def graph_coverage_warnings(args) -> list[str]:
    """A running limit above the largest decode CUDA graph: batches between the two run every draft and verify forward
    eagerly. Measured on an H200 (docs/results.md, "Under real traffic"): a soak with graphs to 64 and a limit of 128
    ran 94% of its decode batches eagerly, 17-18 ms a depth-0 step with the GPU 7-13% busy. Only where the limit was
    given: SGLang's own (from the KV pool) is known once the pool is built."""
    if not getattr(args, "speculative_algorithm", None):
        return []
    running = getattr(compat.resolved(args), "max_running_requests", None)
    sizes = compat.decode_graph_batch_sizes(args)
    if not running or not sizes:
        return []
    per_worker = int(running) // compat.attention_dp_size(args)
    if per_worker <= sizes[-1]:
        return []
    return [f"--max-running-requests {running} is above the largest decode CUDA graph ({sizes[-1]} requests"
            + (f" per attention DP rank, of {per_worker}" if per_worker != int(running) else "")
            + f"): decode batches of {sizes[-1] + 1}-{per_worker} requests run their draft and verify forwards "
            f"without CUDA graphs; add {per_worker} to --cuda-graph-bs-decode (or --cuda-graph-max-bs-decode "
            f"{per_worker}), or lower the running limit"]


def option_problems(args, s: settings.Settings, record=None) -> tuple[list[ConfigError], list[str]]:
    """Options that contradict the server's other arguments (`record`: the operator's raw ServerArgs where `args` is
    a view of it)."""
    errors, warnings = adaptive_policy_problems(args, s, record)
    warnings += graph_coverage_warnings(args)
    spec = getattr(args, "speculative_algorithm", None)
    if s.draft_kv_dtype is not None and not spec:
        warnings.append(f"{settings.BY_ATTR['draft_kv_cache_dtype'].flag} {s.draft_kv_cache_dtype} has no effect "
                        "without --speculative-algorithm")
    errors += draft_kv_dtype(args, s)[1]
    errors += draft_shape.server_problems(args, s, compat.version())
    warnings += draft_shape.server_warnings(args, s, compat.version())
    if s.feature_dir:
        from sglang_ext.serving import feature_capture

        try:
            feature_capture.check_server(args)
        except ConfigError as e:
            errors.append(e)
    return errors, warnings


def validate(args, record=None) -> None:
    """Refuse the server (one ConfigError with every problem) or log the warnings; runs once per launch. `args`: the
    resolved server args; `record`: the ServerArgs they were read from, where that is another object (0.5.21+)."""
    s = settings.current()  # an unknown option value is refused here
    errors = hooks.missing_symbols(s)
    found, warnings = option_problems(args, s, record)
    errors += found
    found, more = pair_problems(args, s)
    errors += found
    for w in warnings + more:
        logger.warning("[sglang_ext] %s", w)
    if errors:
        raise combined(errors)


def post_init_after(result, self, *args, **kwargs):
    validate(self)
    return result


CHECKED = "_sglang_ext_checked"  # resolution bookkeeping on the record (0.5.21+ lets an underscore name be set)


def resolve_once_after(result, self, *args, **kwargs):
    if getattr(self, CHECKED, False):  # resolved before (it returns early then), or a child process's copy
        return result
    setattr(self, CHECKED, True)
    validate(compat.resolved(self), record=self)
    return result


HOOKS = (
    Hook(compat.STARTUP_SYMBOL_LEGACY, "after", post_init_after, releases=hooks.releases(until="0.5.20"), gate=True,
         feature="the startup check"),
    Hook(compat.STARTUP_SYMBOL, "after", resolve_once_after, releases=hooks.releases(since="0.5.21"), gate=True,
         feature="the startup check"),
)
