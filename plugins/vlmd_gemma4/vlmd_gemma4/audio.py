"""Gemma 4's audio tower (E2B / E4B): a USM-style conformer over log-mel frames, and the
embedder that projects its output into the decoder, as transformers 5.25 computes them
(``Gemma4AudioModel``, ``Gemma4MultimodalEmbedder`` in ``modeling_gemma4.py``), on the core's
linear seam (``ReplicatedLinear``) with the family's RMSNorm and the core's activations.

- *Subsampling*: two 3 x 3 stride-2 convolutions over (time, mel bins), each followed by a
  LayerNorm over its channels (no bias) and a ReLU; the (bins / 4) x channels of each of the
  time / 4 positions projected to the tower's width. One soft token is 40 ms of audio.
- *Conformer layers*: half-step feed-forward, chunked local self-attention, a light
  convolution (GLU, causal depthwise conv, norm, activation), half-step feed-forward, norm.
  Every linear but the relative-position one clamps its input and output to bounds the
  checkpoint carries (``input_min`` .. ``output_max``).
- *Attention*: transformers cuts the positions into chunks of ``attention_chunk_size``, gives
  each chunk a context of ``attention_context_left - 1`` positions before it, and masks every
  key that is not 0 .. ``attention_context_left - 2`` positions before its query (the
  sliding-window mask it builds) or that lies past the clip. So a position attends to itself
  and the ``attention_context_left - 2`` before it, whatever chunk it is in: that window is
  computed here directly, with the same logits (content term plus a Transformer-XL relative
  term from sinusoidal positions, soft-capped) and the same float32 softmax; a key masked
  there gets weight exactly 0 (``exp(-1e9 - max)``), as it gets none here.
- *One clip at a time, over its own frames*: transformers pads a clip's waveform to a multiple
  of 128 samples and masks the frames that reach into the padding (zeroing their features,
  masking them as keys, dropping their outputs); the processor hands over only the clip's
  valid frames, and with no frame after them the convolutions read the same zeros and no key
  is masked, so the kept outputs are the same numbers.

The dtype: the tower runs in the server's dtype, except float16, where it runs in float32
(``tower_dtype``): its activations are clamped only at the checkpoint's bounds and at
``gradient_clipping`` (1e10), so float16's 65,504 is not a bound the checkpoint respects (the
failure vLLM #40290 shows for the vision tower); bfloat16 has float32's range. Attention
logits, softmax and every norm are float32 in any dtype, as in transformers. Its output is
cast to the decoder's dtype before it is cached (docs/decisions.md D113).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlmd.layers.activation import ACTIVATIONS, check_activation
from vlmd.layers.linear import ReplicatedLinear
from vlmd_gemma4.decoder import Gemma4RMSNorm


def tower_dtype(server_dtype: torch.dtype) -> torch.dtype:
    """The dtype the audio tower runs in under a server of ``server_dtype`` (module docstring)."""
    return torch.float32 if server_dtype == torch.float16 else server_dtype


def unsupported(audio_config) -> str | None:
    """What of this audio tower is not computed here (None: all of it)."""
    if int(audio_config.attention_context_right) != 0:
        return "attention_context_right != 0 (audio attention that looks ahead)"
    if len(audio_config.subsampling_conv_channels) != 2:
        return "a subsampling stack of other than two convolutions"
    return None


class ClippableLinear(nn.Module):
    """A linear whose input and output are clamped to the checkpoint's bounds (transformers'
    ``Gemma4ClippableLinear``; the bounds are infinite where the config turns clipping off)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.linear = ReplicatedLinear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name, value in (("input_min", -math.inf), ("input_max", math.inf),
                                ("output_min", -math.inf), ("output_max", math.inf)):
                self.register_buffer(name, torch.tensor(value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        if self.clipped:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


def _clamp(x: torch.Tensor, bound: float) -> torch.Tensor:
    """transformers' "gradient clipping" of activations, at most the dtype's range."""
    bound = min(bound, torch.finfo(x.dtype).max)
    return torch.clamp(x, -bound, bound)


class SubsampleLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, elementwise_affine=True, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, C, time, bins]
        x = self.conv(x)
        return F.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


class SubsampleProjection(nn.Module):
    def __init__(self, config):
        super().__init__()
        first, second = config.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, first, config.rms_norm_eps)
        self.layer1 = SubsampleLayer(first, second, config.rms_norm_eps)
        # transformers sizes it as (first channels / 4) x second: the mel bins after two halvings
        # where the bins number the first convolution's channels (128 in every checkpoint).
        self.input_proj_linear = ReplicatedLinear((first // 4) * second, config.hidden_size, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [frames, bins] -> [frames / 4, hidden]
        x = self.layer1(self.layer0(features[None, None]))
        _, channels, positions, bins = x.shape
        return self.input_proj_linear(x.permute(0, 2, 3, 1).reshape(positions, bins * channels))


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        clipped, hidden = config.use_clipped_linears, config.hidden_size
        self.ffw_layer_1 = ClippableLinear(hidden, hidden * 4, clipped)
        self.ffw_layer_2 = ClippableLinear(hidden * 4, hidden, clipped)
        self.pre_layer_norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        self.post_layer_norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        self.activation = ACTIVATIONS[check_activation(config.hidden_act)]
        self.clip = float(config.gradient_clipping)
        self.residual_weight = float(config.residual_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layer_norm(_clamp(x, self.clip))
        hidden = self.ffw_layer_2(self.activation(self.ffw_layer_1(hidden)))
        return x + self.post_layer_norm(_clamp(hidden, self.clip)) * self.residual_weight


class LocalAttention(nn.Module):
    """Each position over itself and the ``window - 1`` before it (module docstring)."""

    def __init__(self, config):
        super().__init__()
        hidden, clipped = config.hidden_size, config.use_clipped_linears
        self.num_heads = int(config.num_attention_heads)
        self.head_dim = hidden // self.num_heads
        self.window = int(config.attention_context_left) - 1  # keys 0 .. window - 1 positions back
        self.max_past = int(config.attention_context_left) - 1  # transformers' context before a chunk
        context = int(config.attention_chunk_size) + self.max_past + int(config.attention_context_right)
        self.num_relative = context // 2 + 1  # sinusoids for distances context // 2 .. 0
        self.q_scale = (self.head_dim ** -0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.softcap = float(config.attention_logit_cap)
        self.q_proj = ClippableLinear(hidden, hidden, clipped)
        self.k_proj = ClippableLinear(hidden, hidden, clipped)
        self.v_proj = ClippableLinear(hidden, hidden, clipped)
        self.post = ClippableLinear(hidden, hidden, clipped)
        self.relative_k_proj = ReplicatedLinear(hidden, hidden, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))

    def relative_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """[window, heads, head_dim]: the relative-position key of each distance 0 .. window - 1.
        transformers' table runs over distances context // 2 down to 0 and its shift pairs a key
        ``d`` positions back with row ``max_past - d``, i.e. distance ``context // 2 - max_past + d``."""
        rows = self.relative_k_proj(positions).view(self.num_relative, self.num_heads, self.head_dim)
        picked = torch.zeros(self.window, self.num_heads, self.head_dim, dtype=torch.float32, device=rows.device)
        for distance in range(self.window):
            row = self.max_past - distance
            if 0 <= row < self.num_relative:
                picked[distance] = rows[row].float()
        return picked

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        length = x.shape[0]
        heads, dim, window = self.num_heads, self.head_dim, self.window
        q = self.q_proj(x).float().view(length, heads, dim) * (self.q_scale * F.softplus(self.per_dim_scale.float()))
        k = self.k_proj(x).float().view(length, heads, dim) * self.k_scale
        v = self.v_proj(x).float().view(length, heads, dim)
        # Keys and values window - 1 .. 0 positions back: slot w is distance window - 1 - w.
        k_windows = F.pad(k, (0, 0, 0, 0, window - 1, 0)).unfold(0, window, 1)  # [T, heads, dim, window]
        v_windows = F.pad(v, (0, 0, 0, 0, window - 1, 0)).unfold(0, window, 1)
        content = torch.einsum("thd,thdw->thw", q, k_windows)
        relative = torch.einsum("thd,whd->thw", q, self.relative_keys(positions).flip(0))
        logits = torch.tanh((content + relative) / self.softcap) * self.softcap
        # Slots before the clip's start (distance past the position itself) hold no key.
        slot = torch.arange(window, device=x.device)
        before_start = (torch.arange(length, device=x.device)[:, None] - (window - 1) + slot[None, :]) < 0
        logits = logits.masked_fill(before_start[:, None, :], float("-inf"))
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
        out = torch.einsum("thw,thdw->thd", weights, v_windows).reshape(length, heads * dim)
        return self.post(out.to(x.dtype))


class LightConv(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, clipped = config.hidden_size, config.use_clipped_linears
        self.linear_start = ClippableLinear(hidden, hidden * 2, clipped)
        self.linear_end = ClippableLinear(hidden, hidden, clipped)
        self.kernel_size = int(config.conv_kernel_size)
        self.depthwise_conv1d = nn.Conv1d(hidden, hidden, self.kernel_size, groups=hidden, bias=False)
        self.pre_layer_norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        self.conv_norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        self.activation = ACTIVATIONS[check_activation(config.hidden_act)]
        self.clip = float(config.gradient_clipping)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        # Causal: each position sees itself and the kernel_size - 1 before it.
        hidden = self.depthwise_conv1d(F.pad(hidden.T[None], (self.kernel_size - 1, 0)))[0].T
        hidden = self.activation(self.conv_norm(_clamp(hidden, self.clip)))
        return x + self.linear_end(hidden)


class ConformerLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.feed_forward1 = FeedForward(config)
        self.feed_forward2 = FeedForward(config)
        self.self_attn = LocalAttention(config)
        self.lconv1d = LightConv(config)
        self.norm_pre_attn = Gemma4RMSNorm(hidden, eps)
        self.norm_post_attn = Gemma4RMSNorm(hidden, eps)
        self.norm_out = Gemma4RMSNorm(hidden, eps)
        self.clip = float(config.gradient_clipping)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.feed_forward1(x)
        attended = self.self_attn(self.norm_pre_attn(_clamp(x, self.clip)), positions)
        x = x + self.norm_post_attn(_clamp(attended, self.clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clamp(x, self.clip))


class Gemma4AudioTower(nn.Module):
    """Log-mel frames [frames, bins] -> the tower's vectors [soft tokens, output_proj_dims]."""

    def __init__(self, config):
        super().__init__()
        refused = unsupported(config)
        if refused is not None:
            raise ValueError(f"this Gemma 4 audio tower is not supported: {refused}")
        self.subsample_conv_projection = SubsampleProjection(config)
        self.layers = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_hidden_layers))
        self.output_proj = ReplicatedLinear(config.hidden_size, config.output_proj_dims, bias=True)
        # transformers' Gemma4AudioRelPositionalEncoding: [sin | cos] of distances context // 2 .. 0.
        half = config.hidden_size // 2
        increment = math.log(10000.0) / max(half - 1, 1)
        self.register_buffer("inv_timescales", torch.exp(torch.arange(half) * -increment), persistent=False)
        self.num_relative = self.layers[0].self_attn.num_relative if len(self.layers) else 1

    def relative_positions(self, dtype: torch.dtype, device) -> torch.Tensor:
        distances = torch.arange(self.num_relative - 1, -1, -1, device=device)[:, None]
        scaled = distances * self.inv_timescales.to(device)[None, :]
        return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1).to(dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        dtype = self.output_proj.weight.dtype
        x = self.subsample_conv_projection(features.to(dtype))
        positions = self.relative_positions(dtype, x.device)
        for layer in self.layers:
            x = layer(x, positions)
        return self.output_proj(x)


class Gemma4AudioEmbedder(nn.Module):
    """transformers' ``Gemma4MultimodalEmbedder`` for audio: an unscaled RMSNorm, then a
    projection from the tower's output width into the decoder's."""

    def __init__(self, audio_config, text_config):
        super().__init__()
        width = int(audio_config.output_proj_dims)
        self.embedding_pre_projection_norm = Gemma4RMSNorm(width, audio_config.rms_norm_eps, with_scale=False)
        self.embedding_projection = ReplicatedLinear(width, text_config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))
