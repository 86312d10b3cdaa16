"""The binding of ``packed_linear.c``: a few rows times a weight oneDNN has packed.

``PackedPanels.of(weight, packed)`` says whether the kernel can read this layer's packed
weight: it derives the panel layout from the packed tensor's size and then checks it on the
layer's own values, bit for bit, before the plain weight is dropped. Only a weight that
passes is ever read by the kernel, so a oneDNN version or host that packs differently keeps
oneDNN's own product. ``packed_linear(x, panels, bias)`` is then ``x @ W.T + bias``; the
caller keeps ``packed`` alive as long as ``panels`` (it holds its address).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from vlmd.layers.native.build import load_native

PANEL_WIDTHS = (64, 32, 128, 16)  # tried in this order; the kernel takes multiples of its chunk
_ERRORS = {-1: "a panel width the kernel cannot tile", -2: "padded K shorter than K", -3: "a size or stride"}
_functions: dict | None = None


def _kernel() -> dict:
    global _functions
    if _functions is None:
        library = load_native("packed_linear")
        if library is None or not hasattr(torch.ops.mkldnn, "data_ptr") or not hasattr(torch.ops.mkldnn, "_nbytes"):
            _functions = {}
        else:
            pointer, integer, wide = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
            product = library.vlmd_packed_linear
            product.argtypes = [pointer, wide, pointer, wide, wide, pointer, pointer, wide, wide, wide, wide, integer]
            product.restype = integer
            matches = library.vlmd_packed_layout_matches
            matches.argtypes = [pointer, pointer, wide, wide, wide, wide, integer]
            matches.restype = integer
            library.vlmd_packed_linear_chunk.restype = integer
            _functions = {"product": product, "matches": matches, "chunk": library.vlmd_packed_linear_chunk()}
    return _functions


def available() -> bool:
    return bool(_kernel())


@dataclass(frozen=True)
class PackedPanels:
    """One packed weight as the kernel reads it: W [N, K] stored at ``address`` as
    ceil(N / panel_width) panels of ``panel_width`` columns, K-major, K padded to
    ``padded_k``."""

    address: int
    out_features: int
    in_features: int
    panel_width: int
    padded_k: int

    @classmethod
    def of(cls, weight: torch.Tensor, packed: torch.Tensor) -> "PackedPanels | None":
        """The layout ``packed`` holds ``weight`` in, verified on its values, or None (not
        float32, not on the CPU, no kernel here, or a layout the kernel cannot read)."""
        kernel = _kernel()
        if not kernel or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if not getattr(packed, "is_mkldnn", False) or packed.dtype != torch.float32:
            return None
        plain = weight.detach().contiguous()
        n_len, k_len = plain.shape
        floats = torch.ops.mkldnn._nbytes(packed) // 4
        address = torch.ops.mkldnn.data_ptr(packed)
        for width in PANEL_WIDTHS:
            if width % kernel["chunk"]:
                continue
            padded_n = -(-n_len // width) * width
            if floats % padded_n or floats // padded_n < k_len:
                continue
            panels = cls(address, n_len, k_len, width, floats // padded_n)
            if kernel["matches"](plain.data_ptr(), address, n_len, k_len, width, panels.padded_k,
                                 torch.get_num_threads()):
                return panels
        return None


def packed_linear(x: torch.Tensor, panels: PackedPanels, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for float32 ``x`` [..., K]."""
    kernel = _kernel()
    if not kernel:
        raise RuntimeError("the native packed-linear kernel is not built on this host")
    k_len, n_len = panels.in_features, panels.out_features
    if x.shape[-1] != k_len:
        raise ValueError(f"input has {x.shape[-1]} features, the weight takes {k_len}")
    rows = x.reshape(-1, k_len)
    if rows.dtype != torch.float32 or rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k_len):
        rows = rows.float().contiguous()
    out = torch.empty(rows.shape[0], n_len, dtype=torch.float32)
    if rows.shape[0]:
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        code = kernel["product"](rows.data_ptr(), rows.stride(0) if rows.shape[0] > 1 else k_len, panels.address,
                                 panels.panel_width, panels.padded_k, None if bias is None else bias.data_ptr(),
                                 out.data_ptr(), n_len, rows.shape[0], n_len, k_len, torch.get_num_threads())
        if code != 0:
            raise ValueError(f"native packed linear cannot serve this product: {_ERRORS.get(code, code)}")
    return out.reshape(*x.shape[:-1], n_len)
