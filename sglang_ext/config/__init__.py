"""What a draft and a target are, in pure Python (no torch, no SGLang): the typed draft config, the target's config,
the aux-layer resolver, the weight map, KV pool arithmetic and the pair checks. Documented in docs/conventions.md."""

from sglang_ext.config.aux_layers import AuxLayerPlan, resolve, resolve_with_errors
from sglang_ext.config.draft import Eagle3DraftConfig
from sglang_ext.config.target import TargetConfig
from sglang_ext.config.weights import WeightMap, weight_map

__all__ = ["AuxLayerPlan", "Eagle3DraftConfig", "TargetConfig", "WeightMap", "resolve", "resolve_with_errors",
           "weight_map"]
