"""Every lookup of the plugin that depends on the SGLang release, in one place (SGLang 0.5.17 - 0.5.23).

The serving modules ask this module instead of branching on the release themselves; each function says which
releases each of its branches is for. Releases compare as `packaging.version` of ``sglang.version.__version__``
(its base version: ``0.5.21.post1`` is 0.5.21). Where nothing is installed, or a version cannot be read, the newest
branch is taken: the startup check refuses such a server anyway (serving/hooks.py). 0.5.19, 0.5.20 and 0.5.22 were
not read release by release: their branches are those of the nearest release before them that was (0.5.18, 0.5.21),
and where a later release moved something, the lookup also tries the other spelling.

Nothing here imports SGLang at module level (``import sglang_ext.plugin`` stays light).
"""

from __future__ import annotations

import functools

from packaging.version import InvalidVersion, Version


# ------------------------------------------------------------------------------------------------- the release
def version() -> str:
    """The running SGLang's version string ("?" without one)."""
    try:
        from sglang.version import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001 -- no SGLang, or one without a version module
        return "?"


@functools.lru_cache(maxsize=32)
def parse(text: str) -> Version | None:
    """A release as a comparable version (post/dev/local parts dropped), None if it is not one."""
    try:
        return Version(Version(text).base_version)
    except InvalidVersion:
        return None


def running() -> Version | None:
    return parse(version())


def at_least(release: str) -> bool:
    """The running SGLang is `release` or later (True when its version cannot be read: the newest branch)."""
    now = running()
    return now is None or now >= parse(release)


# ------------------------------------------------------------------------------------------------- server args
def resolved(args):
    """A ServerArgs as resolution left it, for reading.
    0.5.17 - 0.5.20: the record itself (resolution writes its fields, in ``__post_init__``).
    0.5.21+: the record is the operator's raw input; resolution's decisions are declarations on it, which
    ``resolving_view`` reads through (they travel with the record to the scheduler processes)."""
    if args is None or not at_least("0.5.21"):
        return args
    try:
        from sglang.srt.arg_groups.model_override_base import ResolvingConfig, resolving_view
    except ImportError:
        return args
    return args if isinstance(args, ResolvingConfig) else resolving_view(args)


def declare(args, source: str, **fields) -> None:
    """Set fields of a ServerArgs while its options resolve.
    0.5.17 - 0.5.20: assigned (resolution writes the record).
    0.5.21+: ``arg_groups.overrides.declare_resolution`` (the record is the operator's input, and assigning to it
    during resolution raises): a declaration with its source, which `resolved` reads through."""
    if at_least("0.5.21"):
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(args, source, **fields)
        return
    for name, value in fields.items():
        setattr(args, name, value)


def server_args():
    """This process's server arguments, as resolved; None outside a server (a bare model in a test).
    0.5.17 - 0.5.20: ``server_args.get_global_server_args()``.
    0.5.21+: that accessor is retired (it raises); ``runtime_context.get_server_args()`` (the raw record, published
    in every server process) read through `resolved`."""
    try:
        if at_least("0.5.21"):
            from sglang.srt.runtime_context import get_server_args

            return resolved(get_server_args())
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:  # noqa: BLE001 -- no server context
        return None


STARTUP_SYMBOL_LEGACY = "sglang.srt.server_args.ServerArgs.__post_init__"  # 0.5.17 - 0.5.20: resolution runs there
# 0.5.21+: ServerArgs is a msgspec Struct whose __post_init__ is empty (and bound when the class is built, so a hook
# on it never runs); launchers and every process that publishes its config call resolve_once
STARTUP_SYMBOL = "sglang.srt.server_args.ServerArgs.resolve_once"


def spec_num_steps(args=None) -> int | None:
    """The draft depth (speculative_num_steps) in effect, None if unknown.
    0.5.17 - 0.5.20: the (resolved) record's field.
    0.5.21+: the record keeps the operator's input (None when SGLang chose the depth): the resolved ``spec``
    namespace (``runtime_context.get_spec()``), else the record read through `resolved`."""
    steps = _published_spec_field("speculative_num_steps")
    if steps is None:
        steps = getattr(resolved(server_args() if args is None else args), "speculative_num_steps", None)
    return int(steps) if steps is not None else None


def attention_dp_size(args) -> int:
    """Attention data-parallel groups the TP ranks are split into (1: none), from resolved server args.
    0.5.17 - 0.5.22: ``--enable-dp-attention`` with ``--dp-size``.
    0.5.23: a field of its own, ``--attn-dp-size`` (``--dp-size N --enable-dp-attention`` is its deprecated
    spelling, resolved into it); where a record has both, a width > 1 there wins."""
    if at_least("0.5.21"):  # 0.5.21 - 0.5.22 hold no such field on the record: the legacy spelling below
        width = getattr(args, "attn_dp_size", None)
        if isinstance(width, int) and width > 1:
            return width
    if getattr(args, "enable_dp_attention", False):
        return max(1, int(getattr(args, "dp_size", 1) or 1))
    return 1


def adaptive_unsupported_reason(args) -> str | None:
    """Why SGLang turns ``--speculative-adaptive`` off on this server (it then serves its fixed draft shape and logs a
    warning), None where adaptive speculation runs. SGLang's own answer,
    ``speculative.adaptive_spec_params.adaptive_unsupported_reason`` (0.5.17 - 0.5.23: EAGLE/EAGLE3 only, topk 1,
    no attention DP, no multi-layer EAGLE, no two-batch overlap, no PD multiplexing), asked of the operator's record
    (0.5.21+: the raw record, which it reads through its own views). Where that cannot be asked (a record SGLang did
    not build), the two reasons a DeepseekV3 server meets: a draft tree, attention DP."""
    try:
        from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason as upstream

        return upstream(args)
    except Exception:  # noqa: BLE001 -- no such function in this release, or not a ServerArgs record
        pass
    view = resolved(args)
    topk = getattr(view, "speculative_eagle_topk", None)
    if topk is not None and int(topk) != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    if attention_dp_size(view) > 1:
        return "attention DP is not supported (adaptive tier decisions are not synchronized across DP ranks)"
    return None


def decode_graph_batch_sizes(args) -> list[int] | None:
    """The decode batch sizes SGLang captures CUDA graphs for, as resolved (None: decode graphs off, or not known).
    0.5.17 - 0.5.23: ``cuda_graph_config.decode`` (``bs``, ``backend``) of the resolved args (0.5.21+: a
    declaration, read through `resolved`), filled from --cuda-graph-bs-decode, --cuda-graph-max-bs-decode or the
    default for the GPU's memory."""
    decode = getattr(getattr(resolved(args), "cuda_graph_config", None), "decode", None)
    sizes = getattr(decode, "bs", None)
    if not sizes or str(getattr(decode, "backend", "")).lower().endswith("disabled"):
        return None
    return sorted(int(b) for b in sizes)


# ------------------------------------------------------------------------------------------------- draft KV dtype
UPSTREAM_DRAFT_KV_FIELD = "speculative_draft_kv_cache_dtype"


def upstream_draft_kv_cache_dtype(args=None) -> str | None:
    """SGLang's own ``--speculative-draft-kv-cache-dtype`` as the server was given it (None: not given / auto).
    0.5.17: there is none (the plugin's flag of that name is the only one): None.
    0.5.18 - 0.5.20: a ServerArgs field (``server_args.speculative_draft_kv_cache_dtype``).
    0.5.21+: a ``spec`` namespace field (``get_spec().speculative_draft_kv_cache_dtype``; on the record too).
    `args`: the server args to read (the startup check's); default: this process's."""
    if not at_least("0.5.18"):
        return None
    value = _published_spec_field(UPSTREAM_DRAFT_KV_FIELD) if args is None else None
    if value is None:
        value = getattr(resolved(args if args is not None else server_args()), UPSTREAM_DRAFT_KV_FIELD, None)
    if value is None or str(value).strip().lower() in ("", "auto"):
        return None
    return str(value)


def _published_spec_field(name: str):
    """0.5.21+: a field of the resolved ``spec`` namespace this process published; None before 0.5.21 or unpublished."""
    if not at_least("0.5.21"):
        return None
    try:
        from sglang.srt.runtime_context import get_spec

        return getattr(get_spec(), name, None)
    except Exception:  # noqa: BLE001 -- not published in this process
        return None


def draft_kv_dtype(s=None, args=None) -> str | None:
    """The draft's KV cache dtype (None: the target's): the plugin's option where its variable is set, else (0.5.18+)
    SGLang's own flag of the same name; the variable naming another dtype than that flag is refused (ConfigError).
    On 0.5.17 the plugin's option alone."""
    from sglang_ext import settings
    from sglang_ext.config.kv import effective_draft_kv_dtype

    s = settings.current() if s is None else s
    return effective_draft_kv_dtype(s.draft_kv_dtype, upstream_draft_kv_cache_dtype(args))


# ------------------------------------------------------------------------------------------------- moved symbols
def create_flashinfer_kv_indices_triton():
    """SGLang's Triton kernel that fills flashinfer-style KV index lists from req_to_token.
    0.5.17 - 0.5.21: ``sglang.kernels.ops.kvcache.kv_indices``.
    0.5.23: moved to ``sglang.kernels.ops.attention.kv_indices`` (0.5.22: whichever is there)."""
    return _moved("create_flashinfer_kv_indices_triton", "sglang.kernels.ops.kvcache.kv_indices",
                  "sglang.kernels.ops.attention.kv_indices", since="0.5.22")


def _moved(name: str, old_module: str, new_module: str, since: str):
    """`name` from the module it lives in on the running release (`new_module` from `since` on), else from the other
    one (a release between those read)."""
    import importlib

    paths = [new_module, old_module] if at_least(since) else [old_module, new_module]
    try:
        return getattr(importlib.import_module(paths[0]), name)
    except ModuleNotFoundError:
        return getattr(importlib.import_module(paths[1]), name)


def same_ranks_as(layer) -> dict:
    """Keyword arguments that put a new ``ColumnParallelLinear`` on the ranks of an existing one, `layer` (the MLA
    head's wider ``q_proj`` replaces upstream's, serving/mla_head.py).
    0.5.17 - 0.5.22: ``tp_rank=`` / ``tp_size=``, which the layer keeps as attributes.
    0.5.23: those are gone; a layer names its group (``parallel_group=``, kept as ``layer.parallel_group``; upstream's
    MLA ``q_proj`` is on ``"attn_tp"``). Chosen by the constructor's parameters, so a release between follows it."""
    import inspect

    from sglang.srt.layers.linear import ColumnParallelLinear

    params = inspect.signature(ColumnParallelLinear.__init__).parameters
    if "parallel_group" in params:
        return {"parallel_group": getattr(layer, "parallel_group", None) or "attn_tp"}
    return {"tp_rank": layer.tp_rank, "tp_size": layer.tp_size}


def draft_tp_context(draft_worker):
    """The context a draft worker's forward runs in (its own TP group under DP attention), as upstream enters it.
    0.5.17 - 0.5.20: ``draft_worker.draft_tp_context(draft_worker.draft_runner.tp_group)`` (an attribute: a
    no-op context without DP attention).
    0.5.21 - 0.5.22: the same attribute, which then also takes ``owns_attention``.
    0.5.23: the attribute is gone: ``spec_utils.draft_tp_context(draft_worker.parallel_layout)``."""
    if at_least("0.5.23") or (at_least("0.5.22") and not hasattr(draft_worker, "draft_tp_context")):
        from sglang.srt.speculative.spec_utils import draft_tp_context as enter

        return enter(draft_worker.parallel_layout)
    if at_least("0.5.21"):
        return draft_worker.draft_tp_context(draft_worker.draft_runner.tp_group,
                                             owns_attention=draft_worker.draft_owns_attention)
    return draft_worker.draft_tp_context(draft_worker.draft_runner.tp_group)


# ------------------------------------------------------------------------------------------------- attention backend
def translates_kv_loc(backend) -> bool:
    """Whether an attention backend reads its KV through a translated (unified-memory) pool.
    0.5.17 - 0.5.20: ``backend._translate_kv_loc`` is set.
    0.5.21+: that attribute is gone: ``backend.kv_index_translator.is_translating``."""
    if at_least("0.5.21"):
        translator = getattr(backend, "kv_index_translator", None)
        return bool(getattr(translator, "is_translating", False)) or \
            getattr(backend, "_translate_kv_loc", None) is not None
    return getattr(backend, "_translate_kv_loc", None) is not None


def verify_tokens_per_req(backend, spec) -> int:
    """Tokens per request of a target-verify batch, as the backend lays it out.
    0.5.17 - 0.5.20: the verify input's ``draft_token_num`` (else the backend's ``num_draft_tokens``).
    0.5.21+: upstream's own ``TritonAttnBackend._target_verify_num_tokens_per_req(spec)`` (the input's
    ``num_tokens_per_req`` where set, else the captured width)."""
    if at_least("0.5.21"):
        width = getattr(backend, "_target_verify_num_tokens_per_req", None)
        if width is not None and spec is not None and hasattr(spec, "num_tokens_per_req"):
            return int(width(spec))
    n = getattr(spec, "draft_token_num", None) if spec is not None else None
    return int(n) if n is not None else int(backend.num_draft_tokens)


# ------------------------------------------------------------------------------------------------- KV pools
def fused_draft_entry_bytes(kvc) -> int | None:
    """Bytes per token of a target pool entry that also holds the draft's KV (a unified-memory / fused layout),
    which upstream sizes itself; None where the draft has a pool of its own.
    0.5.17 - 0.5.22: there is no fused layout: None.
    0.5.23: ``KVCacheConfigurator.fused_entry_bytes("full")``."""
    if not at_least("0.5.23"):
        return None
    entry = getattr(kvc, "fused_entry_bytes", None)
    value = entry("full") if callable(entry) else None
    return None if value is None else int(value)


def draft_loc_space_scale() -> int:
    """How many target token slots each draft pool slot stands for.
    0.5.17 - 0.5.22: 1.
    0.5.23: under HiSparse the draft pool is indexed by host-expanded ids: the host-to-device ratio."""
    if not at_least("0.5.23"):
        return 1
    try:
        from sglang.srt.runtime_context import get_memory

        if not get_memory().enable_hisparse:
            return 1
        from sglang.srt.mem_cache.sparsity import parse_hisparse_config

        return int(parse_hisparse_config().host_to_device_ratio)
    except Exception:  # noqa: BLE001 -- not published (a test): no HiSparse
        return 1


def draft_attn_tp_size(kvc) -> int:
    """Ranks the draft's attention heads are split over.
    0.5.17 - 0.5.22: the target's attention TP (``get_parallel().attn_tp_size``).
    0.5.23: the draft may run on a group of its own (``KVCacheConfigurator.draft_attn_tp_size``)."""
    if at_least("0.5.23"):
        size = getattr(kvc, "draft_attn_tp_size", None)
        if isinstance(size, int) and size > 0:
            return size
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_size


def fixed_pool_overhead_bytes(configurator) -> int:
    """Bytes upstream reserves beside the pools before sizing them in tokens.
    0.5.17 - 0.5.22: none. 0.5.23: ``DefaultPoolConfigurator._fixed_overhead_bytes`` (page-shard scratch)."""
    return int(getattr(configurator, "_fixed_overhead_bytes", 0) or 0) if at_least("0.5.23") else 0


# ------------------------------------------------------------------------------------------------- tests' lookups
def config_argument_merger():
    """SGLang's ``--config`` YAML merger class.
    0.5.17 - 0.5.20: ``sglang.srt.server_args_config_parser``.
    0.5.21+: moved to ``sglang.srt.utils.server_args_config_parser``."""
    return _moved("ConfigArgumentMerger", "sglang.srt.server_args_config_parser",
                  "sglang.srt.utils.server_args_config_parser", since="0.5.21")
