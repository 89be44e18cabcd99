"""The hooks the plugin puts on SGLang, declared as data: each serving module lists its own in ``HOOKS``, one `Hook`
per upstream symbol (the symbol, the kind of hook, the function, the SGLang releases it is written for, and when
it applies), and the plugin registers them all in one loop (sglang_ext.plugin). docs/design.md has the inventory.

SGLang's ``HookRegistry.apply_hooks`` logs and skips a target it cannot resolve, and its plugin loader swallows an
exception from ``register()``: either would turn a feature off silently. So `missing_symbols` is also run by the
startup check (serving/startup.py), which refuses to start when a hooked symbol is not there, naming the SGLang
release and the symbol.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Callable

from sglang_ext.errors import ConfigError
from sglang_ext.settings import Settings

SUPPORTED_RELEASES = ("0.5.17",)  # SGLang releases the adapters are written for (and tested on)


@dataclasses.dataclass(frozen=True)
class Hook:
    target: str  # dotted path of the upstream function or method
    kind: str  # "around" (fn(original, *args)), "before" (fn(*args)), "after" (fn(result, *args))
    fn: Callable
    releases: tuple[str, ...] = SUPPORTED_RELEASES  # SGLang releases this hook is written for
    when: Callable[[Settings], bool] | None = None  # registered only where this holds (opt-in features)
    feature: str = ""  # what breaks without it (named when its symbol is missing)
    option: str = ""  # with `when`: the option that turns it on, as users write it

    def applies(self, settings: Settings) -> bool:
        return self.when is None or bool(self.when(settings))


def modules():
    """The serving modules that declare hooks, in registration order."""
    from sglang_ext.serving import (acceptance, adaptive, aux_capture, decode_depth0, feature_capture, flags, fp32,
                                    kv_pools, mla_verify, registry, startup)

    return (flags, startup, aux_capture, registry, kv_pools, acceptance, fp32, adaptive, decode_depth0, mla_verify,
            feature_capture)


def all_hooks() -> list[Hook]:
    return [h for m in modules() for h in m.HOOKS]


def active_hooks(settings: Settings) -> list[Hook]:
    return [h for h in all_hooks() if h.applies(settings)]


def register(settings: Settings) -> list[Hook]:
    """Register every hook that applies with SGLang's HookRegistry; returns them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = {"around": HookType.AROUND, "before": HookType.BEFORE, "after": HookType.AFTER}
    hooks = active_hooks(settings)
    for h in hooks:
        HookRegistry.register(h.target, h.fn, kinds[h.kind])
    return hooks


def sglang_version() -> str:
    try:
        from sglang.version import __version__

        return __version__
    except Exception:  # noqa: BLE001 -- an SGLang without a version module
        return "?"


def resolves(target: str) -> bool:
    module_path, attr = target.rsplit(".", 1)
    try:
        obj = pkgutil.resolve_name(module_path)
    except (ImportError, AttributeError, ValueError):
        return False
    return hasattr(obj, attr)


def applied(target: str) -> bool:
    """Whether SGLang's HookRegistry patched `target` in this process (it logs and skips one it cannot resolve)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    patched = getattr(HookRegistry, "_patched", None)
    return target in patched if isinstance(patched, set) else resolves(target)


def missing_symbols(settings: Settings, is_applied: Callable[[str], bool] = applied) -> list[ConfigError]:
    """The active hooks SGLang could not apply (their upstream symbol is not there), or that are not written for
    this release."""
    version = sglang_version()
    errors = []
    for h in active_hooks(settings):
        if not is_applied(h.target):
            errors.append(ConfigError("sglang", version, f"has no {h.target}, which the plugin hooks for "
                                      f"{h.feature or h.fn.__name__} (written for SGLang {', '.join(h.releases)})",
                                      f"install a supported SGLang release ({', '.join(SUPPORTED_RELEASES)}), or "
                                      "SGLANG_PLUGINS=<other plugins> to run upstream SGLang without this plugin"))
        elif version not in h.releases:
            errors.append(ConfigError("sglang", version, f"is not a release the plugin's hook on {h.target} is "
                                      f"written for ({', '.join(h.releases)})",
                                      f"install a supported SGLang release ({', '.join(SUPPORTED_RELEASES)})"))
    return errors


def import_target_module(target: str):
    """The module a target lives in (tests import it to check every table names a real symbol)."""
    return importlib.import_module(target.rsplit(".", 2)[0])


def inventory_markdown() -> str:
    """The table of every hooked upstream symbol (docs/design.md carries it; a test keeps the two equal)."""
    rows = ["| upstream symbol (SGLang) | hook | module | releases | registered | what it is for |",
            "|---|---|---|---|---|---|"]
    for m in modules():
        for h in m.HOOKS:
            when = "always" if h.when is None else f"with {h.option}"
            rows.append(f"| `{h.target.removeprefix('sglang.srt.')}` | {h.kind} | `{m.__name__.rsplit('.', 1)[1]}` | "
                        f"{', '.join(h.releases)} | {when} | {h.feature} |")
    return "\n".join(rows)
