"""Gemma 3's text decoder over the paged KV cache, on the core's linear and attention seams.

What differs from Llama's layer (``vlmd/models/llama.py``), as transformers computes it:
- RMSNorm scales by ``1 + weight``, in float32, and every layer has four of them: before
  and after attention, before and after the MLP (the residual adds the normed outputs);
- q and k are RMS-normed per head before rotary; the query scale is
  ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- ``layer_types`` alternates sliding-window layers (their own rotary table, attention
  back ``sliding_window`` tokens) and full layers; the backend gets each layer's window;
- token embeddings are multiplied by ``sqrt(hidden_size)`` (image features are not);
- the MLP is GELU (tanh) gated; the output projection is tied to the embeddings
  (in released checkpoints; the tiny test ones are untied).

Its layers are described as a ``DecoderStructure`` (``PreNormLayer`` with the norms after
attention and MLP, a window on the sliding layers, a rotary table per layer type, norms
scaling by ``1 + w``), so the CPU backend runs a step of decodes through every layer in one
native call (``layers/cpu/fused_step.py``), bit for bit these modules' float32 result: on
float32 CPU rows the modules run the same kernels (the norms, the q/k head norms, rotary
and GELU-tanh of ``layers/cpu/elementwise.c``), in torch ops elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vlmd.layers.activation import check_activation, gated_activation, soft_cap
from vlmd.layers.attention import AttentionMetadata, OutputRows, paged_attention
from vlmd.layers.decoder_structure import DecoderStructure, PreNormLayer
from vlmd.layers.linear import (
    SINGLE,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
)
from vlmd.layers.norm import RMSNorm
from vlmd.layers.rotary import RotaryEmbedding, rotate_qkv
from vlmd.models.base import KVSpec
from vlmd_gemma3.layer_kinds import SLIDING, layer_windows



class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by ``1 + weight`` (a zero weight is the identity scale)."""

    BFLOAT16_TWIN = False  # its reference rounds once, from float32 (transformers' order)

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def kernel_weight(self) -> torch.Tensor | None:
        weight = super().kernel_weight()
        return None if weight is None else 1.0 + weight

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' order of operations (float32 throughout, then back to x's dtype).
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rotary_tables(config) -> dict[str, RotaryEmbedding]:
    """One rotary table per layer type, from ``rope_parameters[layer_type]``."""
    tables = {}
    for layer_type in sorted(set(config.layer_types)):
        params = dict(config.rope_parameters[layer_type])
        theta = float(params.pop("rope_theta"))
        tables[layer_type] = RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta, params)
    return tables


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_type: str, tp: TPGroup):
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
        self.head_dim = config.head_dim
        bias = bool(config.attention_bias)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias, tp=tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.window = int(config.sliding_window) if layer_type == SLIDING else None

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # Each q and k head normed in place, then rotated: on float32 CPU rows the kernels the
        # fused decode step runs (so the two agree bit for bit), else torch ops.
        self.q_norm.heads_(qkv, 0, self.num_heads)
        self.k_norm.heads_(qkv, self.num_heads * self.head_dim, self.num_kv_heads)
        q, k, v = rotate_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin)
        attended = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(attended.reshape(tokens, self.num_heads * self.head_dim))


class Gemma3MLP(nn.Module):
    def __init__(self, config, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       tp=tp)
        self.intermediate = self.gate_up_proj.output_sizes[0]
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, tp=tp)
        self.activation = check_activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.intermediate, self.activation))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str, tp: TPGroup):
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(config, layer_type, tp)
        self.mlp = Gemma3MLP(config, tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden, cos, sin, kv_cache, meta) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3TextModel(nn.Module):
    _STACKED = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
                ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}

    def __init__(self, config, tp: TPGroup = SINGLE, tie_word_embeddings: bool = True):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        self.rotary = nn.ModuleDict(rotary_tables(config))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, config.layer_types[i], tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False)
        self.tied = tie_word_embeddings
        if self.tied:  # as every released Gemma 3
            self.lm_head.weight = self.embed_tokens.weight
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.kv_spec = KVSpec(num_layers=config.num_hidden_layers, num_kv_heads=self.layers[0].self_attn.num_kv_heads,
                              head_dim=config.head_dim, layer_windows=layer_windows(config))
        self.decoder_structure = self._describe(tp)

    def _describe(self, tp: TPGroup) -> DecoderStructure:
        """This decoder as data, for a backend that runs a whole decode step itself: each
        layer's four norms (``post_norm`` is the one before the MLP), its window and its
        rotary table (``self.rotary``'s order, as ``forward`` stacks them)."""
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        order = list(self.rotary)
        return DecoderStructure(
            layers=tuple(PreNormLayer(
                layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                layer.pre_feedforward_layernorm, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                query_norm=layer.self_attn.q_norm, key_norm=layer.self_attn.k_norm,
                post_attention_norm=layer.post_attention_layernorm,
                post_feedforward_norm=layer.post_feedforward_layernorm, window=layer.self_attn.window,
                rotary=order.index(layer.layer_type)) for layer in self.layers),
            final_norm=self.norm, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=mlp.intermediate, scale=attn.scale, eps=self.config.rms_norm_eps,
            activation=mlp.activation, tensor_parallel=tp.size, norm_offset=1.0, rotary_tables=len(order))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale.to(self.embed_tokens.weight.dtype)

    def forward(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches,
                outputs: OutputRows | None = None) -> torch.Tensor:
        tables = {name: table.cos_sin(positions, inputs_embeds.dtype) for name, table in self.rotary.items()}
        if meta.num_decodes == inputs_embeds.shape[0] or meta.backend.FUSES_SHORT_CHUNKS:
            # A step of decodes (or short chunks, as decodes) may run every layer in one call:
            # the tables stacked in ``self.rotary``'s order, as ``decoder_structure`` numbers them.
            cos, sin = (torch.stack([table[i][:, 0] for table in tables.values()]) if len(tables) > 1
                        else next(iter(tables.values()))[i][:, 0] for i in (0, 1))
            stepped = meta.backend.decode_step(self.decoder_structure, inputs_embeds, cos, sin, meta, kv_caches,
                                               outputs)
            if stepped is not None:
                return stepped
        hidden = inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches):
            cos, sin = tables[layer.layer_type]
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        if outputs is not None:  # the sampled rows alone, as the runner asked
            hidden = hidden[outputs.rows.to(hidden.device)]
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden), self.final_logit_softcapping)

    def logits_head(self) -> ReplicatedLinear:
        """The product ``compute_logits`` runs before its soft cap: ``--quantization int8``
        quantizes it with the decoder's (``layers/linear/quantize.py``); tied to
        ``embed_tokens`` (released checkpoints), the lookup keeps the float weight."""
        return self.lm_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``layers.0.self_attn.q_proj.weight``-style names (no ``model.`` prefix); returns
        the parameters filled. A tied head's ``lm_head.weight``, where a checkpoint has it,
        is the embeddings again."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = name, None
            if target == "lm_head.weight" and self.tied:
                continue  # tied to embed_tokens, which the checkpoint also holds
            for fragment, (fused, index) in self._STACKED.items():
                if fragment in target:
                    target, shard = target.replace(fragment, fused), index
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in Gemma 3 checkpoint")
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor.to(param.dtype))
            loaded.add(target)
        return loaded
