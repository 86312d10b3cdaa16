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
    float32: the last K - 1 inputs, older state included where T < K - 1).

    Token-major, K multiply-adds over [T, C] rows: torch's depthwise conv1d (oneDNN, on
    [C, T] copies) took 3x the CPU time over a 512-token prompt of 2048 channels."""
    tokens, channels = x.shape
    kernel = weight.shape[1]
    window = x.new_empty(kernel - 1 + tokens, channels, dtype=torch.float32)  # [K - 1 + T, C]
    if state is None:
        window[:kernel - 1].zero_()
    else:
        window[:kernel - 1] = state.t()
    window[kernel - 1:] = x
    weight = weight.to(torch.float32)
    # y_t = sum_j weight[:, j] * input_{t - (K - 1) + j}: tap K - 1 reads the token itself.
    y = window[:tokens] * weight[:, 0]
    for tap in range(1, kernel):
        y.addcmul_(window[tap:tap + tokens], weight[:, tap])
    if bias is not None:
        y += bias.to(torch.float32)
    return F.silu(y, inplace=True).to(x.dtype), window[tokens:].t().contiguous()


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


def _group(key_heads: int, value_heads: int) -> int:
    """Value heads per key head."""
    if value_heads % key_heads:
        raise ValueError(f"{value_heads} value heads are not a multiple of {key_heads} key heads")
    return value_heads // key_heads


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
    The [L, L] products q k^T and k k^T are made once per key head, not per value head.
    """
    tokens, value_heads, value_dim = v.shape
    key_heads, key_dim = k.shape[1:]
    group = _group(key_heads, value_heads)
    out_dtype = v.dtype
    q = l2_normalize(q.to(torch.float32)) * key_dim**-0.5
    k = l2_normalize(k.to(torch.float32))
    # Chunk-major, [N, H, L, ...]: each chunk's operands are contiguous blocks for the loop's
    # batched products. Zero tokens pad the last chunk: with k = 0 and g = 0 they neither
    # write nor decay the state; their outputs are dropped.
    chunks = -(-tokens // chunk_size)
    pad = chunks * chunk_size - tokens

    def chunked(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return x.view(chunks, chunk_size, *x.shape[1:]).transpose(1, 2).contiguous()

    q, k = chunked(q), chunked(k)  # [N, Hk, L, Dk]
    # Value heads as [Hk, G]: value head h reads key head h // G.
    v = chunked(v).view(chunks, key_heads, group, chunk_size, value_dim)
    g = chunked(g).view(chunks, key_heads, group, chunk_size)
    beta = chunked(beta).view(chunks, key_heads, group, chunk_size)

    decay = g.cumsum(-1)  # c
    decay_exp = decay.exp()
    # e^{c_i - c_j} for j <= i, 0 above the diagonal (masked before exp: no overflow).
    above = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).triu(1)
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill_(above, float("-inf")).exp_()
    # beta_i e^{c_i - c_j} (k_i . k_j); its diagonal is ignored: the system is unit triangular.
    system = (k @ k.transpose(-1, -2)).unsqueeze(2) * pair_decay * beta.unsqueeze(-1)
    # Its inverse once, then products: a triangular solve per right-hand side column is
    # slower than a matrix product (64 systems of 64, 256 columns of v and k: 6.0 ms of CPU
    # against 3.2 for the inverse and its products, this host).
    eye = torch.eye(chunk_size, dtype=torch.float32, device=v.device)
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    writes = inverse @ (v * beta.unsqueeze(-1))  # U
    state_reads = inverse @ (k.unsqueeze(2) * (beta * decay_exp).unsqueeze(-1))  # W
    attend = (q @ k.transpose(-1, -2)).unsqueeze(2) * pair_decay  # diagonal included
    q_decayed = q.unsqueeze(2) * decay_exp.unsqueeze(-1)
    k_to_end = k.unsqueeze(2) * (decay[..., -1:] - decay).exp().unsqueeze(-1)

    def per_value_head(x: torch.Tensor) -> torch.Tensor:  # [N, Hk, G, ...] -> [N, Hv, ...]
        return x.view(chunks, value_heads, *x.shape[3:])

    writes, state_reads, attend = per_value_head(writes), per_value_head(state_reads), per_value_head(attend)
    q_decayed, k_to_end = per_value_head(q_decayed), per_value_head(k_to_end)
    chunk_decay = per_value_head(decay_exp[..., -1:]).unsqueeze(-1)  # [N, Hv, 1, 1]

    if initial_state is None:
        state = v.new_zeros(value_heads, key_dim, value_dim)
    else:
        state = initial_state.to(torch.float32)
    out = v.new_empty(chunks, value_heads, chunk_size, value_dim)
    for chunk in range(chunks):
        corrected = torch.baddbmm(writes[chunk], state_reads[chunk], state, alpha=-1)  # u: [Hv, L, Dv]
        torch.baddbmm(q_decayed[chunk] @ state, attend[chunk], corrected, out=out[chunk])
        state = torch.baddbmm(state * chunk_decay[chunk], k_to_end[chunk].transpose(-1, -2), corrected)
    out = out.transpose(1, 2).reshape(chunks * chunk_size, value_heads, value_dim)[:tokens]
    return out.to(out_dtype), state


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences through the rule: q, k [N, Hk, Dk]; v [N, Hv, Dv];
    g, beta [N, Hv]; ``states`` [N, Hv, Dk, Dv] (left as they are). Returns (out [N, Hv, Dv]
    in v's dtype, new states float32).

    The states are megabytes (8 sequences of 8 heads of 128 x 128: 4 MiB): the decayed copy
    is the one new tensor of that size, updated in place after, since each fresh one costs
    more than its arithmetic (a pass over memory, and page faults when first touched)."""
    rows, value_heads, value_dim = v.shape
    key_dim = k.shape[-1]
    group = _group(k.shape[1], value_heads)
    q = l2_normalize(q.to(torch.float32)) * key_dim**-0.5
    k = l2_normalize(k.to(torch.float32))
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    states = (states.to(torch.float32) * g.to(torch.float32).exp()[..., None, None]).contiguous()
    predicted = (k.unsqueeze(-2) @ states).squeeze(-2)  # S^T k: [N, Hv, Dv]
    write = (v.to(torch.float32) - predicted) * beta.to(torch.float32).unsqueeze(-1)
    flat = states.view(rows * value_heads, key_dim, value_dim)
    flat.baddbmm_(k.reshape(-1, key_dim, 1), write.reshape(-1, 1, value_dim))  # += k write^T
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
