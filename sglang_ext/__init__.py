"""sglang-eagle3-mla: Eagle3 speculative decoding for MLA targets on SGLang 0.5.17.

Importing this package is cheap: it imports neither SGLang nor torch. The SGLang plugin
(`sglang_ext.plugin.register`, entry point group ``sglang.srt.plugins``) imports lazily.
"""

__version__ = "0.1.0"
PLUGIN_NAME = "sglang_eagle3_mla"  # the entry point name: SGLANG_PLUGINS=<names> whitelists plugins
