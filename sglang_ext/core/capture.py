"""Aux hidden-state capture from any transformers causal LM, by forward hooks on its decoder
layers (Llama, DeepseekV3ForCausalLM, and VL wrappers whose text model is nested, e.g. Kimi-K2.5).

Layer ids are physical output ids (sglang_ext.config.aux_layers): the hook on decoder layer j records
its output, i.e. the residual stream after layer j -- what SGLang captures as the input of layer
j + 1, and for the last layer the pre-final-norm state.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn


def text_config_of(model) -> object:
    cfg = model.config
    for attr in ("text_config", "language_config"):
        sub = getattr(cfg, attr, None)
        if sub is not None and getattr(sub, "num_hidden_layers", None):
            return sub
    return cfg


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a (possibly wrapped) causal LM: the ModuleList named `layers`
    whose length is the text config's num_hidden_layers (the language model's, not a vision tower's)."""
    n = text_config_of(model).num_hidden_layers
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and name.split(".")[-1] == "layers" and len(m) == n]
    if not found:
        raise ValueError(f"{type(model).__name__}: no `layers` ModuleList of length {n}; "
                         "pass a transformers causal LM (or a VL wrapper of one)")
    found.sort(key=lambda x: ("language" not in x[0] and "text" not in x[0], len(x[0])))
    return found[0][1]


class AuxCapture:
    """Records the outputs of decoder layers `output_ids` during each forward pass."""

    def __init__(self, model: nn.Module, output_ids: Sequence[int]):
        self.output_ids = list(output_ids)
        layers = decoder_layers(model)
        bad = [j for j in self.output_ids if not 0 <= j < len(layers)]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range for {len(layers)} decoder layers")
        self.states: dict[int, torch.Tensor] = {}
        self._handles = [layers[j].register_forward_hook(self._hook(j)) for j in self.output_ids]

    def _hook(self, j):
        def hook(_module, _args, output):
            self.states[j] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def concat(self) -> torch.Tensor:
        """[B, T, len(ids) * hidden], layer order = id order (as every engine concatenates)."""
        return torch.cat([self.states[j] for j in self.output_ids], dim=-1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@contextlib.contextmanager
def capture_aux(model: nn.Module, output_ids: Sequence[int]) -> Iterator[AuxCapture]:
    cap = AuxCapture(model, output_ids)
    try:
        yield cap
    finally:
        cap.remove()
