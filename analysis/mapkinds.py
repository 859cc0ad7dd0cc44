"""Map kinds: what an attention "map" is. analysis.stream.stream_maps yields one of three, same shapes.

- ``weight``: the attention weights alpha_ij of each head (softmax rows), as every paper of the period uses.
- ``norm`` (Kobayashi et al. 2020, "Attention is Not Only a Weight"): ||alpha_ij f_h(x_j)|| per head, where
  f_h(x) = (x W_V + b_V)_h W_O^h is the value vector of head h passed through that head's slice of the output
  projection (rows h*d..(h+1)*d of W_O; the output bias b_O is shared by all tokens and left out, as in the
  paper). Since alpha >= 0 this is alpha_ij ||f_h(x_j)||. **Each row is renormalised to sum to 1**, so norm maps
  can be displayed, classified and averaged exactly like weight maps; the raw norms are not kept.
- ``rollout`` (Abnar & Zuidema 2020): per layer, A_hat_l = 0.5 * mean over heads of A_l + 0.5 * I with rows
  renormalised, and rollout_l = A_hat_l @ A_hat_{l-1} @ ... @ A_hat_1 (how much each token of the input flows
  into each position after layer l). Rollout is one map per *layer*: every head of a layer carries its
  layer's rollout, so per-head tables repeat a layer's value across its heads (read them per layer).

Shapes: ``B`` batch, ``L`` layers, ``H`` heads, ``T`` padded length, ``d`` head size, ``D`` hidden size.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from analysis.errors import AttnpatError, check_choice

MAP_KINDS = ("weight", "norm", "rollout")
DEFAULT_MAP_KIND = "weight"
KIND_NOTES = {
    "weight": "attention weights",
    "norm": "Kobayashi's ||alpha f(x)|| per head, each row renormalised to sum 1",
    "rollout": "Abnar & Zuidema's attention rollout per layer (0.5 A + 0.5 I), repeated for every head of a layer",
}


def check_map_kind(kind: str) -> str:
    return check_choice(kind, MAP_KINDS, "map kind")


# ---------------------------------------------------------------- pure functions over maps

def renormalise_rows(maps: torch.Tensor) -> torch.Tensor:
    """Rows divided by their sums (..., T, T); all-zero rows (padding) stay zero."""
    sums = maps.sum(-1, keepdim=True)
    return maps / torch.where(sums > 0, sums, torch.ones_like(sums))


def transformed_value_norms(values: torch.Tensor, output_weight: torch.Tensor, heads: int) -> torch.Tensor:
    """||f_h(x_j)||: (B, H, T) norms of each token's value vector through head h's slice of the output projection.

    values: (B, T, H*d), the value projection's output (bias included); output_weight: (D, H*d), the output
    projection's weight (torch's Linear layout: out = context @ W.T). Computed through each head's d x d Gram
    matrix W_h^T W_h, so no (B, H, T, D) tensor is built.
    """
    batch, length, width = values.shape
    size = width // heads
    per_head = values.reshape(batch, length, heads, size).float()
    slices = output_weight.float().reshape(-1, heads, size)  # (D, H, d)
    gram = torch.einsum("ohd,ohe->hde", slices, slices)  # (H, d, d)
    squared = torch.einsum("bthd,hde,bthe->bht", per_head, gram, per_head)
    return squared.clamp(min=0).sqrt()


def norm_maps(attentions: torch.Tensor, value_norms: torch.Tensor) -> torch.Tensor:
    """Kobayashi's maps, rows renormalised: attentions (B, H, T, T) x value_norms (B, H, T) -> (B, H, T, T)."""
    return renormalise_rows(attentions.float() * value_norms[:, :, None, :].float())


def rollout_maps(attentions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Attention rollout of every layer, repeated over heads: (B, L, H, T, T) -> (B, L, H, T, T).

    real: (B, T) bool, the real (non-padding) tokens; the identity is added on real tokens only, so padding
    rows and columns stay zero.
    """
    batch, layers, heads, length, _ = attentions.shape
    identity = torch.diag_embed(real.to(torch.float32))  # (B, T, T)
    rolled = identity
    per_layer = []
    for layer in range(layers):
        mixed = renormalise_rows(0.5 * attentions[:, layer].float().mean(1) + 0.5 * identity)
        rolled = mixed @ rolled
        per_layer.append(rolled)
    stacked = torch.stack(per_layer, dim=1)  # (B, L, T, T)
    return stacked[:, :, None].expand(batch, layers, heads, length, length).contiguous()


# ---------------------------------------------------------------- reading value vectors from a model

# Families whose layers each own a value and an output projection that norm maps read (_attention_parts).
NORM_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert", "mpnet")


def check_kind_supported(kind: str, model_type: str) -> str:
    """``kind`` when models of ``model_type`` can give its maps, else an AttnpatError: norm maps need each layer's
    own value and output projections (ALBERT shares one attention module across layers; DeBERTa's is not read
    here). Weight and rollout maps need only the attention weights, which every family returns."""
    kind = check_map_kind(kind)
    if kind == "norm" and model_type not in NORM_TYPES:
        raise AttnpatError(f"norm maps are not supported for {model_type} models (supported: "
                           f"{', '.join(NORM_TYPES)}); weight and rollout maps work for every family")
    return kind


def _attention_parts(layer: nn.Module, model_type: str) -> tuple[nn.Module, nn.Linear]:
    """(value projection, output projection) of one encoder layer of a family in NORM_TYPES."""
    if model_type == "distilbert":
        return layer.attention.v_lin, layer.attention.out_lin
    if model_type == "mpnet":
        return layer.attention.attn.v, layer.attention.attn.o
    return layer.attention.self.value, layer.attention.output.dense


def attention_parts(model: nn.Module) -> list[tuple[nn.Module, nn.Linear]]:
    """Per layer, the value and output projections whose weights define f(x) (Kobayashi)."""
    model_type = getattr(model.config, "model_type", "?")
    check_kind_supported("norm", model_type)
    base = model.base_model
    container = getattr(base, "encoder", None) or getattr(base, "transformer", None)
    layers = getattr(container, "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise AttnpatError(f"norm maps are not supported for {model_type} models (no per-layer attention modules)")
    return [_attention_parts(layer, model_type) for layer in layers]


@contextmanager
def captured_values(model: nn.Module) -> Iterator[list]:
    """Record each layer's value-projection output (B, T, H*d) during a forward pass: yields the list filled
    in layer order (cleared at the start of each pass by the caller). Only passes run by this thread are
    recorded: the web app serves several requests on one model at once, and another request's pass would
    otherwise add its values to this list."""
    seen: list = []
    owner = threading.get_ident()

    def record(module, args, output) -> None:
        if threading.get_ident() == owner:
            seen.append(output)

    handles = [value.register_forward_hook(record) for value, _ in attention_parts(model)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def norm_maps_from_values(model: nn.Module, attentions: torch.Tensor, values: list) -> torch.Tensor:
    """(B, L, H, T, T) norm maps from the weights (B, L, H, T, T) and the captured value outputs (L of them)."""
    parts = attention_parts(model)
    if len(values) != len(parts):
        raise AttnpatError(f"captured {len(values)} value projections for {len(parts)} layers")
    heads = attentions.shape[2]
    return torch.stack([norm_maps(attentions[:, layer], transformed_value_norms(values[layer], output.weight, heads))
                        for layer, (_, output) in enumerate(parts)], dim=1)
