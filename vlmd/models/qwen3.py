"""Our Qwen3 decoder over the paged KV cache: Llama plus an RMSNorm of each q and k head.

Qwen3 norms every query and key head over ``head_dim`` (its own weight for q and for k)
after the q/k/v product and before rotary; q/k/v carry a bias only where
``attention_bias`` says so. The heads are normed and rotated in place on the product's
rows through the norm and rotary seams (``RMSNorm.heads_``, ``rotate_qkv``), whose float32
CPU kernels are the ones (in the order) the fused decode step runs (it gets the norms
through ``decoder_structure``), so a step's two paths agree bit for bit. Everything else
(fused projections, GQA, paged attention, the rotary the config asks for, weight loading)
is ``LlamaForCausalLM``'s.

Some vision-language models add vectors to the hidden states of a few rows after each of
the first layers (features of several encoder layers, at the rows of an item's
placeholders): ``forward(..., additions=(rows, values))`` does that, as the reference adds
them to each layer's output, the residual sum.
"""

from __future__ import annotations

import dataclasses

import torch

from vlmd.layers.attention import AttentionMetadata, OutputRows
from vlmd.layers.decoder_structure import DecoderStructure
from vlmd.layers.linear import SINGLE, ReplicatedLinear, TPGroup
from vlmd.layers.norm import RMSNorm
from vlmd.layers.rotary import RotaryEmbedding, rotary_for, rotate_qkv
from vlmd.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, _head_dim


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool | None = None, tp: TPGroup = SINGLE):
        super().__init__(config, rotary, qkv_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_qkv(self, hidden, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(hidden)
        self.q_norm.heads_(qkv, 0, self.num_heads)
        self.k_norm.heads_(qkv, self.q_size, self.num_kv_heads)
        return rotate_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``forward`` takes positions ``[T]`` (plain RoPE) or ``[3, T]`` (M-RoPE rows t, h, w)."""

    layer_class = Qwen3DecoderLayer

    def __init__(self, config, *, tie_word_embeddings: bool | None = None, rotary: RotaryEmbedding | None = None,
                 tp: TPGroup = SINGLE):
        """``rotary`` replaces the one the config asks for; ``tie_word_embeddings`` the
        text config's (a vision-language model keeps it on its outer config)."""
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3 sliding-window attention is not supported")
        if rotary is None:
            rotary = rotary_for(config, _head_dim(config))
        super().__init__(config, rotary=rotary, tp=tp)
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        elif self.lm_head.weight is self.embed_tokens.weight:
            # The text config says tied (Qwen3-VL-MoE's default) but the model's outer config,
            # which transformers follows, does not: an lm_head of its own.
            self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False)

    def _describe(self, tp: TPGroup) -> DecoderStructure | None:
        """Llama's description with every layer's q and k norms: a backend's fused decode
        step must run them."""
        llama = super()._describe(tp)
        layers = tuple(dataclasses.replace(described, query_norm=layer.self_attn.q_norm, key_norm=layer.self_attn.k_norm)
                       for described, layer in zip(llama.layers, self.layers))
        return dataclasses.replace(llama, layers=layers)

    def forward(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches, outputs: OutputRows | None = None,
                additions: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``; ``additions`` = (rows ``[n]``, values ``[k, n,
        hidden]``): after layer i < k, ``values[i]`` is added to the hidden states of those rows."""
        if additions is None or additions[0].numel() == 0:
            return super().forward(inputs_embeds, positions, meta, kv_caches, outputs)
        rows, values = additions
        last = len(self.layers) - 1
        if values.shape[0] > last:
            raise ValueError(f"additions for {values.shape[0]} layers; this decoder adds after at most {last}")
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        hidden, residual = inputs_embeds, None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta, outputs if index == last else None)
            if index < values.shape[0]:
                # The layer's output is the sum (residual + MLP output); the reference adds to
                # that sum, so it is formed here and the next layer starts from it.
                hidden = residual + hidden
                hidden[rows] = hidden[rows] + values[index].to(hidden.dtype)
                residual = None
        return self.norm.add_forward(residual, hidden)[0]
