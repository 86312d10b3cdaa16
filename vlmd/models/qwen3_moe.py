"""Our Qwen3-MoE decoder: Qwen3's layers with a sparse mixture of experts in place of the
MLP on the layers the config makes sparse (``decoder_sparse_step``, ``mlp_only_layers``).

The language model of Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``). The experts
are ``layers/moe.py``; attention, q/k norms, rotary, the paged cache and DeepStack's
additions are ``Qwen3ForCausalLM``'s. The CPU room's fused decode step runs dense
Llama-shaped layers only, so this decoder is not described to it (``decoder_structure``
None) and its decode steps run the modules.
"""

from __future__ import annotations

from torch import nn

from vlmd.layers.linear import SINGLE, TPGroup
from vlmd.layers.moe import SparseMoeBlock
from vlmd.layers.norm import RMSNorm
from vlmd.layers.rotary import RotaryEmbedding
from vlmd.models.llama import LlamaMLP
from vlmd.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM


def is_sparse_layer(config, index: int) -> bool:
    """Whether layer ``index`` has experts, by transformers' rule for Qwen3-MoE configs."""
    if index in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return int(getattr(config, "num_experts", 0) or 0) > 0 and (index + 1) % step == 0


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer (its ``forward``), with experts or a dense MLP as built."""

    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool | None, tp: TPGroup, sparse: bool):
        nn.Module.__init__(self)  # the parts are chosen here, not by the dense layer's constructor
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, rotary, qkv_bias, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config, tp) if sparse else LlamaMLP(config, tp)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` (M-RoPE rows, DeepStack additions) with experts."""

    def __init__(self, config, *, tie_word_embeddings: bool | None = None, rotary: RotaryEmbedding | None = None,
                 tp: TPGroup = SINGLE):
        if not int(getattr(config, "num_experts", 0) or 0):
            raise ValueError("a Qwen3-MoE config needs num_experts > 0")
        super().__init__(config, tie_word_embeddings=tie_word_embeddings, rotary=rotary, tp=tp)

    def make_layer(self, config, index: int, qkv_bias: bool | None, tp: TPGroup) -> nn.Module:
        return Qwen3MoeDecoderLayer(config, self.rotary, qkv_bias, tp, sparse=is_sparse_layer(config, index))

    def _describe(self, tp: TPGroup) -> None:
        return None  # no fused decode step for expert layers: the modules run (see the module doc)
