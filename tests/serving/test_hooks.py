"""The hook tables: every serving module declares its hooks as data, each hook for the installed SGLang names an
upstream symbol it has, the opt-in ones are registered only with their option, and a release outside the supported
range is refused."""

import pytest

from sglang_ext import settings
from sglang_ext.serving import hooks

pytest.importorskip("sglang")


def test_every_declared_hook_names_a_real_sglang_symbol():
    seen = set()
    for h in hooks.all_hooks():
        assert h.kind in ("around", "before", "after"), h
        assert h.feature, f"{h.target}: say what breaks without it"
        assert (h.target, h.kind, h.fn) not in seen, f"{h.target} declared twice"
        seen.add((h.target, h.kind, h.fn))
        assert h.releases and set(h.releases) <= set(hooks.SUPPORTED_RELEASES), h
    assert hooks.supported(), f"SGLang {hooks.sglang_version()} is not in {hooks.SUPPORTED_RELEASES}"
    for h in hooks.release_hooks():  # the hooks for the installed release
        assert hooks.resolves(h.target), f"{h.target} is not in this SGLang"
        assert h.covers(hooks.sglang_version())


def test_each_release_gets_one_startup_check_and_an_unsupported_one_is_refused(monkeypatch):
    from sglang_ext.serving import compat, startup

    for release in hooks.SUPPORTED_RELEASES:
        gates = [h.target.rsplit(".", 1)[1] for h in hooks.release_hooks(release) if h.gate]
        assert gates == (["__post_init__"] if compat.parse(release) <= compat.parse("0.5.20") else ["resolve_once"])
        everywhere = [h for h in hooks.release_hooks(release) if h.releases == hooks.SUPPORTED_RELEASES]
        assert len(everywhere) == len([h for h in hooks.all_hooks() if h.releases == hooks.SUPPORTED_RELEASES])
        assert all(h.covers(release) for h in hooks.release_hooks(release))
    # outside the range: only the startup check (whichever spelling the release has), which refuses the server
    assert {h.fn for h in hooks.release_hooks("0.5.24")} == {h.fn for h in startup.HOOKS}
    assert hooks.supported("0.5.23.post1") and not hooks.supported("0.5.16") and not hooks.supported("?")
    monkeypatch.setattr(compat, "version", lambda: "0.5.24")
    (e,) = hooks.missing_symbols(settings.Settings(), is_applied=lambda target: True)
    assert e.field == "sglang" and e.value == "0.5.24" and "0.5.17 - 0.5.23" in e.problem


@pytest.mark.parametrize("options,extra", [
    ({}, set()),
    ({"adaptive_policy": "cost"}, {"AdaptiveStepSlot.update", "build_adaptive_runtime_state",
                                   "DecodeCudaGraphRunner.__init__"}),
    ({"adaptive_policy": "cost", "adaptive_depth0": "verify"}, {"AdaptiveStepSlot.update"}),
    ({"feature_dir": "/tmp/f"}, {"ModelRunner.load_model"}),
])
def test_opt_in_hooks_follow_their_options(options, extra):
    base = {h.target for h in hooks.active_hooks(settings.Settings())}
    active = {h.target for h in hooks.active_hooks(settings.Settings(**options))}
    added = {t for t in active - base}
    assert all(any(t.endswith(e) for t in added) for e in extra), (added, extra)
    if not options:  # by default: no per-step cost of the opt-in features
        assert not any("adaptive" in t or "load_model" in t for t in active)
        assert any(t.endswith("TritonAttnBackend.forward_extend") for t in active)  # MLA verify: on by default
    assert not any(t.endswith("TritonAttnBackend.forward_extend")
                   for t in {h.target for h in hooks.active_hooks(settings.Settings(mla_verify="extend"))})


def test_every_serving_module_with_a_hook_is_registered():
    import pkgutil

    import sglang_ext.serving as serving

    declared = {m.__name__.rsplit(".", 1)[1] for m in hooks.modules()}
    for info in pkgutil.iter_modules(serving.__path__):
        src = open(f"{serving.__path__[0]}/{info.name}.py").read()
        if "\nHOOKS = (" in src:
            assert info.name in declared, f"serving/{info.name}.py declares hooks the plugin does not register"


def test_the_design_docs_inventory_is_the_code_s():
    """docs/design.md's table of hooked symbols is generated from the hook tables; regenerate it when they change:
    .venv/bin/python -c 'from sglang_ext.serving import hooks; print(hooks.inventory_markdown())'"""
    import os

    from conftest import REPO

    text = open(os.path.join(REPO, "docs", "design.md")).read()
    start, end = "<!-- hook inventory: generated -->\n", "\n<!-- end of the hook inventory -->"
    assert text[text.index(start) + len(start): text.index(end)] == hooks.inventory_markdown()
