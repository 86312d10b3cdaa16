"""What each of Gemma 4's decoder layers is, from the text config alone (torch-free: the
processing info declares the same ``KVSpec`` for `vlmd cost` and the memory plan).

As transformers' ``Gemma4TextConfig``: ``layer_types`` alternates sliding-window layers and
full-attention ones; a full layer's heads are ``global_head_dim`` wide (its
``per_layer_config``); the last ``num_kv_shared_layers`` layers compute no K/V and read
those of the last earlier layer of their own type (``kv_sharing_modes``: "reuse" reads what
that layer "store"s)."""

from __future__ import annotations

from vlmd.types import KVSpec

SLIDING, FULL = "sliding_attention", "full_attention"


def unsupported(text_config) -> str | None:
    """What of this checkpoint's decoder the family does not run yet (None: all of it)."""
    if getattr(text_config, "use_bidirectional_attention", None) == "all":
        return "use_bidirectional_attention='all'"
    shared = int(text_config.num_kv_shared_layers)
    if shared >= int(text_config.num_hidden_layers):
        return "every layer sharing K/V (none computes any)"
    return None


def layer_types(text_config) -> list[str]:
    return list(text_config.layer_types[:text_config.num_hidden_layers])


def head_dims(text_config) -> tuple[int, ...]:
    """Each layer's head size (a full layer's is the config's ``global_head_dim``)."""
    return tuple(int(text_config.per_layer_config[layer].head_dim) for layer in range(text_config.num_hidden_layers))


def kv_sources(text_config) -> tuple[int | None, ...]:
    """Each layer's K/V source: None where it computes its own, else the last layer before the
    shared ones of its type (transformers' ``kv_sharing_modes``)."""
    types = layer_types(text_config)
    first_shared = len(types) - int(text_config.num_kv_shared_layers)
    sources: list[int | None] = []
    for layer, kind in enumerate(types):
        if layer < first_shared:
            sources.append(None)
            continue
        owners = [earlier for earlier in range(first_shared) if types[earlier] == kind]
        if not owners:
            raise ValueError(f"layer {layer} ({kind}) shares K/V, but no earlier layer of its type computes any")
        sources.append(owners[-1])
    return tuple(sources)


def windows(text_config) -> tuple[int | None, ...]:
    return tuple(int(text_config.sliding_window) if kind == SLIDING else None for kind in layer_types(text_config))


def kv_heads(text_config) -> tuple[int, ...]:
    """Each layer's K/V heads (a full layer's are ``num_global_key_value_heads`` where the
    config has ``attention_k_eq_v``)."""
    return tuple(int(text_config.per_layer_config[layer].num_key_value_heads)
                 for layer in range(text_config.num_hidden_layers))


def keys_are_values(text_config, layer: int) -> bool:
    """Whether the layer's values are its keys' projection (``attention_k_eq_v``, full layers)."""
    return bool(text_config.attention_k_eq_v) and text_config.layer_types[layer] == FULL


def kv_spec(text_config) -> KVSpec:
    """The decoder's KV declaration: windows, head sizes, K/V heads, shared layers (D111)."""
    dims, heads = head_dims(text_config), kv_heads(text_config)
    return KVSpec(num_layers=len(dims), num_kv_heads=heads[0], head_dim=dims[0],
                  layer_windows=windows(text_config), layer_kv_sources=kv_sources(text_config),
                  layer_head_dims=dims, layer_kv_heads=heads if len(set(heads)) > 1 else ())
