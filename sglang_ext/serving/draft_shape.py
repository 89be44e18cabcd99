"""A draft tree among the cost policy's shapes: one server started as a tree drafts, per batch size, with that tree,
a chain depth or not at all, whichever measured step times and acceptance say pays (core.adaptive.ShapePolicy).

Opt-in and experimental: ``--speculative-adaptive --speculative-adaptive-policy cost --speculative-adaptive-shapes
tree`` on a server started as the tree (e.g. ``--speculative-eagle-topk 4 --speculative-num-steps 3
--speculative-num-draft-tokens 8``), SGLang 0.5.17 or 0.5.23, FA3. SGLang's adaptive mode is chain-only: it swaps
prebuilt runtime states keyed by the step count and turns itself off for topk != 1. The server starts as the tree
because what is sized once, from the startup settings, must hold the widest shape: the per-step KV reserve (2 x
max(topk x steps, draft tokens): a tree of 12 scratch slots covers chains to depth 11, a chain start leaves a tree
short), the logits rows of the verify graphs, and the overlap scheduler's draft-input buffers (sized from the first
payload). Every draft extend therefore emits the tree's topk width; a chain drafts from its first column (the top-1
candidate: the width is sorted).

Extends, SGLang 0.5.17 and 0.5.23 (registered only with the option; the functions below are the same in both, but
for 0.5.23's resolution: the tree's draft tokens are declared, not assigned, and topk is read from ``get_spec()``
alone, so the context is the one store overridden there):
  * ``adaptive_spec_params.adaptive_unsupported_reason`` (AROUND) -- the topk refusal is dropped; the others stay.
  * ``adaptive_spec_params.resolve_candidate_steps_from_config`` (AROUND) -- the union of steps that sizes buffers
    also holds the tree's draft tokens - 1, so ``ServerArgs.max_speculative_num_draft_tokens`` is the tree's.
  * ``arg_groups.speculative_hook._init_adaptive_speculative_params`` (AROUND) -- the tree's draft tokens are kept
    (upstream sets steps + 1).
  * ``AdaptiveController.init_states`` (AROUND) -- the startup state is kept as the tree's (key TREE_KEY), every
    candidate depth is built as a chain and every batch-size slot starts on the tree.
  * ``AdaptiveController._activate`` and ``activate_step_by_batch`` (AROUND) -- the tree's key, and the active key
    compared instead of the worker's step count (the tree and chain 3 both draft 3 steps).
  * ``EAGLEWorkerV2._override_worker_state`` (AROUND) -- a chain state's backends and graphs are built at topk 1:
    in ServerArgs (FA3's backend, the draft and verify graph runners read it there), the runtime context (Triton
    reads it there) and both workers.
  * ``EAGLEWorkerV2.apply_runtime_state`` (AROUND) -- the state's topk on the target worker (verify, the trivial
    verify of depth 0, idle inputs); upstream's early return on equal step counts bypassed.
  * ``EAGLEWorkerV2._stub_skipped_draft_extend`` (AROUND) -- depth 0's stub for a skipped draft extend has the
    tree's width too.
  * ``EagleDraftWorkerBase._rebuild_topk1_chain_buffers`` (AROUND) -- the chain buffers are built at topk 1 for a
    chain state, left as they are for the tree's (upstream: only where the startup topk is 1).
  * ``EagleDraftWorker.draft`` (AROUND) -- a chain state drafts at topk 1 from the draft input's first column.
  * ``mem_cache.allocation_sizing.get_alloc_len_per_decode`` (AROUND, 0.5.23) -- the KV a request may allocate per
    decode step stays the tree's: 0.5.23 reads it per batch from the context, where a chain state's step count
    with the tree's topk would reserve less (depth 0, 1) or more than the request rows hold (depth 5 and up).
"""

from __future__ import annotations

import contextlib
import logging

from sglang_ext import settings
from sglang_ext.core.adaptive import DraftShape
from sglang_ext.errors import ConfigError
from sglang_ext.serving import adaptive, compat, hooks
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)

OPTION = settings.BY_ATTR["adaptive_shapes"]
ON = f"{OPTION.flag} tree"
TREE_KEY = -1  # the tree's key among the adaptive states (chains are keyed by their depth, 0 and up)
TOPK_ATTR = "_sglang_ext_topk"  # a runtime state's topk (upstream's SpecRuntimeState has no field for it)
# the releases whose adaptive controller, state build and switch the hooks were read against and CPU-tested with
# (tests/serving/test_draft_shape.py runs SGLang's own objects); 0.5.18 - 0.5.22 were not read
RELEASES = ("0.5.17", "0.5.23")
GPU_CHECKED = ("0.5.17",)  # greedy-exact on FA3 in deterministic mode (docs/results.md); the others warn at startup
BACKENDS = ("fa3",)


def requested(s: settings.Settings) -> bool:
    return adaptive.requested(s) and s.adaptive_shapes == "tree"


def enabled() -> bool:
    return requested(settings.current())


def tree_of(args) -> DraftShape | None:
    """The tree a server was started as; None for a chain (topk 1 or unset)."""
    topk = int(getattr(args, "speculative_eagle_topk", None) or 1)
    steps, tokens = getattr(args, "speculative_num_steps", None), getattr(args, "speculative_num_draft_tokens", None)
    if topk <= 1 or steps is None or tokens is None:
        return None
    return DraftShape(topk, int(steps), int(tokens))


def shape_of(draft_tokens: int | None, tree: DraftShape | None) -> DraftShape | None:
    """What a verify result ran, from its draft-token count (a chain of depth k verifies k + 1)."""
    if draft_tokens is None:
        return None
    if tree is not None and int(draft_tokens) == tree.draft_tokens:
        return tree
    return DraftShape.chain(int(draft_tokens) - 1)


def key_of(shape: DraftShape) -> int:
    return shape.steps if shape.is_chain else TREE_KEY


# ------------------------------------------------------------------------------------------------- startup
def server_problems(args, s: settings.Settings, version: str) -> list[ConfigError]:
    """Where the tree shape cannot run as asked: refused at startup, naming the option and the alternative."""
    if s.adaptive_shapes != "tree":
        return []
    label, errors = OPTION.label, []
    if version not in RELEASES:
        errors.append(ConfigError(label, "tree", f"is built against SGLang {hooks.describe(RELEASES)}'s adaptive "
                                  f"runtime states, not {version}'s", f"use SGLang {hooks.describe(RELEASES)}, or "
                                  f"{OPTION.flag} chain"))
    if not adaptive.requested(s) or not getattr(args, "speculative_adaptive", False):
        errors.append(ConfigError(label, "tree", "chooses shapes inside the cost policy",
                                  "add --speculative-adaptive --speculative-adaptive-policy cost"))
    try:
        tree = tree_of(args)
    except ValueError as e:
        return errors + [ConfigError("--speculative-num-draft-tokens", getattr(args, "speculative_num_draft_tokens",
                                                                              None), str(e), "give a valid tree")]
    if tree is None:
        errors.append(ConfigError("--speculative-eagle-topk", getattr(args, "speculative_eagle_topk", None),
                                  f"is 1 or unset: {OPTION.flag} tree needs the server started as the tree, whose "
                                  "sizes (KV reserve per step, verify rows) cover the chains",
                                  "start it as the tree, e.g. --speculative-eagle-topk 4 --speculative-num-steps 3 "
                                  "--speculative-num-draft-tokens 8"))
        return errors
    backend = getattr(args, "decode_attention_backend", None) or getattr(args, "attention_backend", None)
    draft_backend = getattr(args, "speculative_draft_attention_backend", None) or backend
    checked = [("--attention-backend", backend)] + \
        ([("--speculative-draft-attention-backend", draft_backend)] if draft_backend != backend else [])
    for name, value in checked:
        if value not in BACKENDS:
            errors.append(ConfigError(name, value, f"is not one {OPTION.flag} tree is built for "
                                      f"({', '.join(BACKENDS)}: each runtime state reads its topk when built)",
                                      f"use --attention-backend fa3, or {OPTION.flag} chain"))
    if int(getattr(args, "page_size", None) or 1) != 1:
        errors.append(ConfigError("--page-size", args.page_size, f"is not 1: {OPTION.flag} tree keeps the chains' "
                                  "KV inside the tree's reserve only at page size 1", "use --page-size 1"))
    # upstream's other refusals of adaptive mode come after its topk one, which the tree shape lifts: asked here
    view = compat.resolved(args)
    for field, why in (("enable_dp_attention", "adaptive decisions are not synchronized across DP ranks"),
                       ("enable_multi_layer_eagle", "its worker has no adaptive mode"),
                       ("enable_two_batch_overlap", "a state switch would drop its attention wrapper"),
                       ("enable_pdmux", "a state switch would not update its backend group")):
        if getattr(view, field, False):
            errors.append(ConfigError(f"--{field.replace('_', '-')}", True, f"is not served with {OPTION.flag} "
                                      f"tree ({why})", f"drop it, or {OPTION.flag} chain"))
    pp = int(getattr(view, "pp_size", None) or 1)
    if pp > 1:  # the controller lives on the last stage only: the others would keep the tree's settings
        errors.append(ConfigError("--pp-size", pp, f"is not served with {OPTION.flag} tree (the adaptive controller "
                                  "switches the last pipeline stage only)", f"use --pp-size 1, or {OPTION.flag} chain"))
    depths = candidate_depths(getattr(args, "speculative_adaptive_config", None))
    if depths and tree.steps not in depths:
        errors.append(ConfigError("--speculative-num-steps", tree.steps, f"is not a depth of the adaptive config "
                                  f"({depths}): the tree's steps must be one", "start the tree at one of them"))
    clash = [k for k in depths if k + 1 == tree.draft_tokens]
    if clash:
        errors.append(ConfigError("--speculative-adaptive-config", getattr(args, "speculative_adaptive_config", None),
                                  f"offers depth {clash[0]}, which verifies as many tokens as the tree "
                                  f"{tree.text}: a result could not say which ran", "drop that depth"))
    return errors


def server_warnings(args, s: settings.Settings, version: str) -> list[str]:
    """What a server asked for the tree shape should know at startup: a release it was not checked on a GPU with."""
    if s.adaptive_shapes != "tree" or version not in RELEASES or version in GPU_CHECKED:
        return []
    return [f"{ON} on SGLang {version}: its hooks pass the CPU tests against this release's adaptive controller, "
            f"but its greedy equality on a GPU was checked on {', '.join(GPU_CHECKED)} only (experimental; "
            f"{OPTION.flag} chain is the checked path here)"]


def candidate_depths(cfg_path) -> list[int]:
    """The chain depths the adaptive config offers (the cost policy's default where none is given)."""
    if cfg_path is None:
        return list(adaptive.DEFAULT_CANDIDATES)
    try:
        from sglang.srt.speculative.adaptive_spec_params import _load_adaptive_config

        _, entries = _load_adaptive_config(cfg_path)
    except Exception:  # noqa: BLE001 -- an unreadable config: SGLang's own validation names it
        return []
    return sorted({int(k) for e in entries.values() for k in e["candidate_steps"]})


def unsupported_reason(original_fn, server_args, *args, **kwargs):
    reason = original_fn(server_args, *args, **kwargs)
    if reason and reason.startswith("speculative_eagle_topk=") and enabled():
        return None
    return reason


def candidate_steps(original_fn, *args, **kwargs):
    steps = original_fn(*args, **kwargs)
    tree = startup_tree() if enabled() else None
    return steps if tree is None else sorted(set(steps) | {tree.draft_tokens - 1})  # buffers sized for the tree


STARTUP_TREE: dict = {}  # "tree": the tree this process's server was started as; "alloc_len": derived from it


def set_startup_tree(tree: DraftShape | None) -> None:
    STARTUP_TREE.clear()  # with what was derived from the previous one (the KV length per decode step)
    STARTUP_TREE["tree"] = tree


def startup_tree() -> DraftShape | None:
    """The tree this server was started as: set while its options resolve (the launching process) or its adaptive
    states are built; elsewhere (a scheduler process sizing its buffers first) read from its server args."""
    if "tree" not in STARTUP_TREE:
        try:
            from sglang.srt.server_args import get_global_server_args

            return tree_of(get_global_server_args())
        except Exception:  # noqa: BLE001 -- not set in this process yet
            return None
    return STARTUP_TREE["tree"]


def init_params(original_fn, server_args, *args, **kwargs):
    if not enabled():
        return original_fn(server_args, *args, **kwargs)
    tree = tree_of(compat.resolved(server_args))
    set_startup_tree(tree)
    result = original_fn(server_args, *args, **kwargs)
    if tree is not None:  # upstream sets steps + 1 (a chain's); keep the tree's
        compat.declare(server_args, "sglang_ext.draft_shape", speculative_num_draft_tokens=tree.draft_tokens)
    return result


# ------------------------------------------------------------------------------------------------ controller
def init_states(original_fn, self, *args, **kwargs):
    worker = self.worker
    if not enabled() or (getattr(worker, "topk", 1) or 1) <= 1:
        return original_fn(self, *args, **kwargs)
    tree = DraftShape(int(worker.topk), int(worker.speculative_num_steps), int(worker.speculative_num_draft_tokens))
    set_startup_tree(tree)
    state = self._states.pop(tree.steps)  # the startup state, registered under its step count
    setattr(state, TOPK_ATTR, tree.topk)
    self._sglang_ext_tree_state = worker._sglang_ext_tree_state = state
    original_fn(self, *args, **kwargs)  # builds every candidate depth as a chain, activates one
    for slot in self.params._slots.values():
        slot.current_steps = TREE_KEY
    self._activate(TREE_KEY)
    logger.info("[sglang_ext] adaptive shapes: %s and depths %s", tree.label, self.candidate_steps)


def activate(original_fn, self, key, *args, **kwargs):
    tree_state = getattr(self, "_sglang_ext_tree_state", None)
    if tree_state is None:
        return original_fn(self, key, *args, **kwargs)
    state = tree_state if key == TREE_KEY else self._states.get(key)
    if state is None:
        return original_fn(self, key, *args, **kwargs)  # upstream's error for a key without a state
    self.worker.apply_runtime_state(state)
    self._sglang_ext_active = key


def activate_by_batch(original_fn, self, batch_size, *args, **kwargs):
    if getattr(self, "_sglang_ext_tree_state", None) is None:
        return original_fn(self, batch_size, *args, **kwargs)
    key = self.params.get_steps_for_batch(batch_size)
    if key != getattr(self, "_sglang_ext_active", None):
        self._activate(key)


# ---------------------------------------------------------------------------------------------------- worker
def _server_args_objects(worker) -> list:
    found = {}
    for obj in (getattr(worker, "server_args", None),
                getattr(getattr(getattr(worker, "_target_worker", None), "model_runner", None), "server_args", None),
                getattr(getattr(getattr(worker, "_draft_worker", None), "draft_runner", None), "server_args", None)):
        if obj is not None:
            found[id(obj)] = obj
    return list(found.values())


def _set_server_topk(obj, topk: int) -> None:
    if hasattr(obj, "override"):
        obj.override("sglang_ext.draft_shape", speculative_eagle_topk=topk)
    else:
        obj.speculative_eagle_topk = topk


@contextlib.contextmanager
def built_at_topk(worker, topk: int):
    """Every store a runtime state's backends and graphs read topk from, at `topk` while it is built."""
    from sglang.srt.runtime_context import get_context

    dw = worker._draft_worker
    # 0.5.17 - 0.5.20: FA3's backend and the graph runners read server_args.speculative_eagle_topk. 0.5.21+: they
    # read get_spec(), and the record is sealed after resolution (assigning raises): the context alone
    objs = [] if compat.at_least("0.5.21") else _server_args_objects(worker)
    saved = (worker.topk, dw.topk, [o.speculative_eagle_topk for o in objs])
    worker.topk = dw.topk = topk
    for o in objs:
        _set_server_topk(o, topk)
    get_context().override("sglang_ext.draft_shape", speculative_eagle_topk=topk)
    try:
        yield
    finally:
        worker.topk, dw.topk = saved[0], saved[1]
        for o, value in zip(objs, saved[2]):
            _set_server_topk(o, value)
        get_context().override("sglang_ext.draft_shape", speculative_eagle_topk=saved[1])


@contextlib.contextmanager
def override_worker_state(original_fn, self, speculative_num_steps, speculative_num_draft_tokens, *args, **kwargs):
    """Upstream's override of the worker's settings while it builds a runtime state, at topk 1 for a chain's."""
    chain = enabled() and (getattr(self, "topk", 1) or 1) > 1 and \
        speculative_num_draft_tokens == speculative_num_steps + 1
    with built_at_topk(self, 1) if chain else contextlib.nullcontext():
        with original_fn(self, speculative_num_steps, speculative_num_draft_tokens, *args, **kwargs):
            yield


def apply_state(original_fn, self, state, *args, **kwargs):
    if not enabled() or getattr(self, "_sglang_ext_tree_state", None) is None:
        return original_fn(self, state, *args, **kwargs)
    topk = getattr(state, TOPK_ATTR, 1)  # the tree's is marked; every state built since is a chain
    if getattr(self, "_sglang_ext_state", None) is state:
        return None
    before = getattr(self, "_sglang_ext_shape", None)
    if self.speculative_num_steps == state.speculative_num_steps:
        self.speculative_num_steps = -1  # upstream returns early on equal step counts: a tree and chain 3 have 3
    self._draft_worker._sglang_ext_draft_topk = topk  # before upstream's chain-buffer rebuild reads it
    original_fn(self, state, *args, **kwargs)
    self.topk = topk
    self._sglang_ext_state = state
    self._sglang_ext_shape = DraftShape(topk, state.speculative_num_steps, state.speculative_num_draft_tokens)
    if before is not None:
        adaptive._log(f"[sglang_ext] adaptive shape: {before.label} -> {self._sglang_ext_shape.label}")
    return None


def rebuild_chain_buffers(original_fn, self, *args, **kwargs):
    """Upstream rebuilds the topk-1 chain buffers only where the draft worker's topk is 1, and asserts steps + 1 draft
    tokens. Under a tree server the worker keeps the tree's topk: the buffers are built at topk 1 whenever the
    settings being applied are a chain's (a chain state built or applied), and skipped for the tree's."""
    if not enabled():
        return original_fn(self, *args, **kwargs)
    if self.speculative_num_draft_tokens != self.speculative_num_steps + 1:
        return None  # the tree's settings: no chain buffers (upstream's no-op for topk > 1)
    saved, self.topk = self.topk, 1
    try:
        return original_fn(self, *args, **kwargs)
    finally:
        self.topk = saved


def draft(original_fn, self, batch, *args, **kwargs):
    topk = getattr(self, "_sglang_ext_draft_topk", None)
    if topk is None or topk == self.topk:
        return original_fn(self, batch, *args, **kwargs)
    spec = batch.spec_info
    saved = (self.topk, spec.topk_p, spec.topk_index)
    self.topk = topk
    if spec.topk_p is not None and spec.topk_p.shape[-1] > topk:  # the tree's width; sorted, column 0 is the top-1
        spec.topk_p = spec.topk_p[:, :topk].contiguous()
        spec.topk_index = spec.topk_index[:, :topk].contiguous()
    try:
        return original_fn(self, batch, *args, **kwargs)
    finally:
        self.topk, spec.topk_p, spec.topk_index = saved


def stub_draft_extend(original_fn, self, *args, **kwargs):
    """A skipped draft extend's zero stub (depth 0) at the draft input's one width, the tree's, as a real draft extend
    emits: a chain state's topk-1 stub would not concatenate with other requests' inputs outside the overlap
    scheduler, and would fill its buffers by broadcast inside it."""
    widest = getattr(self._draft_worker, "topk", None)
    if getattr(self, "_sglang_ext_tree_state", None) is None or widest is None or widest == self.topk:
        return original_fn(self, *args, **kwargs)
    saved, self.topk = self.topk, widest
    try:
        return original_fn(self, *args, **kwargs)
    finally:
        self.topk = saved


def alloc_len_per_decode(original_fn, *args, **kwargs):
    """The KV one request may allocate in a decode step, at the tree's size whichever state runs. 0.5.17 computes it
    from the startup server args; 0.5.23 reads the runtime context on every decode batch, where a switch moves the
    step count while topk stays the tree's: depth 1 would reserve 2 x 8 and depth 5 2 x 20, and a reserve taken under
    one state is spent by the next (the overlap scheduler), so the startup tree's is kept (2 x 12 here: chains to
    depth 11 fit inside it, and the request rows are sized for it)."""
    kept = STARTUP_TREE.get("alloc_len")  # per decode batch: computed once, after the states are built
    if kept is not None:
        return kept
    n = original_fn(*args, **kwargs)
    tree = STARTUP_TREE.get("tree")
    if tree is None or n <= 1:  # not a tree server's scheduler yet, or no speculation
        return n
    from sglang.srt.runtime_context import max_speculative_num_draft_tokens

    kept = STARTUP_TREE["alloc_len"] = max(tree.topk * tree.steps, tree.draft_tokens,
                                           max_speculative_num_draft_tokens() or 0)
    return kept


PARAMS = "sglang.srt.speculative.adaptive_spec_params"
CONTROLLER = "sglang.srt.speculative.adaptive_runtime_state.AdaptiveController"
WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
DRAFT_WORKER = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
BASE_DRAFT_WORKER = "sglang.srt.speculative.base_spec_worker.EagleDraftWorkerBase"


def _hook(target: str, fn, feature: str) -> Hook:
    return Hook(target, "around", fn, releases=RELEASES, when=requested, option=ON, feature=feature)


HOOKS = (
    _hook(f"{PARAMS}.adaptive_unsupported_reason", unsupported_reason, "adaptive speculation on a tree server"),
    _hook(f"{PARAMS}.resolve_candidate_steps_from_config", candidate_steps, "buffers sized for the tree"),
    _hook("sglang.srt.arg_groups.speculative_hook._init_adaptive_speculative_params", init_params,
          "the tree's draft tokens kept at startup"),
    _hook(f"{CONTROLLER}.init_states", init_states, "the tree and chain runtime states"),
    _hook(f"{CONTROLLER}._activate", activate, "switching to the tree"),
    _hook(f"{CONTROLLER}.activate_step_by_batch", activate_by_batch, "switching to the tree"),
    _hook(f"{WORKER}._override_worker_state", override_worker_state, "chain states built at topk 1"),
    _hook(f"{WORKER}.apply_runtime_state", apply_state, "switching between the tree and chains"),
    _hook(f"{WORKER}._stub_skipped_draft_extend", stub_draft_extend, "one draft-input width at depth 0"),
    _hook(f"{BASE_DRAFT_WORKER}._rebuild_topk1_chain_buffers", rebuild_chain_buffers, "chain buffers per state"),
    _hook(f"{DRAFT_WORKER}.draft", draft, "chains drafted from the tree's draft input"),
    Hook("sglang.srt.mem_cache.allocation_sizing.get_alloc_len_per_decode", "around", alloc_len_per_decode,
         releases=("0.5.23",), when=requested, option=ON, feature="the tree's KV reserve per decode step"),
)
