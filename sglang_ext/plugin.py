"""The SGLang plugin entry point (group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` runs ``register()`` in every process that builds or serves a model (launch_server,
Engine, each scheduler subprocess), then applies the hooks registered here with ``HookRegistry.apply_hooks()``.
Each serving module declares its hooks (serving/hooks.py); the opt-in ones are registered only when their option
asks for them, so a server that does not pays nothing for them. ``SGLANG_PLUGINS`` set to a list that omits
``sglang_eagle3_mla`` runs upstream SGLang unchanged.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    from sglang_ext import settings
    from sglang_ext.serving import acceptance, hooks

    registered = hooks.register(settings.requested())  # never raises: the startup check refuses a bad value
    if not hooks.supported():  # only the startup check is registered: it refuses the server, naming the range
        logger.warning("[sglang_ext] SGLang %s is not a release the plugin supports (%s)", hooks.sglang_version(),
                       hooks.describe(hooks.SUPPORTED_RELEASES))
    acceptance.install_log_filter()
    logger.info("[sglang_ext] plugin registered: %d hooks on SGLang %s (%s)", len(registered), hooks.sglang_version(),
                ", ".join(sorted({h.feature for h in registered if h.feature})))
