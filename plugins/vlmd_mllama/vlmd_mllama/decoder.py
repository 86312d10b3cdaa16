"""The Llama 3 text model of Llama 3.2 Vision: self-attention layers over the paged cache (the
core's ``LlamaDecoderLayer``) with gated cross-attention layers at ``cross_attention_layers``.

A cross-attention layer (transformers' ``MllamaCrossAttentionDecoderLayer``): RMSNorm, queries
with a per-head RMSNorm against the request's image K/V (keys per-head RMSNormed too, no
rotary), ``o_proj``, added through ``tanh(attn_gate)``; then RMSNorm, the Llama MLP, zeroed on
rows no image covers, added through ``tanh(mlp_gate)``. Its K/V depend only on the images, so
they are computed once per request (:meth:`MllamaTextDecoder.cross_attention_state`) and
written by the runner into the request's blocks of the cross-attention KV group
(``vlmd/runner/cross_cache.py``); each step hands back ``cross_states``: ``(first row, end row,
CrossSource)`` per request in the flattened batch (its table, its layout as the family state),
None for a request without images, whose rows skip these layers (as transformers skips them for
a text-only prompt), and the cross layers' caches after the self-attention ones in
``kv_caches``. Which vision tokens each row may attend to is ``layout.py``'s; the attention
backend reads the K/V through the table and attends (``cross_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlmd.layers.attention import AttentionMetadata, CrossSpan, OutputRows, cross_attention
from vlmd.layers.linear import (
    SINGLE,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
)
from vlmd.layers.norm import RMSNorm
from vlmd.layers.rotary import RotaryEmbedding, rope_parameters
from vlmd.models.base import KVSpec
from vlmd.models.llama import LlamaDecoderLayer, LlamaMLP
from vlmd_mllama.layout import row_masks


# One request's cross-attention memory as prepared: per cross-attention layer, K and V
# ``[kv_heads, vision_tokens, head_dim]`` of all its images (image, tile, patch order).
CrossState = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class CrossRows:
    """This step's rows that run the cross-attention layers: their batch rows ``[m]``, per
    request its slice of them (rows of the ``m``) with its table and allowed vision tokens,
    and which rows an image covers (``[m, 1]``, 0.0 or 1.0: the MLP's row mask)."""

    rows: torch.Tensor
    spans: list[CrossSpan]
    covered: torch.Tensor


class MllamaCrossAttention(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = config.num_key_value_heads
        self.head_dim = hidden // heads
        self.num_heads = tp.split(heads, "attention heads")
        self.num_kv_heads = tp.split(kv_heads, "key-value heads")
        self.q_proj = ColumnParallelLinear(hidden, heads * self.head_dim, bias=False, tp=tp)
        self.kv_proj = MergedColumnParallelLinear(hidden, [kv_heads * self.head_dim] * 2, bias=False, tp=tp)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=False, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def memory(self, vision: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed) and V of a request's projected vision tokens ``[N, hidden]``."""
        tokens = vision.shape[0]
        k, v = self.kv_proj(vision).view(tokens, 2, self.num_kv_heads, self.head_dim).unbind(1)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(tokens, self.num_kv_heads, self.head_dim)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()

    def forward(self, hidden: torch.Tensor, cross: CrossRows, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(-1, self.head_dim)).view(tokens, self.num_heads, self.head_dim)
        out = cross_attention(q, kv_cache, meta, self.scale, cross.spans)
        return self.o_proj(out.reshape(tokens, -1))


class MllamaCrossAttentionLayer(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn = MllamaCrossAttention(config, tp)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, hidden: torch.Tensor, cross: CrossRows, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """``hidden`` [T, hidden] (the running sum) -> the same with ``cross.rows`` updated."""
        rows = hidden[cross.rows]
        attended = self.cross_attn(self.input_layernorm(rows), cross, kv_cache, meta)
        rows = rows + self.cross_attn_attn_gate.tanh() * attended
        mlp = self.mlp(self.post_attention_layernorm(rows)) * cross.covered
        rows = rows + self.cross_attn_mlp_gate.tanh() * mlp
        return hidden.index_copy(0, cross.rows, rows)


class MllamaTextDecoder(nn.Module):
    """Built from a transformers ``MllamaTextConfig``; our parameter names are the
    checkpoint's after ``model.language_model.`` (fused q/k/v, k/v and gate/up aside)."""

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        if getattr(config, "tie_word_embeddings", False):
            # The embeddings have 8 rows more than the head (the image token among them).
            raise ValueError("a Mllama text model with tied embeddings is not supported")
        self.config = config
        head_dim = config.hidden_size // config.num_attention_heads
        theta, scaling = rope_parameters(config)  # llama3 scaling in the published checkpoints
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size + 8, config.hidden_size)
        self.cross_layers = sorted(set(int(i) for i in config.cross_attention_layers))
        if any(not 0 <= i < config.num_hidden_layers for i in self.cross_layers):
            raise ValueError(f"cross_attention_layers {self.cross_layers} are outside the "
                             f"{config.num_hidden_layers} layers")
        self.layers = nn.ModuleList(
            MllamaCrossAttentionLayer(config, tp) if index in self.cross_layers
            else LlamaDecoderLayer(config, self.rotary, None, tp)
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False)
        first_self = next(layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer))
        cross_heads = {self.layers[index].cross_attn.num_kv_heads for index in self.cross_layers}
        if cross_heads - {first_self.self_attn.num_kv_heads}:
            # The cross pool's tensors have the KV spec's heads (this rank's shard of them).
            raise ValueError(f"cross-attention key-value heads {sorted(cross_heads)} differ from the self-attention's "
                             f"{first_self.self_attn.num_kv_heads} on this rank")
        # The cross-attention layers' K/V (same heads and head size) are the cross pool's.
        self.kv_spec = KVSpec(num_layers=config.num_hidden_layers - len(self.cross_layers),
                              num_kv_heads=first_self.self_attn.num_kv_heads, head_dim=head_dim,
                              num_cross_layers=len(self.cross_layers))
        self.tokens_per_tile = 0  # set by the model: the tower's vectors per tile
        self.max_tiles = 0

    def cross_attention_state(self, vision: torch.Tensor) -> CrossState:
        return [self.layers[index].cross_attn.memory(vision) for index in self.cross_layers]

    def forward(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches, cross_states,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """Final hidden states of every row, or with ``outputs`` of its rows alone (the last
        layer, a self-attention one in the published checkpoints, then runs only those)."""
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        cross = self._cross_rows(positions, cross_states)
        hidden, residual = inputs_embeds, None
        # The self-attention layers' caches, then the cross-attention ones (the KV model's order).
        caches = iter(kv_caches[:self.kv_spec.num_layers])
        cross_caches = kv_caches[self.kv_spec.num_layers:]
        last = len(self.layers) - 1
        selected = False
        for index, layer in enumerate(self.layers):
            if isinstance(layer, MllamaCrossAttentionLayer):
                if cross is None:
                    continue  # no request of this step has images
                hidden = layer(hidden if residual is None else residual + hidden, cross,
                               cross_caches[self.cross_layers.index(index)], meta)
                residual = None
                continue
            rows = outputs if index == last else None
            hidden, residual = layer(hidden, residual, cos, sin, next(caches), meta, rows)
            selected = rows is not None
        if outputs is not None and not selected:
            hidden = hidden[outputs.rows]
            residual = None if residual is None else residual[outputs.rows]
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_forward(residual, hidden)[0]

    def _cross_rows(self, positions: torch.Tensor, cross_states) -> CrossRows | None:
        rows, spans, covered = [], [], []
        used = 0
        for start, end, source in cross_states:
            if source is None or end == start:
                continue
            allowed, row_covered = row_masks(source.family_state, positions[start:end], self.max_tiles,
                                             self.tokens_per_tile)
            rows.append(torch.arange(start, end, device=positions.device))
            spans.append(source.span(used, used + end - start, allowed))
            covered.append(row_covered)
            used += end - start
        if not spans:
            return None
        dtype = self.embed_tokens.weight.dtype
        return CrossRows(torch.cat(rows), spans, torch.cat(covered).to(dtype).unsqueeze(1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
