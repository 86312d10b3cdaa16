"""The Gated DeltaNet layer (Qwen3.5's linear attention) over one step's flattened batch.

hidden -> in_proj_qkv -> causal depthwise conv + SiLU -> q, k, v heads; in_proj_b -> beta =
sigmoid(b); in_proj_a -> log decay g = -exp(A_log) * softplus(a + dt_bias); the gated delta
rule (``gated_delta.py``) over q, k, v, g, beta; a gated RMSNorm of each value head by
SiLU(in_proj_z); out_proj. Parameter names are transformers' (``Qwen3_5GatedDeltaNet``), so a
family maps a checkpoint's ``linear_attn.*`` tensors onto the layer 1:1.

A step is decodes first (``meta.num_decodes`` sequences of one token: one batched recurrent
step and one batched convolution step), then each prefill chunk in turn (the chunked rule from
the sequence's state). Each sequence's state is read and handed back through the KV model's
seam (``state.py``: ``read_states`` / ``write_states``; the runner stores the new states once
the whole step has run), never kept in the module.

Tensor parallelism splits by heads: rank r holds key heads [r Hk/tp, ...) and the value heads
that read them, their rows of in_proj_qkv (q, k and v rows each split), conv channels,
in_proj_z/b/a rows, A_log and dt_bias entries, and out_proj's columns (a row-parallel product
reduced across ranks). The norm's weight (per value-head dimension) is whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmd.layers.attention import AttentionMetadata
from vlmd.layers.linear import SINGLE, ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, TPGroup
from vlmd.layers.linear_attention.gated_delta import (
    GatedRMSNorm,
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    gate_decay,
    recurrent_gated_delta_step,
)
from vlmd.layers.linear_attention.state import RecurrentStateLayout, read_states, write_states


def _rank_rows(loaded: torch.Tensor, full_sizes: list[int], tp: TPGroup) -> torch.Tensor:
    """This rank's rows of each part of a tensor whose rows are parts of ``full_sizes`` rows
    (q, k, v), each split evenly across ranks, concatenated in part order."""
    if loaded.shape[0] != sum(full_sizes):
        raise ValueError(f"checkpoint tensor has {loaded.shape[0]} rows, expected {sum(full_sizes)}")
    return torch.cat([part.narrow(0, tp.rank * (size // tp.size), size // tp.size)
                      for part, size in zip(loaded.split(full_sizes), full_sizes)])


class QKVRows(MergedColumnParallelLinear):
    """in_proj_qkv: one checkpoint tensor of q, k and v rows, each split across ranks."""

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is not None:  # a checkpoint that stores q, k and v apart
            super().weight_loader(param, loaded, shard_id)
            return
        full = [size * self.tp.size for size in self.output_sizes]
        _copy_into(param, _rank_rows(loaded, full, self.tp), "in_proj_qkv")


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _copy_into(param: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(rows.shape):
        raise ValueError(f"{what}: checkpoint shard has shape {tuple(rows.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(rows.to(param.dtype))


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer; sizes are the whole model's (this rank's share is taken)."""

    def __init__(self, hidden_size: int, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, conv_kernel: int, rms_norm_eps: float, tp: TPGroup = SINGLE):
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"{num_value_heads} value heads are not a multiple of {num_key_heads} key heads")
        self.tp = tp
        self.num_key_heads = tp.split(num_key_heads, "linear-attention key heads")
        self.num_value_heads = tp.split(num_value_heads, "linear-attention value heads")
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.key_dim = self.num_key_heads * key_head_dim  # this rank's
        self.value_dim = self.num_value_heads * value_head_dim
        self.conv_kernel = conv_kernel
        # The convolution's channels, [q | k | v], whole-model sizes (the checkpoint's).
        self._qkv_sizes = [num_key_heads * key_head_dim] * 2 + [num_value_heads * value_head_dim]
        self.conv_channels = 2 * self.key_dim + self.value_dim

        self.in_proj_qkv = QKVRows(hidden_size, self._qkv_sizes, bias=False, tp=tp)
        self.in_proj_z = ColumnParallelLinear(hidden_size, self._qkv_sizes[2], bias=False, tp=tp)
        self.in_proj_b = ColumnParallelLinear(hidden_size, num_value_heads, bias=False, tp=tp)
        self.in_proj_a = ColumnParallelLinear(hidden_size, num_value_heads, bias=False, tp=tp)
        # Depthwise: one kernel per channel, [C, 1, K] as the checkpoint's nn.Conv1d weight.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_channels, 1, conv_kernel), requires_grad=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.dt_bias = nn.Parameter(torch.ones(self.num_value_heads), requires_grad=False)
        self.dt_bias.weight_loader = self._load_head_entries
        self.A_log = nn.Parameter(torch.zeros(self.num_value_heads), requires_grad=False)
        self.A_log.weight_loader = self._load_head_entries
        self.norm = GatedRMSNorm(value_head_dim, rms_norm_eps)
        self.out_proj = RowParallelLinear(self._qkv_sizes[2], hidden_size, bias=False, tp=tp)

    def state_layout(self) -> RecurrentStateLayout:
        """This rank's state per request (its bytes are the family's ``layer_state_bytes``)."""
        return RecurrentStateLayout(conv_channels=self.conv_channels, conv_kernel=self.conv_kernel,
                                    heads=self.num_value_heads, key_dim=self.key_head_dim,
                                    value_dim=self.value_head_dim)

    def _load_conv(self, param, loaded, shard_id=None) -> None:
        _copy_into(param, _rank_rows(loaded, self._qkv_sizes, self.tp), "conv1d")

    def _load_head_entries(self, param, loaded, shard_id=None) -> None:
        rows = param.shape[0]
        if loaded.shape[0] != rows * self.tp.size:
            raise ValueError(f"per-head tensor has {loaded.shape[0]} entries, expected {rows * self.tp.size}")
        _copy_into(param, loaded.narrow(0, self.tp.rank * rows, rows), "per-head tensor")

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] for one step's rows (decodes first, then prefill chunks)."""
        return self.out_proj(self.mix(hidden, meta, kv_cache))

    def mix(self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """Everything before out_proj: [T, hidden] -> this rank's normed value heads
        [T, value_dim]; reads and writes each sequence's state."""
        layout = self.state_layout()
        conv_states, delta_states = read_states(kv_cache, meta, layout)
        counts = [chunk.count for chunk in meta.chunks]
        if sum(counts) != hidden.shape[0]:
            raise ValueError(f"the step's chunks cover {sum(counts)} rows, the hidden states have {hidden.shape[0]}")
        qkv = self.in_proj_qkv(hidden)
        gate = self.in_proj_z(hidden)
        beta = self.in_proj_b(hidden).sigmoid()
        decay = gate_decay(self.in_proj_a(hidden), self.A_log, self.dt_bias)
        weight = self.conv1d.weight[:, 0]
        # Each part's outputs and new states, in batch order: the decodes' batch, then each
        # prefill chunk's (a step of decodes alone hands its batch's states on uncopied).
        outputs, new_conv, new_delta = [], [], []
        decodes = meta.num_decodes
        if decodes:
            convolved, conv = causal_conv1d_decode(qkv[:decodes], weight, None, conv_states[:decodes])
            q, k, v = self._heads(convolved)
            mixed, delta = recurrent_gated_delta_step(q, k, v, decay[:decodes], beta[:decodes],
                                                      delta_states[:decodes])
            outputs.append(mixed), new_conv.append(conv), new_delta.append(delta)
        first = decodes
        for index in range(decodes, len(counts)):
            rows = slice(first, first + counts[index])
            first += counts[index]
            convolved, conv = causal_conv1d_prefill(qkv[rows], weight, None, conv_states[index])
            q, k, v = self._heads(convolved)
            mixed, delta = chunk_gated_delta_rule(q, k, v, decay[rows], beta[rows], delta_states[index])
            outputs.append(mixed), new_conv.append(conv[None]), new_delta.append(delta[None])
        write_states(kv_cache, meta, layout, _joined(new_conv), _joined(new_delta))
        normed = self.norm(_joined(outputs), gate.view(-1, self.num_value_heads, self.value_head_dim))
        return normed.reshape(hidden.shape[0], self.value_dim)

    def _heads(self, convolved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = convolved.shape[0]
        q, k, v = convolved.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(rows, self.num_key_heads, self.key_head_dim),
                k.reshape(rows, self.num_key_heads, self.key_head_dim),
                v.reshape(rows, self.num_value_heads, self.value_head_dim))
