"""Qwen3.5's KV model from its text config alone (the model and ``vlmd cost`` alike).

``layer_types`` names each decoder layer: a ``full_attention`` layer keeps paged K/V (of
``num_key_value_heads`` x ``head_dim``); a ``linear_attention`` layer (Gated DeltaNet) keeps
no K/V but a fixed-size recurrent state per request (its causal convolution's last inputs
and its delta-rule matrix per value head), declared by its bytes in
``KVSpec.layer_state_bytes``.
"""

from __future__ import annotations

from vlmd.types import KVSpec

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


def layer_types(text_config) -> list[str]:
    """Each decoder layer's kind (transformers fills ``layer_types`` from
    ``full_attention_interval`` where a config names none)."""
    kinds = list(text_config.layer_types)
    if len(kinds) != int(text_config.num_hidden_layers):
        raise ValueError(f"{len(kinds)} layer_types for {text_config.num_hidden_layers} layers")
    unknown = sorted(set(kinds) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ValueError(f"unsupported Qwen3.5 layer types {unknown}")
    return kinds


def linear_attention_layout(text_config):
    """The recurrent state of one linear-attention layer (``RecurrentStateLayout``): the
    convolution runs over the q, k and v channels together."""
    from vlmd.layers.linear_attention.state import RecurrentStateLayout

    key_dim = int(text_config.linear_num_key_heads) * int(text_config.linear_key_head_dim)
    value_dim = int(text_config.linear_num_value_heads) * int(text_config.linear_value_head_dim)
    return RecurrentStateLayout(conv_channels=2 * key_dim + value_dim, conv_kernel=int(text_config.linear_conv_kernel_dim),
                                heads=int(text_config.linear_num_value_heads),
                                key_dim=int(text_config.linear_key_head_dim),
                                value_dim=int(text_config.linear_value_head_dim))


def kv_spec_for(text_config) -> KVSpec:
    """Every decoder layer, the full-attention ones paged, each linear-attention one holding
    its state's bytes."""
    kinds = layer_types(text_config)
    state_bytes = linear_attention_layout(text_config).bytes_per_request
    heads = int(text_config.num_attention_heads)
    return KVSpec(num_layers=len(kinds), num_kv_heads=int(text_config.num_key_value_heads),
                  head_dim=int(getattr(text_config, "head_dim", None) or int(text_config.hidden_size) // heads),
                  layer_state_bytes=tuple(None if kind == FULL_ATTENTION else state_bytes for kind in kinds))
