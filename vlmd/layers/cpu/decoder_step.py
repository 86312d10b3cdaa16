"""The binding of ``decoder_step.c``: a decode step through every layer of a pre-norm
decoder in one call, with the kernels the layers would call one by one.

``NativeDecoder.of(...)`` takes a model's layers as plain parts (norm weights, packed
products of float32, bfloat16 or int8 panels, float32 or bfloat16 caches) once;
``decoder(embeds, cos, sin, layers)`` runs a step's decodes and returns the final norm's
output. The model keeps its module path for everything else (prefill chunks, other
devices, kernels other than the native ones), and asks ``serves`` per step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from vlmd.layers.cpu import elementwise
from vlmd.layers.cpu import packed_linear as native_linear
from vlmd.layers.cpu import paged_decode as native_decode
from vlmd.layers.cpu.library import load_functions
from vlmd.layers.cpu.paged_decode import DecodeTables

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_STAGES = {-1: "out of memory", -2: "RMSNorm", -3: "a product", -4: "rotary", -5: "attention", -6: "the activation",
           -7: "a slot outside the cache"}


# decoder_step.c's WEIGHT_* and CACHE_* codes.
_WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# decoder_step.c's ACTIVATION_* codes: the gated activations it runs.
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


class _Product(ctypes.Structure):
    _fields_ = [("weight", _P), ("panel_width", _I64), ("padded_k", _I64), ("out_features", _I64),
                ("in_features", _I64), ("bias", _P), ("scale", _P), ("format", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("query_norm", _P), ("key_norm", _P),
                ("post_attention_norm", _P), ("post_feedforward_norm", _P), ("qkv", _Product),
                ("o", _Product), ("gate_up", _Product), ("down", _Product), ("k_cache", _P), ("v_cache", _P),
                ("cache_dtype", _I64), ("window", _I64), ("rotary", _I64)]


class _Decoder(ctypes.Structure):
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("num_slots", _I64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("activation", _I64), ("final_norm", _P), ("layers", ctypes.POINTER(_Layer))]


class _Tables(ctypes.Structure):
    _fields_ = [("slots", _P), ("block_tables", _P), ("context_lens", _P), ("max_blocks", _I32),
                ("num_groups", _I32), ("group_offsets", _P), ("group_members", _P), ("group_tokens", _P)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("cos", _P), ("sin", _P), ("table_stride", _I64), ("rotary_stride", _I64),
                ("block_size", _I32), ("threads", _I32), ("tables", ctypes.POINTER(_Tables)),
                ("layer_tables", _P)]


@dataclass
class LayerTables:
    """Where one layer's decodes read and write this step: its KV group's slots [rows]
    int64 and decode tables (a window group's, for a sliding-window layer)."""

    slots: torch.Tensor
    tables: DecodeTables


_NAMES = ("vlmd_decoder_step",)  # signature: kernels.h


def _kernel():
    functions = load_functions(_NAMES)
    return None if functions is None else functions["vlmd_decoder_step"]


def available() -> bool:
    """Every kernel the step calls is built here."""
    return (_kernel() is not None and native_linear._kernel() is not None and elementwise.available()
            and native_decode.available())


def _float_rows(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_cpu and t.is_contiguous())


@dataclass
class DecoderLayerParts:
    """One layer as the step reads it: float32 norm weights [hidden] (each the factor the
    norm scales by: Gemma's ``1 + w``), the four products' packed weights (and float32
    biases or None), its float32 or bfloat16 caches [slots, kv_heads, head_dim], the
    float32 weights [head_dim] of its query and key head norms (Qwen3's, Gemma 3's; None
    for a layer without them), of its norms after attention and after the MLP (Gemma 3's;
    None), its window (None: the whole context) and its rotary table."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    products: tuple  # (packed_linear.PackedPanels, bias or None) for qkv, o, gate_up, down
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_norm: torch.Tensor | None = None
    key_norm: torch.Tensor | None = None
    post_attention_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None
    window: int | None = None
    rotary: int = 0


class NativeDecoder:
    def __init__(self, decoder: _Decoder, keep: list, rotary_tables: int):
        self._decoder = decoder
        self._keep = keep  # the ctypes arrays and tensors the struct points into
        self.rotary_tables = rotary_tables

    @classmethod
    def of(cls, layers: list[DecoderLayerParts], final_norm: torch.Tensor, *, heads: int, kv_heads: int,
           head_dim: int, intermediate: int, eps: float, scale: float, activation: str = "silu",
           rotary_tables: int = 1) -> "NativeDecoder | None":
        """The decoder as the kernel reads it, or None where a part is not what it reads
        (norms and biases not float32 CPU contiguous, caches of different shapes or dtypes,
        panels of a dtype no reader takes, an activation it does not run, a kernel not
        built). ``rotary_tables``: how many cos/sin tables a step hands (``__call__``)."""
        if not available() or not layers or activation not in ACTIVATIONS:
            return None
        tensors, caches = [final_norm], []
        for part in layers:
            tensors += [part.input_norm, part.post_norm, part.query_norm, part.key_norm, part.post_attention_norm,
                        part.post_feedforward_norm] + [b for _, b in part.products]
            caches += [part.k_cache, part.v_cache]
        if not all(_float_rows(t) for t in tensors):
            return None
        if any(not 0 <= part.rotary < rotary_tables or (part.window is not None and part.window < 1)
               for part in layers):
            return None
        if any(norm is not None and norm.shape != (head_dim,) for part in layers
               for norm in (part.query_norm, part.key_norm)):
            return None
        shape, dtype = caches[0].shape, caches[0].dtype
        if any(c.shape != shape or c.dtype != dtype or not c.is_cpu or not c.is_contiguous() for c in caches):
            return None
        if dtype not in _CACHE_DTYPES or tuple(shape[1:]) != (kv_heads, head_dim):
            return None
        if any(panels.dtype not in _WEIGHT_FORMATS for part in layers for panels, _ in part.products):
            return None
        array = (_Layer * len(layers))()
        for slot, part in zip(array, layers):
            slot.input_norm, slot.post_norm = part.input_norm.data_ptr(), part.post_norm.data_ptr()
            slot.query_norm = None if part.query_norm is None else part.query_norm.data_ptr()
            slot.key_norm = None if part.key_norm is None else part.key_norm.data_ptr()
            slot.post_attention_norm = None if part.post_attention_norm is None else part.post_attention_norm.data_ptr()
            slot.post_feedforward_norm = \
                None if part.post_feedforward_norm is None else part.post_feedforward_norm.data_ptr()
            slot.window, slot.rotary = part.window or 0, part.rotary
            for name, (panels, bias) in zip(("qkv", "o", "gate_up", "down"), part.products):
                setattr(slot, name, _Product(panels.address, panels.panel_width, panels.padded_k, panels.out_features,
                                             panels.in_features, None if bias is None else bias.data_ptr(),
                                             panels.scale or None, _WEIGHT_FORMATS[panels.dtype]))
            slot.k_cache, slot.v_cache = part.k_cache.data_ptr(), part.v_cache.data_ptr()
            slot.cache_dtype = _CACHE_DTYPES[dtype]
        hidden = layers[0].input_norm.shape[0]
        decoder = _Decoder(len(layers), hidden, heads, kv_heads, head_dim, intermediate,
            shape[0], eps, scale, ACTIVATIONS[activation], final_norm.data_ptr(), array)
        return cls(decoder, [array, tensors, caches], rotary_tables)

    def accepts(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers: list[LayerTables]) -> bool:
        """Whether a step's inputs are what the kernel reads: float32 CPU rows, float32
        tables [rows, head_dim] (one rotary table) or [tables, rows, head_dim] of unit-stride
        rows, int64 slots, one per row, and tables for every layer."""
        rows = embeds.shape[0]
        dims = 2 if self.rotary_tables == 1 else 3
        return (embeds.dim() == 2 and _float_rows(embeds) and cos.dim() == dims and cos.dtype == torch.float32
                and sin.dtype == torch.float32 and cos.shape == sin.shape and cos.shape[-2] == rows
                and (dims == 2 or cos.shape[0] == self.rotary_tables)
                and cos.stride(-1) == 1 and sin.stride() == cos.stride() and len(layers) == self._decoder.num_layers
                and all(t.slots.dtype == torch.int64 and t.slots.is_contiguous() and t.slots.shape == (rows,)
                        and t.tables.context_lens.shape == (rows,) for t in layers))

    def __call__(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 layers: list[LayerTables]) -> torch.Tensor:
        """embeds [B, hidden] (one decode a row) -> the final norm's output [B, hidden];
        cos / sin [B, head_dim] (or [tables, B, head_dim]) with rows of unit stride; each
        layer's slots and tables (layers of one KV group and window may share one)."""
        rows = embeds.shape[0]
        if not self.accepts(embeds, cos, sin, layers):
            raise ValueError("the native decoder step takes float32 rows, unit-stride tables and int64 slots")
        out = torch.empty_like(embeds)
        distinct: dict[int, int] = {}
        for entry in layers:
            distinct.setdefault(id(entry), len(distinct))
        tables = (_Tables * len(distinct))()
        for entry in layers:
            t = entry.tables
            tables[distinct[id(entry)]] = _Tables(
                entry.slots.data_ptr(), t.block_tables.data_ptr(), t.context_lens.data_ptr(), t.block_tables.shape[1],
                t.group_tokens.shape[0], t.group_offsets.data_ptr(), t.group_members.data_ptr(),
                t.group_tokens.data_ptr())
        layer_tables = (_I32 * len(layers))(*(distinct[id(entry)] for entry in layers))
        block_size = layers[0].tables.block_size
        if any(entry.tables.block_size != block_size for entry in layers):
            raise ValueError("the native decoder step takes one block size for every layer")
        step = _Step(rows, cos.data_ptr(), sin.data_ptr(), cos.stride(-2), cos.stride(0) if cos.dim() == 3 else 0,
                     block_size, torch.get_num_threads(), tables, ctypes.addressof(layer_tables))
        code = _kernel()(ctypes.byref(self._decoder), ctypes.byref(step), embeds.data_ptr(), out.data_ptr())
        if code != 0:
            raise ValueError(f"native decoder step failed: {_STAGES.get(code, code)}")
        return out


__all__ = ["DecoderLayerParts", "LayerTables", "NativeDecoder", "available"]
