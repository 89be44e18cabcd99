"""The SGLang plugin entry point (group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` runs ``register()`` in every process that builds or serves a model
(launch_server, Engine, each scheduler subprocess), then applies the hooks registered here with
``HookRegistry.apply_hooks()``. Set ``SGLANG_PLUGINS`` to a list that omits ``sglang_eagle3_mla``
to run upstream SGLang unchanged.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_ext.serving import aux_capture

    for target, family in aux_capture.HOOK_TARGETS.items():
        HookRegistry.register(target, aux_capture.make_hook(family), HookType.AROUND)
    logger.info("[sglang_ext] plugin registered: Eagle3 aux-layer capture for %s",
                ", ".join(t.rsplit(".", 2)[-2] for t in aux_capture.HOOK_TARGETS))
