"""A decode step through every layer of a ``DecoderStructure`` in one native call.

The CPU attention backend (``layers/attention/cpu_paged.py``) hands a step of decodes
here (``CPUPagedBackend.run_decode_step``) when its own kernel would serve that step's
attention; this runs ``decoder_step.c`` over the structure's layers, the same kernels in
the same order as the modules would call them, so the result is the module path's bit
for bit (Gemma 3's layer too: its modules run the same norm, rotary and GELU-tanh kernels
on float32 rows, and each sliding-window layer reads its window group's tables, as its
module does through ``CPUPagedBackend.forward``). It returns None wherever it cannot, and
the model's modules run: a structure it has no kernel for (``unsupported``), a product
whose kernel at this row count is not vlmd's packed kernel, inputs the kernel does not read.

Weights: every product's panels may be float32, bfloat16 (a ``--dtype bfloat16`` model)
or weight-only int8 (``--quantization int8``); the step's activations are float32 in
every case. A bfloat16 model's step therefore takes its embeddings widened to float32
and returns the final norm's output rounded to bfloat16: between the two its rows are
never rounded to bfloat16 as the module path rounds them after every op, so it is not
the module path bit for bit but closer to the float32 model (its K and V are rounded
to bfloat16 as they enter the cache, as the module path's are).

``products(structure)`` names the products such a step runs, for the linear selection
(``layers/linear/selection.py``), which times them as this step runs them.
"""

from __future__ import annotations

import torch

from vlmd.layers.cpu import decoder_step
from vlmd.layers.decoder_structure import DecoderStructure


def unsupported(structure: DecoderStructure) -> str | None:
    """Why this room cannot run ``structure``'s decode steps, or None where it can."""
    if not decoder_step.available():
        return "no kernel library is loaded"
    if structure.tensor_parallel != 1:
        return "tensor parallel"
    if structure.activation not in decoder_step.ACTIVATIONS:
        return f"activation {structure.activation}"
    if any(norm is not None and norm.eps != structure.eps for layer in structure.layers
           for norm in (layer.query_norm, layer.key_norm, layer.post_attention_norm, layer.post_feedforward_norm)):
        return "norms of another eps"  # the step runs every norm at the structure's eps
    return None


def products(structure: DecoderStructure) -> list:
    """The products a fused step of ``structure`` runs, or [] where it cannot run here."""
    return [] if unsupported(structure) is not None else structure.products()


def every_product_native(kernels, rows: int) -> bool:
    """Whether each of a step's products (their ``SelectedKernel``s) takes vlmd's kernel at
    ``rows`` rows: the fused step runs only then."""
    return all(kernel is not None and kernel.native_panels(rows) is not None for kernel in kernels)


class FusedDecodeSteps:
    """The native steps of the structures a backend has seen, each built on first use
    and rebuilt when its caches or a product's kernel change: the step reads the kernels'
    packed weights by address, and the kept kernels keep those weights alive."""

    def __init__(self):
        self._built: dict[int, tuple] = {}  # id(structure) -> (key, decoder or None, kernels)

    def run(self, structure: DecoderStructure, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            layer_tables: list[decoder_step.LayerTables], kv_caches) -> torch.Tensor | None:
        """The final norm's output for ``embeds`` (one decode a row), or None where this
        step cannot run natively. ``cos``/``sin`` [rows, head_dim], or [tables, rows,
        head_dim] for a structure of several rotary tables; ``layer_tables``: each layer's
        slots and decode tables."""
        decoder, kernels = self.decoder(structure, kv_caches)
        rows = embeds.shape[0]
        if decoder is None or not every_product_native(kernels, rows):
            return None
        if embeds.dtype == torch.bfloat16:  # widened exactly; the output rounded back below
            widened = [t.float() if t.dtype == torch.bfloat16 else t for t in (embeds, cos, sin)]
            if not decoder.accepts(*widened, layer_tables):
                return None
            return decoder(*widened, layer_tables).to(torch.bfloat16)
        if not decoder.accepts(embeds, cos, sin, layer_tables):
            return None
        return decoder(embeds, cos, sin, layer_tables)

    def decoder(self, structure: DecoderStructure, kv_caches) -> tuple["decoder_step.NativeDecoder | None", list]:
        """(The native step for these caches and the products' current kernels, or None;
        those kernels.)"""
        kernels = [product.kernel for product in structure.products()]
        key = (tuple(cache.data_ptr() for pair in kv_caches for cache in pair), tuple(map(id, kernels)))
        built = self._built.get(id(structure))
        if built is not None and built[0] == key:
            return built[1], built[2]
        decoder = None
        usable = all(kernel is not None and kernel.panels is not None for kernel in kernels)
        if usable and unsupported(structure) is None and len(kv_caches) == len(structure.layers):
            offset = structure.norm_offset
            parts = [
                decoder_step.DecoderLayerParts(
                    _norm_factor(layer.input_norm, offset), _norm_factor(layer.post_norm, offset),
                    tuple((p.kernel.panels, None if p.bias is None else _float32(p.bias)) for p in layer.products()),
                    k_cache, v_cache,
                    *(_norm_factor(norm, offset) for norm in (layer.query_norm, layer.key_norm,
                                                              layer.post_attention_norm, layer.post_feedforward_norm)),
                    window=layer.window, rotary=layer.rotary)
                for layer, (k_cache, v_cache) in zip(structure.layers, kv_caches)
            ]
            decoder = decoder_step.NativeDecoder.of(
                parts, _norm_factor(structure.final_norm, offset), heads=structure.heads,
                kv_heads=structure.kv_heads, head_dim=structure.head_dim, intermediate=structure.intermediate,
                eps=structure.eps, scale=structure.scale, activation=structure.activation,
                rotary_tables=structure.rotary_tables)
        self._built[id(structure)] = (key, decoder, kernels)
        return decoder, kernels


def _norm_factor(norm, offset: float) -> torch.Tensor | None:
    """What a norm scales each normed column by, float32: its weight, or ``offset + weight``
    (Gemma's ``1 + w``, computed as its module computes it), or None for no norm."""
    if norm is None:
        return None
    weight = _float32(norm.weight)
    return (offset + weight).contiguous() if offset else weight


def _float32(parameter: torch.Tensor) -> torch.Tensor:
    """A norm weight or bias as the step reads it: itself where it is float32, else a
    float32 copy (a bfloat16 model's: exact, and held by the built step)."""
    tensor = parameter.detach()
    return tensor if tensor.dtype == torch.float32 else tensor.float().contiguous()
