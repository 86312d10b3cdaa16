"""Rotary position embeddings with the scaling schemes Llama-family configs use."""

from __future__ import annotations

import math

import torch


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
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
