"""Gemma 4's text decoder over the paged KV cache, on the core's linear and attention seams.

As transformers' ``Gemma4TextModel`` computes it (``modeling_gemma4.py``, 5.25):
- RMSNorm scales by ``weight`` (not Gemma 3's ``1 + weight``), in float32; V is RMS-normed
  per head without a scale, q and k with one, before rotary; attention is not scaled
  (``scaling = 1.0``: the norms set the logits' size); with ``attention_k_eq_v`` a full
  layer has ``num_global_key_value_heads`` K/V heads and no V projection: its values are
  its keys' projection (normed as values);
- ``layer_types`` alternates sliding-window layers and full ones; full layers have heads of
  ``global_head_dim`` and proportional RoPE (only a ``partial_rotary_factor`` of each head
  rotates), each type its own rotary table; where images attend bidirectionally
  (``use_bidirectional_attention="vision"``) only the sliding layers see an image's tokens
  both ways, the full ones stay causal (``AttentionMetadata.causal``);
- the last ``num_kv_shared_layers`` layers have no K/V projections: they attend with their
  own queries over the K/V of the last earlier layer of their type (``shared_attention``,
  the KV model's ``SharedKV``: they hold nothing in the cache, docs/decisions.md D111);
- per-layer embeddings: a second table gives every token a ``hidden_size_per_layer_input``
  vector per layer (scaled by its square root), averaged (x 1/sqrt 2) with a projection of
  the input embeddings (scaled by 1/sqrt(hidden), RMS-normed); each layer gates it with its
  hidden state and adds its projection back after the MLP; each layer's output is multiplied
  by its ``layer_scalar``;
- token embeddings are multiplied by ``sqrt(hidden_size)``; the output may be soft-capped;
- the mixture-of-experts variant (26B-A4B, ``enable_moe_block``) runs routed experts beside
  the dense MLP: the router reads the residual, the experts its own pre-norm of it, and the
  two outputs, each normed, are added before the post-feedforward norm.

Per-layer embeddings are looked up from token ids, which the runner's ``forward`` contract
does not carry: ``embed_input_ids`` returns each token's two embeddings side by side
(``[T, hidden + layers x per_layer]``) and ``forward`` splits them; an image or audio
token's per-layer part is the pad token's, as transformers looks media positions up as pad
(``Gemma4Model.forward``): the model looks their ids up as pad (``model.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from vlmd.layers.activation import ACTIVATIONS, check_activation, gated_activation, soft_cap
from vlmd.layers.attention import AttentionMetadata, OutputRows, paged_attention, shared_attention
from vlmd.layers.linear import (
    SINGLE,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
)
from vlmd.layers.linear.parallel import all_reduce
from vlmd.layers.moe import FusedExperts
from vlmd.layers.rotary import RotaryEmbedding, apply_rotary
from vlmd.models.loader import load_into
from vlmd_gemma4 import layers as layer_facts
from vlmd_gemma4.layers import SLIDING


class Gemma4RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' order of operations: float32, torch.pow(mean + eps, -0.5), then the scale.
        normed = x.float()
        normed = normed * torch.pow(normed.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


def rotary_tables(config) -> dict[str, RotaryEmbedding]:
    """One rotary table per layer type, for that type's head size (``per_layer_config``)."""
    tables = {}
    for layer_type in sorted(set(layer_facts.layer_types(config))):
        params = dict(config.rope_parameters[layer_type])
        theta = float(params.pop("rope_theta"))
        head_dim = int(config.per_layer_config[layer_type].head_dim)
        tables[layer_type] = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, params)
    return tables


class Gemma4Attention(nn.Module):
    def __init__(self, config, layer: int, tp: TPGroup):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        self.head_dim = int(config.per_layer_config[layer].head_dim)
        self.kv_source = layer_facts.kv_sources(config)[layer]
        # Values are the keys' projection (before the keys' norm and rotary): its weights load
        # into both the k and v rows of the fused projection.
        self.keys_are_values = layer_facts.keys_are_values(config, layer)
        bias = bool(config.attention_bias)
        heads, kv_heads = config.num_attention_heads, int(config.per_layer_config[layer].num_key_value_heads)
        if self.kv_source is None:
            self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias=bias, tp=tp)
            self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
        else:  # queries only: the source layer's K/V are read from its cache
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * self.head_dim, bias=bias, tp=tp)
            self.num_heads = tp.split(heads, "attention heads")
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=bias, tp=tp)
        self.window = int(config.sliding_window) if self.layer_type == SLIDING else None

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        if self.kv_source is not None:
            q = self.q_proj(hidden)
        else:
            kv_size = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim)), cos, sin)
        if self.window is None:  # full layers attend causally even inside an image (transformers' masks)
            meta = meta.causal()
        if self.kv_source is not None:
            attended = shared_attention(q, kv_cache, meta, 1.0, self.window)
        else:
            k = apply_rotary(self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim)), cos, sin)
            v = self.v_norm(v.reshape(tokens, self.num_kv_heads, self.head_dim))
            attended = paged_attention(q, k, v, kv_cache, meta, 1.0, self.window)
        return self.o_proj(attended.reshape(tokens, q_size))


class Gemma4MLP(nn.Module):
    def __init__(self, config, layer: int, tp: TPGroup):
        super().__init__()
        shared = layer_facts.kv_sources(config)[layer] is not None
        size = config.intermediate_size * (2 if config.use_double_wide_mlp and shared else 1)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size] * 2, bias=False, tp=tp)
        self.intermediate = self.gate_up_proj.output_sizes[0]
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, tp=tp)
        self.activation = check_activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.intermediate, self.activation))


class Gemma4Router(nn.Module):
    """transformers' ``Gemma4TextRouter``: the residual RMS-normed without a scale, times a
    learned per-channel scale and 1/sqrt(hidden), scored per expert; the top ``k`` softmax
    probabilities renormalised, each times its expert's learned scale."""

    def __init__(self, config):
        super().__init__()
        self.top_k = int(config.top_k_experts)
        if not 0 < self.top_k <= config.num_experts:
            raise ValueError(f"top_k_experts {self.top_k} is not in 1..{config.num_experts}")
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.root = config.hidden_size ** -0.5

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(hidden) * self.scale * self.root)
        probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probabilities, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, tp: TPGroup):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.layer_type = config.layer_types[layer]
        self.self_attn = Gemma4Attention(config, layer, tp)
        self.mlp = Gemma4MLP(config, layer, tp)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # in the checkpoint
        self.moe = bool(config.enable_moe_block)
        if self.moe:  # experts beside the dense MLP, on the residual (transformers' order)
            self.router = Gemma4Router(config)
            self.experts = FusedExperts(config.num_experts, hidden, config.moe_intermediate_size,
                                        config.hidden_activation, tp)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.tp = tp
        self.per_layer_size = int(config.hidden_size_per_layer_input or 0)
        if self.per_layer_size:
            # Small (hidden -> per-layer size and back): replicated on every rank.
            self.per_layer_input_gate = ReplicatedLinear(hidden, self.per_layer_size, bias=False)
            self.per_layer_projection = ReplicatedLinear(self.per_layer_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
            self.per_layer_activation = ACTIVATIONS[check_activation(config.hidden_activation)]

    def forward(self, hidden, per_layer_input, cos, sin, kv_cache, meta) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        dense = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.moe:
            weights, experts = self.router(hidden)
            routed = self.experts(self.pre_feedforward_layernorm_2(hidden), experts, weights.to(hidden.dtype))
            routed = self.post_feedforward_layernorm_2(all_reduce(routed, self.tp))
            dense = self.post_feedforward_layernorm_1(dense) + routed
        hidden = hidden + self.post_feedforward_layernorm(dense)
        if self.per_layer_size:
            gate = self.per_layer_activation(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar


class Gemma4TextModel(nn.Module):
    _STACKED = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
                ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}

    def __init__(self, config, tp: TPGroup = SINGLE, tie_word_embeddings: bool = True):
        super().__init__()
        problem = layer_facts.unsupported(config)
        if problem is not None:
            raise ValueError(f"Gemma 4 with {problem} is not supported yet")
        self.config = config
        self.hidden_size = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        self.num_layers = config.num_hidden_layers
        self.per_layer_size = int(config.hidden_size_per_layer_input or 0)
        if self.per_layer_size:
            packed = self.num_layers * self.per_layer_size
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, packed)
            self.register_buffer("per_layer_embed_scale", torch.tensor(self.per_layer_size ** 0.5), persistent=False)
            self.per_layer_model_projection = ReplicatedLinear(config.hidden_size, packed, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_size, config.rms_norm_eps)
        self.rotary = nn.ModuleDict(rotary_tables(config))
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, layer, tp) for layer in range(self.num_layers))
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False)
        self.tied = tie_word_embeddings
        if self.tied:  # as every released Gemma 4
            self.lm_head.weight = self.embed_tokens.weight
        self.final_logit_softcapping = config.final_logit_softcapping
        self.pad_token_id = int(config.pad_token_id)
        # A rank holds its share of each layer's K/V heads (a sharing layer's are its source's).
        spec = layer_facts.kv_spec(config)
        sources = spec.layer_kv_sources
        rank_heads = tuple(self.layers[layer if sources[layer] is None else sources[layer]].self_attn.num_kv_heads
                           for layer in range(self.num_layers))
        self.kv_spec = dataclasses.replace(spec, num_kv_heads=rank_heads[0],
                                           layer_kv_heads=rank_heads if spec.layer_kv_heads else ())

    @property
    def embedding_width(self) -> int:
        """Columns of ``embed_input_ids``' rows: the embedding, then every layer's per-layer one."""
        return self.hidden_size + self.num_layers * self.per_layer_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's embedding (x sqrt(hidden)) and, beside it, its per-layer embeddings
        (x sqrt(per-layer size)): ``[T, embedding_width]``."""
        embeds = self.embed_tokens(input_ids) * self.embed_scale.to(self.embed_tokens.weight.dtype)
        if not self.per_layer_size:
            return embeds
        table = self.embed_tokens_per_layer
        per_layer = table(input_ids) * self.per_layer_embed_scale.to(table.weight.dtype)
        return torch.cat([embeds, per_layer], dim=-1)

    def per_layer_inputs(self, inputs_embeds: torch.Tensor, token_part: torch.Tensor) -> torch.Tensor:
        """transformers' ``project_per_layer_inputs``: [T, layers, per-layer size]."""
        tokens = inputs_embeds.shape[0]
        projected = self.per_layer_model_projection(inputs_embeds) * self.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(tokens, self.num_layers, self.per_layer_size))
        return (projected + token_part.reshape(tokens, self.num_layers, self.per_layer_size)) * 2.0 ** -0.5

    def forward(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches,
                outputs: OutputRows | None = None) -> torch.Tensor:
        hidden = inputs_embeds[:, :self.hidden_size]
        per_layer = self.per_layer_inputs(hidden, inputs_embeds[:, self.hidden_size:]) if self.per_layer_size else None
        tables = {name: table.cos_sin(positions, hidden.dtype) for name, table in self.rotary.items()}
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            cos, sin = tables[layer.layer_type]
            hidden = layer(hidden, per_layer[:, index] if per_layer is not None else None, cos, sin, kv_cache, meta)
        if outputs is not None:  # the sampled rows alone, as the runner asked
            hidden = hidden[outputs.rows.to(hidden.device)]
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden), self.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``layers.0.self_attn.q_proj.weight``-style names (no ``model.`` prefix); returns
        the parameters and buffers filled. A sharing layer's K/V projections and norms,
        where a checkpoint has them, are unused (transformers ignores them too); a tied
        head's ``lm_head.weight`` is the embeddings again."""
        params = dict(self.named_parameters())
        buffers = {name: buffer for name, buffer in self.named_buffers() if name.endswith("layer_scalar")}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.tied:
                continue  # tied to embed_tokens, which the checkpoint also holds
            if name in buffers:
                with torch.no_grad():
                    buffers[name].copy_(tensor.to(buffers[name].dtype))
                loaded.add(name)
                continue
            target, shard = name, None
            if target not in params:
                for fragment, (fused, index) in self._STACKED.items():
                    if fragment in target:
                        target, shard = target.replace(fragment, fused), index
                        break
            if target not in params and self._sharing_layer_kv(name):
                continue
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in Gemma 4 checkpoint")
            if shard in ("k", "v") and self.layers[int(name.split(".")[1])].self_attn.keys_are_values:
                if shard == "v":
                    raise ValueError(f"unexpected weight {name!r} in Gemma 4 checkpoint: the layer's values are its keys")
                load_into(params[target], tensor, name, "v")
            load_into(params[target], tensor, name, shard)
            loaded.add(target)
        return loaded

    def _sharing_layer_kv(self, name: str) -> bool:
        parts = name.split(".")
        if len(parts) < 4 or parts[0] != "layers" or parts[2] != "self_attn":
            return False
        return (self.layers[int(parts[1])].self_attn.kv_source is not None
                and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm"))
