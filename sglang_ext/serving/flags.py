"""The plugin's options as flags of SGLang's server parser, and their values in /get_server_info.

  * ``sglang.srt.server_args.ServerArgs.add_cli_args`` (AFTER) -- every parser SGLang builds (``launch_server``,
    ``sglang serve``, ``--config`` merging) grows the options of sglang_ext.settings in a group of their own, so
    ``--help`` lists them and a ``--config`` YAML file may set them. Parsing a flag writes its environment variable
    (``ServerArgs`` keeps only its own fields; the scheduler processes inherit the environment). A flag the parser
    already has (a later SGLang release's own: ``--speculative-draft-kv-cache-dtype`` from 0.5.18) is left to SGLang;
    its help names the plugin's variable, and the plugin reads SGLang's value (compat.draft_kv_dtype).
  * ``sglang.srt.managers.scheduler.Scheduler.get_internal_state`` (AFTER) -- the values in effect, as
    ``internal_states[0].sglang_ext_settings`` of ``/get_server_info``.
"""

from __future__ import annotations

import argparse

from sglang_ext import settings
from sglang_ext.errors import ConfigError
from sglang_ext.serving import compat
from sglang_ext.serving.hooks import Hook


class _ExportAction(argparse._StoreAction):  # SGLang's --config merger takes store and store_true actions only
    """Stores the value and writes it to the option's environment variable."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        settings.export(self.dest.removeprefix("sglang_ext_"), values)


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """Add the options the parser lacks; returns the flags added."""
    have = getattr(parser, "_option_string_actions", {})
    for o in settings.OPTIONS:
        theirs = have.get(o.flag)
        if theirs is not None and not isinstance(theirs, _ExportAction) and theirs.help != argparse.SUPPRESS \
                and o.env not in (theirs.help or ""):
            theirs.help = f"{theirs.help or ''} [sglang-eagle3-mla reads it too; env {o.env}]".lstrip()
    todo = [o for o in settings.OPTIONS if o.flag not in have]
    if not todo:
        return []
    group = parser.add_argument_group("sglang-eagle3-mla plugin (Eagle3 for MLA targets; each flag also reads "
                                      "its environment variable)")
    for o in todo:
        group.add_argument(o.flag, dest=f"sglang_ext_{o.attr}", action=_ExportAction, default=None,
                           choices=list(o.choices) if o.choices else None, metavar=o.metavar,
                           help=f"{o.help} [env {o.env}]")
    return [o.flag for o in todo]


def after_add_cli_args(result, *args, **kwargs):
    for candidate in (*args, *kwargs.values()):
        if isinstance(candidate, argparse.ArgumentParser):
            add_arguments(candidate)
            break
    return result


def internal_state_after(result, self, *args, **kwargs):
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        current = settings.current().to_dict()
        try:  # SGLang 0.5.18+: its own --speculative-draft-kv-cache-dtype where our variable is unset
            current["draft_kv_cache_dtype"] = compat.draft_kv_dtype() or current["draft_kv_cache_dtype"]
        except ConfigError:  # contradicting values: refused at startup
            pass
        state["sglang_ext_settings"] = current
    return result


HOOKS = (
    Hook("sglang.srt.server_args.ServerArgs.add_cli_args", "after", after_add_cli_args, feature="the plugin's flags"),
    Hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "after", internal_state_after,
         feature="the settings in /get_server_info"),
)
