"""The binding of ``packed_linear.c``: a few rows times a weight oneDNN has packed.

float32 and bfloat16 weights: oneDNN packs each in its own layout (bfloat16 with K in
pairs), and the kernel has a reader for each; the rows are float32 either way (a bfloat16
input widens exactly) and the output is rounded to the input's dtype here. Weight-only
int8 panels (``quantized_linear.c``, built by ``panel_packing.int8_panels``) are read the
same way, with their per-column scales.

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

from vlmd.layers.cpu.library import load_functions

PANEL_WIDTHS = (64, 32, 128, 16)  # tried in this order; the kernel takes multiples of its chunk
_ERRORS = {-1: "a panel width the kernel cannot tile", -2: "padded K shorter than K", -3: "a size or stride",
           -4: "int8 panels without their scales", -6: "no memory for the rows rounded to bfloat16"}
_POINTER, _INT, _WIDE = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64  # bound_product's arguments, converted once
# Signatures: kernels.h. The *_chunk functions give the columns one tile computes.
_NAMES = ("vlmd_packed_linear", "vlmd_packed_layout_matches", "vlmd_packed_linear_chunk", "vlmd_packed_linear_bf16",
          "vlmd_packed_bf16_layout_matches", "vlmd_packed_linear_bf16_chunk", "vlmd_packed_linear_int8",
          "vlmd_packed_linear_int8_chunk", "vlmd_packed_bf16_dot")
# Per weight dtype: (product, layout check, columns a tile computes, bytes an element).
_FUNCTIONS = {torch.float32: ("vlmd_packed_linear", "vlmd_packed_layout_matches", "vlmd_packed_linear_chunk", 4),
              torch.bfloat16: ("vlmd_packed_linear_bf16", "vlmd_packed_bf16_layout_matches",
                               "vlmd_packed_linear_bf16_chunk", 2)}


# Whether this torch hands out a packed tensor's memory (read once: a per-call lookup on
# torch.ops costs about a microsecond).
_TORCH_EXPOSES_PACKED = hasattr(torch.ops.mkldnn, "data_ptr") and hasattr(torch.ops.mkldnn, "_nbytes")


def _kernel() -> dict | None:
    """The bound functions, or None where no kernel library is loaded or torch cannot hand
    it a packed tensor's memory."""
    return load_functions(_NAMES) if _TORCH_EXPOSES_PACKED else None


def available() -> bool:
    return _kernel() is not None


def bf16_dot_products(wanted: bool | None = None) -> bool:
    """Whether bfloat16 panels are multiplied by AVX512-BF16's dot product at 2 or more rows
    (rows rounded to bfloat16 first; ``packed_linear.c`` says why) rather than widened to
    float32 (one row always is). The host
    decides by default: yes where it has the instruction and the loaded variant built it.
    ``wanted`` sets it (True only where it can be), for a test or bench comparing the two;
    returns the setting then in force (False where no kernel library is loaded)."""
    kernel = _kernel()
    if kernel is None:
        return False
    return bool(kernel["vlmd_packed_bf16_dot"](-1 if wanted is None else int(wanted)))


@dataclass(frozen=True)
class PackedPanels:
    """One packed weight as the kernel reads it: W [N, K] stored at ``address`` as
    ceil(N / panel_width) panels of ``panel_width`` columns, K-major (bfloat16: K in
    pairs), K padded to ``padded_k``; int8: ``scale`` the address of its float32 [N]
    scales."""

    address: int
    out_features: int
    in_features: int
    panel_width: int
    padded_k: int
    dtype: torch.dtype = torch.float32
    scale: int = 0

    def arguments(self) -> tuple:
        """(the product function's name, its leading weight arguments) for this dtype."""
        if self.dtype == torch.int8:
            return "vlmd_packed_linear_int8", (self.address, self.scale)
        return _FUNCTIONS[self.dtype][0], (self.address,)

    @classmethod
    def of(cls, weight: torch.Tensor, packed: torch.Tensor) -> "PackedPanels | None":
        """The layout ``packed`` holds ``weight`` in, verified on its values, or None (not
        float32 or bfloat16, not on the CPU, no kernel here, or a layout the kernel cannot
        read)."""
        kernel = _kernel()
        if kernel is None or weight.dtype not in _FUNCTIONS or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if not getattr(packed, "is_mkldnn", False) or packed.dtype != weight.dtype:
            return None
        _, check, chunk, element = _FUNCTIONS[weight.dtype]
        plain = weight.detach().contiguous()
        n_len, k_len = plain.shape
        elements = torch.ops.mkldnn._nbytes(packed) // element
        address = torch.ops.mkldnn.data_ptr(packed)
        for width in PANEL_WIDTHS:
            if width % kernel[chunk]():
                continue
            padded_n = -(-n_len // width) * width
            if elements % padded_n or elements // padded_n < k_len:
                continue
            panels = cls(address, n_len, k_len, width, elements // padded_n, weight.dtype)
            if kernel[check](plain.data_ptr(), address, n_len, k_len, width, panels.padded_k, torch.get_num_threads()):
                return panels
        return None


def bound_product(x: torch.Tensor, panels: PackedPanels):
    """A call of the kernel computing ``x @ W.T`` (``x`` float32, contiguous [rows, K]) into
    an output it holds, its arguments converted once: what a caller that runs the kernel
    itself (``decoder_step.c``) pays per product, plus one ctypes call. For timing such a
    caller's products."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native packed-linear kernel library is not loaded here")
    rows, k_len, n_len = x.shape[0], panels.in_features, panels.out_features
    if x.shape != (rows, k_len) or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"need a contiguous float32 [rows, {k_len}], got {tuple(x.shape)} {x.dtype}")
    out = torch.empty(rows, n_len)
    name, weight = panels.arguments()
    arguments = (_POINTER(x.data_ptr()), _WIDE(k_len), *map(_POINTER, weight), _WIDE(panels.panel_width),
                 _WIDE(panels.padded_k), None, _POINTER(out.data_ptr()), _WIDE(n_len), _WIDE(rows), _WIDE(n_len),
                 _WIDE(k_len), _INT(torch.get_num_threads()))
    function = kernel[name]

    def call() -> torch.Tensor:
        code = function(*arguments)
        if code != 0:
            raise ValueError(f"native packed linear cannot serve this product: {_ERRORS.get(code, code)}")
        return out

    call.keep = (x, out)  # the addresses above stay valid while the call lives
    return call


def packed_linear(x: torch.Tensor, panels: PackedPanels, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` [..., K], in ``x``'s dtype (float32 for an integer ``x``)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native packed-linear kernel library is not loaded here")
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
        row_stride = rows.stride(0) if rows.shape[0] > 1 else k_len
        name, weight = panels.arguments()
        code = kernel[name](
            rows.data_ptr(), row_stride, *weight, panels.panel_width, panels.padded_k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n_len, rows.shape[0], n_len, k_len,
            torch.get_num_threads())
        if code != 0:
            raise ValueError(f"native packed linear cannot serve this product: {_ERRORS.get(code, code)}")
    if x.dtype.is_floating_point and x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], n_len)
