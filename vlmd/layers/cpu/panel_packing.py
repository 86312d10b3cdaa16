"""Weights laid out as vlmd's panel readers read them, built here rather than by oneDNN.

- ``bfloat16_panels(weight)``: a bfloat16 weight in the K-paired layout of
  ``packed_linear.c``'s bfloat16 reader (the layout oneDNN packs bfloat16 in). Why here:
  oneDNN packs bfloat16 only on hosts with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and the
  reader itself needs neither (it widens by bit masks), so on an AVX2 host a bfloat16
  model's decode products would otherwise stay on ``F.linear``.
- ``int8_panels(weight)``: a float32 weight quantized to weight-only int8, per output
  channel and symmetric (``scale[n] = max_k |W[n, k]| / 127``, ``q = round(W / scale)``),
  in ``quantized_linear.c``'s layout: the float32 panel layout with int8 elements.
  ``dequantized(panels)`` is the float32 weight ``q * scale`` back, for products of many
  rows (a prefill chunk), where a GEMM on a transient float copy beats widening per row.

Each returns the tensors that hold the panels (the caller keeps them: the kernel reads
them by address) and their ``PackedPanels``.
"""

from __future__ import annotations

import torch

from vlmd.layers.cpu import packed_linear as native_linear
from vlmd.layers.cpu.packed_linear import PackedPanels

INT8_MAX = 127  # symmetric: -128 is never used, so a negated weight quantizes to the negated q
_WIDTH = 64  # columns a panel holds (rounded up to a multiple of the kernel's chunk)


def _panel_width(chunk_function: str) -> int:
    kernel = native_linear._kernel()
    if kernel is None:
        raise RuntimeError("the native packed-linear kernel library is not loaded here")
    chunk = kernel[chunk_function]()
    return -(-_WIDTH // chunk) * chunk


def _padded(weight: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    n_len, k_len = weight.shape
    if (rows, columns) == (n_len, k_len):
        return weight.contiguous()
    out = weight.new_zeros(rows, columns)
    out[:n_len, :k_len] = weight
    return out


def bfloat16_panels(weight: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], PackedPanels]:
    """``weight`` [N, K] bfloat16 as (n / B, k / 2, n % B, k % 2) panels, K padded to even."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"bfloat16 panels take a 2-D bfloat16 CPU weight, not {weight.dtype} {tuple(weight.shape)}")
    width = _panel_width("vlmd_packed_linear_bf16_chunk")
    n_len, k_len = weight.shape
    rows, padded_k = -(-n_len // width) * width, k_len + k_len % 2
    plain = _padded(weight.detach(), rows, padded_k)
    panels = plain.view(rows // width, width, padded_k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return (panels,), PackedPanels(panels.data_ptr(), n_len, k_len, width, padded_k, torch.bfloat16)


def int8_panels(weight: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], PackedPanels]:
    """``weight`` [N, K] float32 quantized per output channel: ((q panels (n / B, k, n % B)
    int8, scales [N] float32), their PackedPanels)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"int8 quantization takes a 2-D float32 CPU weight, not {weight.dtype} {tuple(weight.shape)}")
    plain = weight.detach()
    if not bool(torch.isfinite(plain).all()):
        raise ValueError("a weight with NaN or infinite values cannot be quantized to int8")
    width = _panel_width("vlmd_packed_linear_int8_chunk")
    n_len, k_len = plain.shape
    scales = (plain.abs().amax(dim=1) / INT8_MAX).contiguous()
    # A row of zeros keeps scale 0 and q 0 (divided by 1, not by 0).
    q = torch.round(plain / torch.where(scales > 0, scales, 1.0)[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    rows = -(-n_len // width) * width
    panels = _padded(q, rows, k_len).view(rows // width, width, k_len).permute(0, 2, 1).contiguous()
    return (panels, scales), PackedPanels(panels.data_ptr(), n_len, k_len, width, k_len, torch.int8,
                                          scales.data_ptr())


def int8_bytes(out_features: int, in_features: int) -> int:
    """Bytes ``int8_panels`` keeps for a weight [N, K]: the panels (N padded to whole panels:
    every variant's chunk divides 64, so a panel is 64 columns) and a float32 scale a column."""
    return -(-out_features // _WIDTH) * _WIDTH * in_features + 4 * out_features


def dequantized(storage: tuple[torch.Tensor, ...], panels: PackedPanels) -> torch.Tensor:
    """The float32 weight [N, K] that int8 ``panels`` (held by ``storage``) stand for: q * scale."""
    q, scales = storage
    n_len, k_len = panels.out_features, panels.in_features
    plain = q.permute(0, 2, 1).reshape(-1, k_len)[:n_len]
    return plain.to(torch.float32) * scales[:, None]
