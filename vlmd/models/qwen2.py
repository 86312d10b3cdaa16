"""Our Qwen2 decoder over the paged KV cache: Llama plus q/k/v biases, with M-RoPE.

Qwen2 differs from Llama in two ways that matter here: q/k/v projections carry a bias
(``o_proj`` does not), and Qwen2-VL's text model rotates by 3-D (time, height, width)
positions (M-RoPE, ``mrope_section`` in its rope parameters). Everything else (fused
projections, GQA, paged attention, weight loading) is ``LlamaForCausalLM``'s.
"""

from __future__ import annotations

from vlmd.layers.linear import SINGLE, TPGroup
from vlmd.layers.rotary import MRotaryEmbedding, mrope_section, rope_parameters
from vlmd.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``forward`` takes positions ``[T]`` (plain RoPE) or ``[3, T]`` (M-RoPE rows t, h, w)."""

    def __init__(self, config, *, tie_word_embeddings: bool | None = None, tp: TPGroup = SINGLE):
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 sliding-window attention is not supported")
        section = mrope_section(config)
        rotary = None
        if section is not None:
            theta, scaling = rope_parameters(config)
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            rotary = MRotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling, section)
        super().__init__(config, qkv_bias=True, rotary=rotary, tp=tp)
        self.uses_mrope = section is not None
        # Qwen2-VL keeps tie_word_embeddings on the outer config, not on its text config.
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
