"""The SGLang plugin entry point (group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` runs ``register()`` in every process that builds or serves a model
(launch_server, Engine, each scheduler subprocess), then applies the hooks registered here with
``HookRegistry.apply_hooks()``. Set ``SGLANG_PLUGINS`` to a list that omits ``sglang_eagle3_mla``
to run upstream SGLang unchanged. Each adapter module names the upstream symbols it extends.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_ext.serving import (acceptance, adaptive, aux_capture, decode_depth0, feature_capture, fp32, kv_pools,
                                    mla_verify, registry)

    for target, family in aux_capture.HOOK_TARGETS.items():
        HookRegistry.register(target, aux_capture.make_hook(family), HookType.AROUND)
    groups = [(registry.HOOKS, HookType.AROUND), (kv_pools.HOOKS, HookType.AROUND),
              (kv_pools.AFTER_HOOKS, HookType.AFTER), (acceptance.AROUND_HOOKS, HookType.AROUND),
              (acceptance.AFTER_HOOKS, HookType.AFTER), (fp32.AROUND_HOOKS, HookType.AROUND)]
    if adaptive.requested():  # opt-in: no per-step cost for servers that do not ask for it
        groups += [(adaptive.AROUND_HOOKS, HookType.AROUND), (adaptive.BEFORE_HOOKS, HookType.BEFORE),
                   (adaptive.AFTER_HOOKS, HookType.AFTER), (decode_depth0.AROUND_HOOKS, HookType.AROUND)]
    if mla_verify.requested():  # MLA chain verify as decode attention, unless SGLANG_EXT_MLA_VERIFY=extend
        groups += [(mla_verify.AFTER_HOOKS, HookType.AFTER), (mla_verify.AROUND_HOOKS, HookType.AROUND)]
    if feature_capture.directory():  # a feature server for draft training (training.features)
        groups += [(feature_capture.AFTER_HOOKS, HookType.AFTER)]
    for hooks, kind in groups:
        for target, fn in hooks.items():
            HookRegistry.register(target, fn, kind)
    acceptance.install_log_filter()
    logger.info("[sglang_ext] plugin registered: Eagle3 aux-layer capture, MLA head architectures, draft KV "
                "pool sizing and dtype, acceptance reporting without the bonus token, cost-model adaptive speculation "
                "(opt-in; depth 0 as a plain decode step), MLA verify as decode attention (chains by default; "
                "SGLANG_EXT_MLA_VERIFY), fp32 MLA targets")
