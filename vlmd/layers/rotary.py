"""Rotary position embeddings with the scaling schemes Llama-family configs use."""

from __future__ import annotations

import math

import torch

from vlmd.layers.cpu import elementwise


def rope_parameters(config) -> tuple[float, dict]:
    """(theta, scaling dict) from a transformers 5 ``rope_parameters`` or 4.x fields."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
        return theta, params
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    return float(getattr(config, "rope_theta", 10000.0)), scaling


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention (cos/sin) scale for a rope type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", "mrope"):  # transformers 4.x spells M-RoPE's plain frequencies "mrope"
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if rope_type == "proportional":
        return _proportional_frequencies(head_dim, theta, scaling), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, proportional)")


def _proportional_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Gemma 4's full layers (transformers' ``_compute_proportional_rope_parameters``): the
    first ``partial_rotary_factor`` of each half rotates at frequencies spread over the whole
    head size; the rest do not rotate (frequency 0: cos 1, sin 0)."""
    rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = torch.cat((1.0 / (theta**exponents), torch.zeros(head_dim // 2 - rotated, dtype=torch.float32)))
    return inv_freq / float(scaling.get("factor", 1.0))


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by position (the "rotate half" layout)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        inv_freq, attention_scale = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        table = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", table.cos() * attention_scale, persistent=False)
        self.register_buffer("sin", table.sin() * attention_scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``positions`` shaped to broadcast over [T, heads, head_dim]."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): the rotary half-dims are split into sections, in order time,
    height, width (``mrope_section``, summing to head_dim / 2); each section rotates by its
    own row of a ``[3, T]`` position tensor. The same split applies to both halves of the
    "rotate half" layout, as transformers' ``apply_multimodal_rotary_pos_emb`` does. Plain
    ``[T]`` positions mean (p, p, p), which is ordinary RoPE.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict, section: list[int],
                 interleaved: bool = False):
        """``interleaved``: the rows take turns column by column (t, h, w, t, h, w, ...) while
        each has columns left in its section, the rest of the columns time's, as
        transformers' ``recomposition_frequencies`` lays them out; else contiguous sections."""
        super().__init__(head_dim, max_positions, theta, scaling)
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must be 3 sizes summing to head_dim / 2 = {head_dim // 2}")
        if interleaved:
            column = torch.arange(head_dim // 2)
            row_of_half = torch.zeros(head_dim // 2, dtype=torch.long)
            for row in (1, 2):  # height takes columns 1, 4, 7, ... below 3 * its section; width 2, 5, 8, ...
                row_of_half[(column % 3 == row) & (column < 3 * section[row])] = row
        else:
            row_of_half = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.register_buffer("row_of_column", torch.cat((row_of_half, row_of_half)), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        # Look up all three rows ([3, T, D]), then each column keeps the row of its section.
        index = self.row_of_column.expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index)[0]
        sin = self.sin[positions].gather(0, index)[0]
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def mrope_section(config) -> list[int] | None:
    """``mrope_section`` from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None) or {}
        if params.get("mrope_section"):
            return [int(size) for size in params["mrope_section"]]
    return None


def rotary_for(config, head_dim: int) -> RotaryEmbedding:
    """The rotary embedding a text config asks for: M-RoPE where it names sections
    (Qwen2-VL), else plain RoPE with its theta and scaling."""
    theta, scaling = rope_parameters(config)
    section = mrope_section(config)
    if section is not None:
        interleaved = bool(scaling.get("mrope_interleaved", False))
        return MRotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling, section, interleaved)
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused q/k/v product's rows [T, (H + 2 Hkv) * D] split into q [T, H, D], k and v
    [T, Hkv, D], with rotate-half rotary applied to q and k; ``cos``/``sin`` [T, 1, D].
    Float32 and bfloat16 CPU rows take the CPU room's kernel, which rotates q's and k's
    adjacent heads in one pass in place (``layers/cpu/elementwise.c``; bfloat16 rounded where
    torch's ops round, so the same bits); anything else torch ops, with the same result to
    float rounding."""
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if elementwise.serves(qkv, cos[:, 0], sin[:, 0]) or elementwise.serves_bf16(qkv, cos[:, 0], sin[:, 0]):
        elementwise.rotary_(qkv, num_heads + num_kv_heads, head_dim, cos[:, 0], sin[:, 0])
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, num_heads, head_dim)
        k = k.view(tokens, num_kv_heads, head_dim)
    else:
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(q.view(tokens, num_heads, head_dim), cos, sin)
        k = apply_rotary(k.view(tokens, num_kv_heads, head_dim), cos, sin)
    return q, k, v.view(tokens, num_kv_heads, head_dim)
