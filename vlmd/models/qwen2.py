"""Our Qwen2 decoder over the paged KV cache: Llama plus q/k/v biases.

Qwen2 differs from Llama in two ways that matter here: q/k/v projections carry a bias
(``o_proj`` does not), and its config may ask for another rotary embedding (Qwen2-VL's
text model rotates by 3-D positions: ``layers/rotary.py`` ``rotary_for``). Everything else
(fused projections, GQA, paged attention, weight loading) is ``LlamaForCausalLM``'s.
"""

from __future__ import annotations

from vlmd.layers.linear import SINGLE, TPGroup
from vlmd.layers.rotary import rotary_for
from vlmd.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``forward`` takes positions ``[T]`` (plain RoPE) or ``[3, T]`` (M-RoPE rows t, h, w)."""

    def __init__(self, config, *, tie_word_embeddings: bool | None = None, tp: TPGroup = SINGLE):
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 sliding-window attention is not supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        super().__init__(config, qkv_bias=True, rotary=rotary_for(config, head_dim), tp=tp)
        # Qwen2-VL keeps tie_word_embeddings on the outer config, not on its text config.
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
