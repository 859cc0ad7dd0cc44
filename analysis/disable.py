"""Per-head gates for transformers 5 encoders: disable heads without ``head_mask`` (which transformers 5 dropped).

Two modes, one gate value ``g`` per head (1 = untouched, 0 = disabled; values in between interpolate):

- ``uniform`` (Kovaleva et al.): the head's attention row becomes ``g * softmax + (1 - g) * 1/n`` over the
  ``n`` real (non-padding) keys, so a disabled head outputs the mean of V over the real tokens.
- ``zero`` (Michel et al.): the head's context output is multiplied by ``g`` (a gate with a gradient
  gives Michel's head importance).

The mechanism is an attention function registered with ``transformers.AttentionInterface`` (plus the eager
mask function under the same name); gates are looked up by the calling module, so a layer without gates
runs exactly the eager computation. MPNet computes attention in its own code (``MPNetSelfAttention`` with a
relative position bias), so :func:`gated` replaces that module's ``forward`` on the instance with the same
computation plus the gates; a module without gates calls the original ``forward``. This file keeps the three
parts apart: MASK (which heads are off: pure functions building ``keep`` arrays), COMPUTE (the gated attention) and
INSTALL (switching a model to the gated attention and attaching gates to its layers).

Shapes: ``L`` layers, ``H`` heads, ``N`` rows of a batch, ``Q``/``K`` query/key length, ``d`` head size.
"""
from __future__ import annotations

import math
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from analysis.errors import AttnpatError, check_choice

MODES = ("uniform", "zero")
ATTENTION_NAME = "attnpat_gated"

# Encoder families whose every layer owns a self-attention module that calls the AttentionInterface.
INTERFACE_TYPES = {"bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert"}
# Encoder families whose self-attention computes attention itself: gated by replacing that module's forward.
PATCHED_TYPES = {"mpnet"}
GATED_TYPES = INTERFACE_TYPES | PATCHED_TYPES
# Why the other families the foundation loads cannot be gated per head.
UNSUPPORTED_REASONS = {
    "albert": "ALBERT shares one attention module across all layers, so a head cannot be gated in one layer only",
    "deberta": "DeBERTa computes disentangled attention in its own code, not through the AttentionInterface",
    "deberta-v2": "DeBERTa-v2 computes disentangled attention in its own code, not through the AttentionInterface",
}


# ---------------------------------------------------------------- MASK: which heads are disabled

def check_mode(mode: str) -> str:
    return check_choice(mode, MODES, "disabling mode")


def keep_mask(num_layers: int, num_heads: int, disabled: Iterable[tuple[int, int]] = ()) -> np.ndarray:
    """(L, H) float array: 1 keeps a head, 0 disables it. ``disabled``: (layer, head) pairs, 0-indexed."""
    keep = np.ones((num_layers, num_heads), dtype=np.float32)
    for layer, head in disabled:
        if not (0 <= layer < num_layers and 0 <= head < num_heads):
            raise AttnpatError(f"head ({layer}, {head}) is outside a model of {num_layers} layers x {num_heads} heads")
        keep[layer, head] = 0.0
    return keep


def layer_keep_mask(num_layers: int, num_heads: int, layer: int) -> np.ndarray:
    """(L, H): every head of ``layer`` disabled."""
    return keep_mask(num_layers, num_heads, [(layer, head) for head in range(num_heads)])


def first_changed_layer(keep: np.ndarray) -> int:
    """The lowest layer with a gate below 1 (L when nothing is disabled): layers below it are unchanged."""
    changed = np.flatnonzero((np.asarray(keep) < 1).any(axis=1))
    return int(changed[0]) if changed.size else int(np.asarray(keep).shape[0])


def stacked_gates(keeps: np.ndarray, rows_per_variant: int) -> dict[int, torch.Tensor]:
    """Gates for variants stacked along the batch: keeps (V, L, H) -> {layer: (V * rows_per_variant, H)}.

    Row ``v * rows_per_variant + b`` is example b under variant v. Layers where every variant keeps every
    head get no entry, so they run the exact eager computation.
    """
    keeps = np.asarray(keeps, dtype=np.float32)
    gates = {}
    for layer in range(keeps.shape[1]):
        if (keeps[:, layer] < 1).any():
            gates[layer] = torch.from_numpy(np.repeat(keeps[:, layer], rows_per_variant, axis=0))
    return gates


def mask_gates(keep: np.ndarray) -> dict[int, torch.Tensor]:
    """Gates of one variant for every row of a batch: keep (L, H) -> {layer: (H,)} for the changed layers."""
    keep = np.asarray(keep, dtype=np.float32)
    return {layer: torch.from_numpy(keep[layer].copy()) for layer in range(keep.shape[0]) if (keep[layer] < 1).any()}


# ---------------------------------------------------------------- COMPUTE: gated attention

def real_keys(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(N|1, 1, Q|1, K) bool: which keys are real tokens, from the additive (0 / dtype-min) or bool mask."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def uniform_weights(attention_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Rows of 1/n over the n real keys, broadcastable to ``like`` (N, H, Q, K)."""
    key_length = like.shape[-1]
    real = real_keys(attention_mask)
    if real is None:
        return torch.full((1, 1, 1, key_length), 1.0 / key_length, dtype=like.dtype, device=like.device)
    real = real.to(like.dtype)
    return real / real.sum(-1, keepdim=True).clamp(min=1.0)


def _gate_view(gate: torch.Tensor, rows: int, heads: int, like: torch.Tensor) -> torch.Tensor:
    """(H,) or (N, H) gate -> (1|N, H, 1, 1) on ``like``'s device and dtype."""
    gate = gate.to(device=like.device, dtype=like.dtype)
    if gate.shape == (heads,):
        return gate.reshape(1, heads, 1, 1)
    if gate.shape == (rows, heads):
        return gate.reshape(rows, heads, 1, 1)
    raise AttnpatError(f"head gates of shape {tuple(gate.shape)} do not fit a batch of {rows} rows x {heads} heads")


def gated_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with optional per-head gates (the function registered as ``attnpat_gated``).

    query, key, value: (N, H, Q|K, d); attention_mask: additive (N, 1, Q, K) or None.
    Returns (context (N, Q, H, d), weights (N, H, Q, K)), like transformers' eager_attention_forward;
    without gates for ``module`` the operations are exactly the eager ones.
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1)
    gating = _GATES.get(module)
    weights = gate_weights(gating, weights, attention_mask)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    context = gate_context(gating, torch.matmul(weights, value))
    return context.transpose(1, 2).contiguous(), weights


def gate_weights(gating: _Gate | None, weights: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Uniform-mode gates on attention weights (N, H, Q, K): ``g * softmax + (1 - g) / n_real``; else unchanged."""
    gate = None if gating is None else gating.of("uniform")
    if gate is None:
        return weights
    gate = _gate_view(gate, weights.shape[0], weights.shape[1], weights)
    return gate * weights + (1 - gate) * uniform_weights(attention_mask, weights)


def gate_context(gating: _Gate | None, context: torch.Tensor) -> torch.Tensor:
    """Zero-mode gates on the per-head context (N, H, Q, d): multiplied by ``g``; else unchanged."""
    gate = None if gating is None else gating.of("zero")
    if gate is None:
        return context
    return context * _gate_view(gate, context.shape[0], context.shape[1], context)


def gated_mpnet_forward(module: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        position_bias: torch.Tensor | None = None, output_attentions: bool = False, **kwargs):
    """``MPNetSelfAttention.forward`` with per-head gates (installed on each instance by :func:`gated`).

    hidden_states: (N, Q, D); attention_mask: additive (N, 1, Q, K) or None; position_bias: (N, H, Q, K).
    Without gates for ``module`` it is the original forward itself, so the results are bit-identical; with
    gates it repeats transformers' computation step by step and gates weights or context like
    :func:`gated_attention_forward`.
    """
    gating = _GATES.get(module)
    if gating is None:
        return type(module).forward(module, hidden_states, attention_mask, position_bias,
                                    output_attentions=output_attentions, **kwargs)
    hidden_shape = (*hidden_states.shape[:-1], -1, module.attention_head_size)
    q = module.q(hidden_states).view(hidden_shape).transpose(1, 2)
    k = module.k(hidden_states).view(hidden_shape).transpose(1, 2)
    v = module.v(hidden_states).view(hidden_shape).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(module.attention_head_size)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = gate_weights(gating, nn.functional.softmax(scores, dim=-1), attention_mask)
    weights = module.dropout(weights)
    context = gate_context(gating, torch.matmul(weights, v))
    context = context.permute(0, 2, 1, 3).contiguous().view(*hidden_states.shape[:-1], module.all_head_size)
    output = module.o(context)
    return (output, weights) if output_attentions else (output,)


# ---------------------------------------------------------------- INSTALL: attach gates to a model

class _Gate:
    """A module's gate of one mode; ``outer`` is the gate an enclosing :func:`head_gates` block attached, so
    gates of both modes can apply at once (importance under uniform pruning: pruned heads uniform, a zero-mode
    gradient gate on every head)."""

    __slots__ = ("gate", "mode", "outer")

    def __init__(self, gate: torch.Tensor, mode: str, outer: _Gate | None = None):
        self.gate, self.mode, self.outer = gate, mode, outer

    def of(self, mode: str) -> torch.Tensor | None:
        """The innermost gate of ``mode`` on the module, or None."""
        gating = self
        while gating is not None and gating.mode != mode:
            gating = gating.outer
        return None if gating is None else gating.gate


# Gate of each module inside a gated layer (keyed weakly: a freed model leaves nothing behind).
_GATES: weakref.WeakKeyDictionary[nn.Module, _Gate] = weakref.WeakKeyDictionary()
_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    AttentionInterface.register(ATTENTION_NAME, gated_attention_forward)
    # Mask creation looks the implementation name up too; the gated attention takes eager's additive mask.
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    _REGISTERED = True


def check_supported(model: nn.Module, verb: str | None = None) -> None:
    """Raise a clear AttnpatError when per-head gates cannot work for this architecture. ``verb``: the command
    that needs the gates (disable, importance, prune), named in the message; the gates serve all three, so the
    message names the gating, not one verb's use of it."""
    model_type = getattr(model.config, "model_type", "?")
    needs = f"{verb} needs head gating, which is" if verb else "head gating is"
    if model_type in UNSUPPORTED_REASONS:
        raise AttnpatError(f"{needs} not supported for {model_type} models: {UNSUPPORTED_REASONS[model_type]}")
    if model_type not in GATED_TYPES:
        raise AttnpatError(f"{needs} not supported for {model_type} models "
                           f"(supported: {', '.join(sorted(GATED_TYPES))})")


def layer_container(model: nn.Module) -> nn.Module:
    """The module holding the ``layer`` ModuleList (BertEncoder, DistilBERT's Transformer...)."""
    check_supported(model)
    base = model.base_model
    for name in ("encoder", "transformer"):
        container = getattr(base, name, None)
        if isinstance(getattr(container, "layer", None), nn.ModuleList):
            return container
    raise AttnpatError(f"cannot find the encoder layers of a {type(model).__name__}")


def encoder_layers(model: nn.Module) -> list[nn.Module]:
    """The encoder's layer modules, in order (read through ``layer_container``)."""
    return list(layer_container(model).layer)


def _self_attention_modules(model: nn.Module) -> list[nn.Module]:
    """MPNet's self-attention modules (the ones that compute attention weights), in layer order."""
    return [layer.attention.attn for layer in encoder_layers(model)]


@contextmanager
def _patched_self_attention(model: nn.Module) -> Iterator[None]:
    """Give each MPNet self-attention module the gated forward for the block (nested blocks patch once)."""
    patched = []
    for module in _self_attention_modules(model):
        if "forward" not in vars(module):
            module.forward = types.MethodType(gated_mpnet_forward, module)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


@contextmanager
def gated(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with gated attention (exactly eager while no gates are attached): the registered
    attention function, or for MPNet its self-attention's gated forward."""
    check_supported(model)
    if model.config.model_type in PATCHED_TYPES:
        if model.config._attn_implementation != "eager":
            raise AttnpatError(f"head gating needs eager attention; the model uses "
                               f"'{model.config._attn_implementation}' (load it with analysis.models.load_model)")
        with _patched_self_attention(model):
            yield
        return
    _register()
    previous = model.config._attn_implementation
    if previous != "eager" and previous != ATTENTION_NAME:
        raise AttnpatError(f"head gating needs eager attention; the model uses '{previous}' "
                           "(load it with analysis.models.load_model)")
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def head_gates(model: nn.Module, gates: Mapping[int, torch.Tensor], mode: str) -> Iterator[None]:
    """Attach gates {layer: (H,) or (N, H)} to the model's layers for the duration of the block.

    The model must be inside :func:`gated`. Gates may require grad (head importance). Blocks nest: a gate of
    the other mode from an enclosing block still applies, one of the same mode is replaced for the block.
    """
    check_mode(mode)
    layers = encoder_layers(model)
    heads = int(model.config.num_attention_heads)
    attached = []
    try:
        for layer, gate in gates.items():
            if not 0 <= layer < len(layers):
                raise AttnpatError(f"layer {layer} is outside a model of {len(layers)} layers")
            if gate.shape[-1] != heads or gate.dim() not in (1, 2):
                raise AttnpatError(f"gates for layer {layer} must be (heads,) or (rows, heads) with {heads} heads, "
                                   f"got {tuple(gate.shape)}")
            for module in layers[layer].modules():
                outer = _GATES.get(module)
                _GATES[module] = _Gate(gate, mode, outer)
                attached.append((module, outer))
        yield
    finally:
        for module, outer in reversed(attached):
            if outer is None:
                _GATES.pop(module, None)
            else:
                _GATES[module] = outer
