"""Our Qwen3.5 text decoder over the paged KV cache: a hybrid of Gated DeltaNet (linear
attention) and gated full-attention layers, as ``layer_types`` lays them out.

- A full-attention layer (``GatedAttention``) is Qwen3's attention with three changes:
  ``q_proj`` gives each head's query and, beside it, a gate (``[H, 2, D]`` rows), whose sigmoid
  scales the head's attention output before ``o_proj``; rotary turns only the first
  ``partial_rotary_factor`` of each head's columns (interleaved M-RoPE over them); q and k are
  RMSNormed per head first. Its K/V go through the attention backend
  (``vlmd.layers.attention``), as every family's do.
- A linear-attention layer is the core's ``GatedDeltaNet``: no K/V; its recurrent state per
  request lives in its KV group's pages, which the layer reads and writes itself.
- Every RMSNorm but the gated one scales by ``1 + weight`` (Gemma's form); the loader adds the
  1 into the weight once, so these are plain ``RMSNorm``s (bit for bit in float32:
  transformers forms ``1 + w`` in float32 and multiplies by it).
- The MLP is Llama's (gate and up fused); Qwen3.5-MoE's (``num_experts`` in the config) is a
  sparse mixture of experts on every layer (``vlmd.layers.moe``, top-k of the router's
  renormalised probabilities) plus a shared expert whose output is scaled by
  sigmoid(``shared_expert_gate``): ``SharedExpertMoeBlock``.

Tensor parallelism: the q/k/v product splits by heads as Qwen3's; a head's query and gate are
adjacent rows of ``q_proj``; the loader puts each rank's queries before its gates
(``queries_then_gates``), so a rank's share of the ``2 H`` rows of width ``D`` holds whole
(query, gate) pairs and its queries are adjacent heads.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from types import SimpleNamespace

import torch
from torch import nn

from vlmd.layers.attention import AttentionMetadata, OutputRows, paged_attention, store_kv
from vlmd.layers.linear import SINGLE, QKVParallelLinear, ReplicatedLinear, RowParallelLinear, TPGroup
from vlmd.layers.linear_attention.gated_delta_net import GatedDeltaNet
from vlmd.layers.moe import SparseMoeBlock
from vlmd.layers.norm import RMSNorm
from vlmd.layers.rotary import MRotaryEmbedding, apply_rotary, mrope_section, rope_parameters
from vlmd.models.base import KVSpec
from vlmd.models.llama import LlamaMLP, _head_dim
from vlmd.models.loader import load_into
from vlmd_qwen3_5.kv import FULL_ATTENTION, layer_types

__all__ = ["GatedAttention", "Qwen3_5ForCausalLM", "SharedExpertMoeBlock", "partial_rotary", "queries_then_gates"]

DEFAULT_MROPE_SECTION = [11, 11, 10]  # transformers' Qwen3.5 text rotary, where a config names none


def partial_rotary(text_config) -> MRotaryEmbedding:
    """Interleaved M-RoPE over the first ``partial_rotary_factor`` of ``head_dim``
    (transformers' ``Qwen3_5TextRotaryEmbedding``, which interleaves whatever the config says)."""
    theta, scaling = rope_parameters(text_config)
    rotary_dim = int(_head_dim(text_config) * float(scaling.get("partial_rotary_factor", 1.0)))
    section = mrope_section(text_config) or DEFAULT_MROPE_SECTION
    return MRotaryEmbedding(rotary_dim, text_config.max_position_embeddings, theta, scaling, section, interleaved=True)


class GatedAttention(nn.Module):
    def __init__(self, config, rotary: MRotaryEmbedding, tp: TPGroup = SINGLE):
        super().__init__()
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        # The q shard's "heads" are the (query, gate) halves: 2 H of them, D wide.
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, 2 * num_heads, num_kv_heads, bias=bias,
                                          tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias=bias, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.rotary_dim = rotary.cos.shape[-1]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        turned = apply_rotary(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((turned, x[..., self.rotary_dim :]), dim=-1)

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata, outputs: OutputRows | None = None):
        """[T, hidden] -> [T, hidden], or with ``outputs`` -> [R, hidden] for its rows alone."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [queries | gates | k | v] (the loader's order, ``queries_then_gates``)
        kv_size = self.num_kv_heads * self.head_dim
        # The heads are normed in place, as Qwen3's are (the CPU room's kernel on float32 rows).
        self.q_norm.heads_(qkv, 0, self.num_heads)
        self.k_norm.heads_(qkv, 2 * self.q_size, self.num_kv_heads)
        q, gate, k, v = qkv.split([self.q_size, self.q_size, kv_size, kv_size], dim=-1)
        q = self._rotate(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = self._rotate(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if outputs is not None:
            store_kv(k, v, kv_cache, meta)  # every row's K/V; only the used rows' queries attend
            rows = outputs.rows
            if outputs.meta is None:
                return hidden.new_empty(0, hidden.shape[1])
            q, k, v, gate, meta = q[rows], k[rows], v[rows], gate[rows], outputs.meta
            tokens = rows.shape[0]
        attended = paged_attention(q, k, v.contiguous(), kv_cache, meta, self.scale)
        return self.o_proj(attended.reshape(tokens, self.q_size) * torch.sigmoid(gate))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen3.5-MoE's MLP: the routed experts' sum plus the shared expert's output scaled by
    sigmoid(``shared_expert_gate``), a replicated ``[1, hidden]`` product. Under tensor
    parallelism the shared expert splits as a dense MLP (its own all-reduce)."""

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__(config, tp)
        shared = SimpleNamespace(hidden_size=config.hidden_size, hidden_act=config.hidden_act,
                                 intermediate_size=int(config.shared_expert_intermediate_size))
        self.shared_expert = LlamaMLP(shared, tp)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return super().forward(hidden) + shared


def has_experts(config) -> bool:
    return int(getattr(config, "num_experts", 0) or 0) > 0


def queries_then_gates(loaded: torch.Tensor, num_heads: int, tp_size: int) -> torch.Tensor:
    """``q_proj``'s rows (or bias), each head's query then its gate (``[H, 2, D]``), reordered
    so that each tensor-parallel rank's share is its heads' queries, then their gates: the
    queries are adjacent heads (normed in place as Qwen3's) and the gates one block."""
    head_dim = loaded.shape[0] // (2 * num_heads)
    if head_dim * 2 * num_heads != loaded.shape[0]:
        raise ValueError(f"q_proj has {loaded.shape[0]} rows, not 2 x {num_heads} heads")
    parts = loaded.reshape(tp_size, num_heads // tp_size, 2, head_dim, *loaded.shape[1:])
    return parts.transpose(1, 2).reshape(loaded.shape)


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm: a token mixer (gated attention or Gated DeltaNet), then the MLP; the
    residual adds are fused into the next norm, as ``LlamaDecoderLayer``'s."""

    def __init__(self, config, kind: str, rotary: MRotaryEmbedding, tp: TPGroup):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == FULL_ATTENTION:
            self.self_attn = GatedAttention(config, rotary, tp)
        else:
            self.linear_attn = gated_delta_net(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SharedExpertMoeBlock(config, tp) if has_experts(config) else LlamaMLP(config, tp)

    def forward(self, hidden, residual, cos, sin, kv_cache, meta, outputs: OutputRows | None = None):
        """As ``LlamaDecoderLayer.forward``: (MLP output, running sum before it); with
        ``outputs``, of those rows alone."""
        if residual is None:
            residual = hidden.clone()
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_forward(residual, hidden)
        if self.kind == FULL_ATTENTION:
            mixed = self.self_attn(normed, cos, sin, kv_cache, meta, outputs)
        else:
            # The state advances over every row; only the used rows go on.
            mixed = self.linear_attn(normed, meta, kv_cache)
            if outputs is not None:
                mixed = mixed[outputs.rows]
        if outputs is not None:
            residual = residual[outputs.rows]
        normed, residual = self.post_attention_layernorm.add_forward(residual, mixed)
        return self.mlp(normed), residual


def gated_delta_net(config, tp: TPGroup) -> GatedDeltaNet:
    """The core's Gated DeltaNet at this config's sizes (this rank's heads)."""
    return GatedDeltaNet(config.hidden_size, int(config.linear_num_key_heads), int(config.linear_num_value_heads),
                         int(config.linear_key_head_dim), int(config.linear_value_head_dim),
                         int(config.linear_conv_kernel_dim), float(config.rms_norm_eps), tp=tp)


# One expert's projection, as transformers saves Qwen3.5-MoE: (experts module, expert, part).
PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
# Checkpoint names (after ``model.``) of the RMSNorms that scale by 1 + weight.
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".self_attn.q_norm.weight",
                ".self_attn.k_norm.weight")


class Qwen3_5ForCausalLM(nn.Module):
    """The text model; ``forward`` takes positions ``[T]`` (plain) or ``[3, T]`` (M-RoPE rows)."""

    # checkpoint name fragment -> (our parameter fragment, shard id for its weight_loader)
    _STACKED = {
        ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
        ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
        ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
        ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
        ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
        ".mlp.shared_expert.gate_proj.": (".mlp.shared_expert.gate_up_proj.", 0),
        ".mlp.shared_expert.up_proj.": (".mlp.shared_expert.gate_up_proj.", 1),
    }

    def __init__(self, config, *, tie_word_embeddings: bool = False, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.rotary = partial_rotary(config)
        kinds = layer_types(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, kind, self.rotary, tp) for kind in kinds)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False)
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        attention = next(layer.self_attn for layer in self.layers if layer.kind == FULL_ATTENTION)
        self.kv_spec = KVSpec(
            num_layers=len(kinds), num_kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
            layer_state_bytes=tuple(None if layer.kind == FULL_ATTENTION
                                    else layer.linear_attn.state_layout().bytes_per_request for layer in self.layers),
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """Final hidden states of every row, or with ``outputs`` of its rows alone (the last
        layer runs only those rows' MLP, and their attention where it is a full-attention one)."""
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        hidden, residual = inputs_embeds, None
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta, outputs if index == last else None)
        return self.norm.add_forward(residual, hidden)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load transformers-named text weights (``model.layers.0.linear_attn.A_log``,
        ``lm_head.weight``); returns the names of our parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        expert_parts: Counter[str] = Counter()  # per fused experts tensor, the per-expert parts loaded
        for name, tensor in weights:
            target = name.removeprefix("model.")
            if target == "norm.weight" or target.endswith(OFFSET_NORMS):
                tensor = tensor.float() + 1.0  # 1 + w, once
            elif ".self_attn.q_proj." in target:
                tensor = queries_then_gates(tensor, int(self.config.num_attention_heads), self.tp.size)
            shard = None
            expert = PER_EXPERT.fullmatch(target)
            if expert is not None:  # experts.{e}.{gate,up,down}_proj.weight into the fused tensors
                prefix, index, part = expert.groups()
                target = f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
                shard = (int(index), part)
                expert_parts[target] += 1
            for fragment, (fused, index) in self._STACKED.items():
                if expert is None and fragment in target:
                    target, shard = target.replace(fragment, fused), index
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in Qwen3.5 checkpoint")
            load_into(params[target], tensor, name, shard)
            loaded.add(target)
        for target, count in expert_parts.items():
            expected = params[target].shape[0] * (2 if target.endswith("gate_up_proj") else 1)
            if count != expected:
                raise ValueError(f"Qwen3.5 checkpoint has {count} of the {expected} per-expert tensors of {target}")
        return loaded
