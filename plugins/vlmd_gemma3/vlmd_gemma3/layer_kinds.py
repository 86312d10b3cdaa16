"""Which of Gemma 3's decoder layers attend through a sliding window, from the config alone
(torch-free: the processing info declares it in its ``kv_spec`` for `vlmd cost`)."""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_windows(text_config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as ``KVSpec.layer_windows``: the
    KV manager gives the windowed layers their own blocks (docs/decisions.md D91)."""
    return tuple(int(text_config.sliding_window) if kind == SLIDING else None
                 for kind in text_config.layer_types[:text_config.num_hidden_layers])
