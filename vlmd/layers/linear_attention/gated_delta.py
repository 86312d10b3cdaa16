"""Gated DeltaNet's operations in torch (Qwen3.5's linear attention), over one sequence's tokens.

A Gated DeltaNet layer keeps, per sequence, a fixed-size state instead of a KV cache:
- its causal depthwise convolution's last ``K - 1`` inputs per channel, ``[C, K - 1]``;
- its delta-rule matrix per value head, ``[Hv, Dk, Dv]``: each token decays it by
  ``exp(g)``, then writes ``beta * (v - S^T k)`` along ``k`` (the delta rule: only what the
  state does not already predict for ``k`` is written), and reads ``S^T q``.
Both are float32 whatever the model's dtype (the reference keeps its recurrent state in
float32), and every function here computes in float32 and returns outputs in the input's dtype.

A prompt runs the chunked form of the rule (``chunk_gated_delta_rule``: matmuls within
chunks of 64 tokens, one state update per chunk); a decode runs one recurrent step per
sequence, batched (``recurrent_gated_delta_step``). Both equal the token-by-token recurrence
(transformers' ``torch_recurrent_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=True``)
up to float32 rounding; tests/test_gated_delta.py checks them against transformers.

q and k have ``Hk`` heads, v ``Hv``, a multiple of ``Hk``: value head ``h`` reads key head
``h // (Hv // Hk)`` (consecutive value heads share a key head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The l2 norm's epsilon, inside the square root (the reference's and fla's kernels).
L2NORM_EPS = 1e-6


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens ``x`` [T, C] through the causal depthwise convolution
    (``weight`` [C, K]) after the ``K - 1`` inputs of ``state`` [C, K - 1] (None: a fresh
    sequence, zeros), then SiLU. Returns (y [T, C] in x's dtype, the new state [C, K - 1]
    float32: the last K - 1 inputs, older state included where T < K - 1)."""
    tokens, channels = x.shape
    kernel = weight.shape[1]
    if state is None:
        state = x.new_zeros(channels, kernel - 1, dtype=torch.float32)
    window = torch.cat([state.to(torch.float32), x.t().to(torch.float32)], dim=1)  # [C, K - 1 + T]
    y = F.conv1d(window.unsqueeze(0), weight.to(torch.float32).unsqueeze(1),
                 None if bias is None else bias.to(torch.float32), groups=channels)  # [1, C, T]
    y = F.silu(y[0].t())
    return y.to(x.dtype), window[:, tokens:].contiguous()


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of N sequences, ``x`` [N, C], through the convolution after
    each one's state ``states`` [N, C, K - 1]. Returns (y [N, C] with SiLU, new states
    [N, C, K - 1] float32)."""
    window = torch.cat([states.to(torch.float32), x.to(torch.float32).unsqueeze(-1)], dim=-1)  # [N, C, K]
    y = (window * weight.to(torch.float32)).sum(-1)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return F.silu(y).to(x.dtype), window[..., 1:].contiguous()


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the reference's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _queries_keys(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k float32, l2-normalised, q scaled by Dk^-0.5, each key head repeated for its
    value heads: [..., Hv, Dk]."""
    key_heads, key_dim = k.shape[-2:]
    if value_heads % key_heads:
        raise ValueError(f"{value_heads} value heads are not a multiple of {key_heads} key heads")
    q = l2_normalize(q.to(torch.float32)) * key_dim**-0.5
    k = l2_normalize(k.to(torch.float32))
    if value_heads != key_heads:
        q = q.repeat_interleave(value_heads // key_heads, dim=-2)
        k = k.repeat_interleave(value_heads // key_heads, dim=-2)
    return q, k


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's T tokens, chunk by chunk.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] (log decay, <= 0); beta [T, Hv];
    ``initial_state`` [Hv, Dk, Dv] (None: zeros). Returns (out [T, Hv, Dv] in v's dtype,
    final state [Hv, Dk, Dv] float32).

    Within a chunk of L tokens with cumulative log decay c (c_i = g_1 + ... + g_i) the
    recurrence's writes u_i = beta_i (v_i - S_{i-1}^T k_i) solve a unit lower-triangular
    system (the WY / UT form): u_i + sum_{j<i} beta_i e^{c_i - c_j} (k_i . k_j) u_j
    = beta_i v_i - beta_i e^{c_i} S_0^T k_i. So u = U - W S_0 with U and W solved once for
    every chunk together; then each chunk in turn reads
    out_i = e^{c_i} S_0^T q_i + sum_{j<=i} e^{c_i - c_j} (q_i . k_j) u_j and leaves
    S = e^{c_L} S_0 + sum_j e^{c_L - c_j} k_j u_j^T: one step of Python per chunk, not per token.
    """
    tokens, value_heads, value_dim = v.shape
    key_dim = k.shape[-1]
    out_dtype = v.dtype
    q, k = _queries_keys(q, k, value_heads)
    # Heads first, [H, T, D]; zero tokens pad the last chunk: with k = 0 and g = 0 they
    # neither write nor decay the state, and their outputs are dropped.
    pad = -tokens % chunk_size
    chunks = (tokens + pad) // chunk_size

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(value_heads, chunks, chunk_size, *x.shape[2:])

    q, k, v = heads_first(q), heads_first(k), heads_first(v)  # [H, N, L, D]
    g, beta = heads_first(g), heads_first(beta)  # [H, N, L]

    decay = g.cumsum(-1)  # c: [H, N, L]
    # e^{c_i - c_j} for j <= i, 0 above the diagonal (masked before exp: no overflow).
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay  # its diagonal is ignored: unit triangular
    writes = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    state_reads = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1),
                                                upper=False, unitriangular=True)
    attend = (q @ k.transpose(-1, -2)) * pair_decay  # [H, N, L, L], diagonal included
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    if initial_state is None:
        state = v.new_zeros(value_heads, key_dim, value_dim)
    else:
        state = initial_state.to(torch.float32)
    out = torch.empty_like(v)
    for chunk in range(chunks):
        corrected = writes[:, chunk] - state_reads[:, chunk] @ state  # u: [H, L, Dv]
        out[:, chunk] = q_decayed[:, chunk] @ state + attend[:, chunk] @ corrected
        state = state * chunk_decay[:, chunk] + k_to_end[:, chunk].transpose(-1, -2) @ corrected
    out = out.reshape(value_heads, chunks * chunk_size, value_dim)[:, :tokens]
    return out.transpose(0, 1).to(out_dtype), state


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences through the rule: q, k [N, Hk, Dk]; v [N, Hv, Dv];
    g, beta [N, Hv]; ``states`` [N, Hv, Dk, Dv]. Returns (out [N, Hv, Dv] in v's dtype, new
    states float32)."""
    q, k = _queries_keys(q, k, v.shape[1])
    states = states.to(torch.float32) * g.to(torch.float32).exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ states).squeeze(-2)  # S^T k: [N, Hv, Dv]
    write = (v.to(torch.float32) - predicted) * beta.to(torch.float32).unsqueeze(-1)
    states = states + k.unsqueeze(-1) * write.unsqueeze(-2)
    out = (q.unsqueeze(-2) @ states).squeeze(-2)
    return out.to(v.dtype), states


def gate_decay(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The rule's log decay g = -exp(A_log) * softplus(a + dt_bias), float32 (in half
    precision exp(A_log) could overflow to inf)."""
    return -a_log.to(torch.float32).exp() * F.softplus(a.to(torch.float32) + dt_bias.to(torch.float32))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [..., D], times ``weight``, times SiLU(gate): the norm in
    float32, rounded to x's dtype before the weight, the gate in float32, as the reference's
    ``Qwen3_5RMSNormGated``."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.to(torch.float32))).to(dtype)


class GatedRMSNorm(nn.Module):
    """``gated_rms_norm`` with its weight (``norm.weight`` of a checkpoint's layer)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
