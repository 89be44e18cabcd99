"""The hooks the plugin puts on SGLang, declared as data: each serving module lists its own in ``HOOKS``, one `Hook`
per upstream symbol (the symbol, the kind of hook, the function, the SGLang releases it applies to, and when it
applies), and the plugin registers them all in one loop (sglang_ext.plugin). docs/design.md has the inventory.

The plugin supports the SGLang releases of SUPPORTED_RELEASES. Only the hooks whose releases include the running
SGLang are registered and checked (a symbol that moved between releases has one Hook per spelling); on a release
outside the range only the startup check is registered, and it refuses the server, naming the release and the
range. The release-dependent lookups of the adapters themselves are in serving/compat.py.

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
from sglang_ext.serving import compat
from sglang_ext.settings import Settings

# SGLang releases the plugin supports (CI tests 0.5.17; each Hook names the ones it applies to)
SUPPORTED_RELEASES = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


def releases(since: str = SUPPORTED_RELEASES[0], until: str = SUPPORTED_RELEASES[-1]) -> tuple[str, ...]:
    """The supported releases from `since` to `until`, both included."""
    lo, hi = compat.parse(since), compat.parse(until)
    return tuple(r for r in SUPPORTED_RELEASES if lo <= compat.parse(r) <= hi)


def describe(rels: tuple[str, ...]) -> str:
    """A list of releases as people read it: "0.5.17 - 0.5.20" for a run of consecutive supported releases."""
    if len(rels) > 2 and rels[0] in SUPPORTED_RELEASES and \
            rels == SUPPORTED_RELEASES[SUPPORTED_RELEASES.index(rels[0]):][:len(rels)]:
        return f"{rels[0]} - {rels[-1]}"
    return ", ".join(rels)


def supported(version: str | None = None) -> bool:
    """Whether an SGLang release (default: the running one) is one the plugin supports."""
    v = compat.parse(compat.version() if version is None else version)
    return v is not None and str(v) in SUPPORTED_RELEASES


@dataclasses.dataclass(frozen=True)
class Hook:
    target: str  # dotted path of the upstream function or method
    kind: str  # "around" (fn(original, *args)), "before" (fn(*args)), "after" (fn(result, *args))
    fn: Callable
    releases: tuple[str, ...] = SUPPORTED_RELEASES  # the SGLang releases it applies to (registered and checked on)
    when: Callable[[Settings], bool] | None = None  # registered only where this holds (opt-in features)
    feature: str = ""  # what breaks without it (named when its symbol is missing)
    option: str = ""  # with `when`: the option that turns it on, as users write it
    gate: bool = False  # the startup check: also registered on a release outside the range, which it refuses

    def applies(self, settings: Settings) -> bool:
        return self.when is None or bool(self.when(settings))

    def covers(self, version: str | None = None) -> bool:
        """Whether this hook applies to an SGLang release (default: the running one)."""
        v = compat.parse(compat.version() if version is None else version)
        return v is not None and str(v) in self.releases


def modules():
    """The serving modules that declare hooks, in registration order."""
    from sglang_ext.serving import (acceptance, adaptive, aux_capture, decode_depth0, draft_prefill, draft_shape,
                                    fa3_verify, feature_capture, flags, fp32, kv_pools, memory, mla_verify,
                                    prefix_cache, registry, startup)

    return (flags, startup, aux_capture, registry, kv_pools, acceptance, fp32, adaptive, decode_depth0, draft_shape,
            mla_verify, fa3_verify, draft_prefill, feature_capture, memory, prefix_cache)


def all_hooks() -> list[Hook]:
    return [h for m in modules() for h in m.HOOKS]


def release_hooks(version: str | None = None) -> list[Hook]:
    """The hooks for an SGLang release (default: the running one); outside the range, the startup check alone."""
    if not supported(version):
        return [h for h in all_hooks() if h.gate]
    return [h for h in all_hooks() if h.covers(version)]


def active_hooks(settings: Settings, version: str | None = None) -> list[Hook]:
    return [h for h in release_hooks(version) if h.applies(settings)]


def register(settings: Settings) -> list[Hook]:
    """Register every hook that applies (to these settings and this SGLang release) with SGLang's HookRegistry;
    returns them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = {"around": HookType.AROUND, "before": HookType.BEFORE, "after": HookType.AFTER}
    hooks = active_hooks(settings)
    for h in hooks:
        HookRegistry.register(h.target, h.fn, kinds[h.kind])
    return hooks


def sglang_version() -> str:
    return compat.version()


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
    """A running SGLang outside the supported releases, or the active hooks for it that SGLang could not apply
    (their upstream symbol is not there)."""
    version = sglang_version()
    fix = f"install a supported SGLang release ({describe(SUPPORTED_RELEASES)})"
    if not supported(version):
        return [ConfigError("sglang", version, f"is not a release the plugin supports ({describe(SUPPORTED_RELEASES)})",
                            f"{fix}, or SGLANG_PLUGINS=<other plugins> to run upstream SGLang without this plugin")]
    errors = []
    for h in active_hooks(settings, version):
        if not is_applied(h.target):
            errors.append(ConfigError("sglang", version, f"has no {h.target}, which the plugin hooks for "
                                      f"{h.feature or h.fn.__name__} (on SGLang {describe(h.releases)})",
                                      f"{fix}, or SGLANG_PLUGINS=<other plugins> to run upstream SGLang without "
                                      "this plugin"))
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
                        f"{describe(h.releases)} | {when} | {h.feature} |")
    return "\n".join(rows)
