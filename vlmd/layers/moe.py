"""A sparse mixture-of-experts MLP: a router picks ``top_k`` experts a token, each a gated
MLP, and the token's output is their outputs weighted by the router's renormalised
probabilities (Qwen3-MoE's and Qwen3-VL-MoE's block).

Each expert runs as two products over the rows routed to it, experts in ascending order
and each token's contributions summed in that order, as the reference does: an expert no
token chose costs nothing, and no dense [tokens, experts, ...] tensor is formed. Under
tensor parallelism every rank holds every expert's slice of the intermediate columns (as
``MergedColumnParallelLinear`` and ``RowParallelLinear`` split a dense MLP), so the partial
outputs are summed across ranks once per block.

Weights are the fused 3D tensors Qwen3-VL-MoE checkpoints store (``experts.gate_up_proj``
``[experts, hidden, 2 * intermediate]``, ``experts.down_proj`` ``[experts, intermediate,
hidden]``) or transformers' in-memory transpose of them (a square case is read as the
checkpoint layout), or one tensor per expert and projection (``experts.{e}.gate_proj.weight``
``[intermediate, hidden]``, ``up_proj``, ``down_proj`` ``[hidden, intermediate]``: what
transformers saves for Qwen3.5-MoE), each loaded with ``shard_id`` (expert, part).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmd.layers.activation import check_activation, gated_activation
from vlmd.layers.linear import SINGLE, TPGroup
from vlmd.layers.linear.parallel import all_reduce


class FusedExperts(nn.Module):
    """Every expert's gate/up and down weights, this rank's intermediate columns."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation: str, tp: TPGroup = SINGLE):
        super().__init__()
        self.num_experts, self.hidden, self.tp = num_experts, hidden, tp
        self.intermediate = tp.split(intermediate, "MoE intermediate size")
        self.full_intermediate = intermediate
        self.activation = check_activation(activation)
        # Laid out for F.linear: [gate | up] rows of this rank, and down's columns of this rank.
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, self.intermediate), requires_grad=False)
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down

    def _as_rows(self, loaded: torch.Tensor, rows: int, columns: int, what: str) -> torch.Tensor:
        """``loaded`` as ``[experts, rows, columns]``: the checkpoint stores it transposed."""
        if tuple(loaded.shape) == (self.num_experts, columns, rows):
            return loaded.transpose(1, 2)
        if tuple(loaded.shape) == (self.num_experts, rows, columns):
            return loaded
        raise ValueError(f"{what} has shape {tuple(loaded.shape)}, expected "
                         f"{(self.num_experts, columns, rows)} (or its transpose)")

    def _load_gate_up(self, param, loaded: torch.Tensor, shard_id=None) -> None:
        """The fused tensor, or with ``shard_id`` = (expert, "gate" or "up") one expert's
        ``[intermediate, hidden]`` projection (checkpoints that store experts one by one)."""
        if shard_id is not None:
            expert, part = self._expert_shard(shard_id, ("gate", "up"))
            rows = self._expert_part(loaded, (self.full_intermediate, self.hidden), f"experts.{expert}.{part}_proj")
            offset = 0 if part == "gate" else self.intermediate
            with torch.no_grad():
                param[expert, offset : offset + self.intermediate].copy_(
                    rows.narrow(0, self.tp.rank * self.intermediate, self.intermediate))
            return
        full = self._as_rows(loaded, 2 * self.full_intermediate, self.hidden, "experts.gate_up_proj")
        start, width = self.tp.rank * self.intermediate, self.intermediate
        with torch.no_grad():
            param[:, :width].copy_(full[:, start : start + width])  # gate
            param[:, width:].copy_(full[:, self.full_intermediate + start : self.full_intermediate + start + width])

    def _load_down(self, param, loaded: torch.Tensor, shard_id=None) -> None:
        """The fused tensor, or with ``shard_id`` = (expert, "down") one expert's ``[hidden,
        intermediate]`` projection."""
        if shard_id is not None:
            expert, part = self._expert_shard(shard_id, ("down",))
            columns = self._expert_part(loaded, (self.hidden, self.full_intermediate), f"experts.{expert}.down_proj")
            with torch.no_grad():
                param[expert].copy_(columns.narrow(1, self.tp.rank * self.intermediate, self.intermediate))
            return
        full = self._as_rows(loaded, self.hidden, self.full_intermediate, "experts.down_proj")
        start = self.tp.rank * self.intermediate
        with torch.no_grad():
            param.copy_(full[:, :, start : start + self.intermediate])

    def _expert_shard(self, shard_id, parts: tuple[str, ...]) -> tuple[int, str]:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and isinstance(shard_id[0], int)
                and 0 <= shard_id[0] < self.num_experts and shard_id[1] in parts):
            raise ValueError(f"expert shard {shard_id!r} is not (expert in 0..{self.num_experts - 1}, one of {parts})")
        return shard_id

    @staticmethod
    def _expert_part(loaded: torch.Tensor, shape: tuple[int, int], what: str) -> torch.Tensor:
        if tuple(loaded.shape) != shape:
            raise ValueError(f"{what} has shape {tuple(loaded.shape)}, expected {shape}")
        return loaded

    def forward(self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``hidden`` [T, H]; ``experts``/``weights`` [T, k]: each token's experts and their
        weights. Returns this rank's partial sum [T, H]."""
        out = torch.zeros_like(hidden)
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # routed (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picked = order[start : start + count]
            start += count
            tokens = picked // top_k
            gate_up = F.linear(hidden[tokens], self.gate_up_proj[expert])
            expert_out = F.linear(gated_activation(gate_up, self.intermediate, self.activation), self.down_proj[expert])
            out.index_add_(0, tokens, expert_out * flat_weights[picked, None])
        return out


class SparseMoeBlock(nn.Module):
    """Router (``gate.weight`` [experts, hidden], replicated) and experts, from a config with
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size`` and ``hidden_act``."""

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.top_k = int(config.num_experts_per_tok)
        if not 0 < self.top_k <= config.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} is not in 1..{config.num_experts}")
        # Qwen3-MoE configs may say norm_topk_prob=False; Qwen3-VL-MoE always renormalises.
        self.normalize = bool(getattr(config, "norm_topk_prob", True))
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                    config.hidden_act, tp)
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(hidden), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return all_reduce(self.experts(hidden, experts, weights.to(hidden.dtype)), self.tp)
