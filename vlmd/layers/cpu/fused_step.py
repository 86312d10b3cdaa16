"""A decode step through every layer of a ``DecoderStructure`` in one native call.

The CPU attention backend (``layers/attention/cpu_paged.py``) hands a step of decodes
here (``CPUPagedBackend.run_decode_step``) when its own kernel would serve that step's
attention; this runs ``decoder_step.c`` over the structure's layers, the same kernels in
the same order as the modules would call them, so the result is the module path's bit
for bit. It returns None wherever it cannot, and the model's modules run: a structure it
has no kernel for (``unsupported``), a product whose kernel at this row count is not
vlmd's packed kernel, inputs the kernel does not read.

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
    if structure.activation != "silu":
        return f"activation {structure.activation}"
    if structure.query_key_norm and any(norm.eps != structure.eps for layer in structure.layers
                                        for norm in (layer.query_norm, layer.key_norm)):
        return "query/key norms of another eps"  # the step runs every norm at the structure's eps
    if structure.sliding_window is not None:
        return "sliding-window layers"
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
            slots: torch.Tensor, tables, kv_caches) -> torch.Tensor | None:
        """The final norm's output for ``embeds`` (one decode a row), or None where this
        step cannot run natively. ``cos``/``sin`` [rows, head_dim]."""
        decoder, kernels = self.decoder(structure, kv_caches)
        rows = embeds.shape[0]
        if decoder is None or not every_product_native(kernels, rows):
            return None
        if embeds.dtype == torch.bfloat16:  # widened exactly; the output rounded back below
            widened = [t.float() if t.dtype == torch.bfloat16 else t for t in (embeds, cos, sin)]
            if not decoder.accepts(*widened, slots):
                return None
            return decoder(*widened, slots, tables).to(torch.bfloat16)
        if not decoder.accepts(embeds, cos, sin, slots):
            return None
        return decoder(embeds, cos, sin, slots, tables)

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
            parts = [
                decoder_step.DecoderLayerParts(
                    _float32(layer.input_norm.weight), _float32(layer.post_norm.weight),
                    tuple((p.kernel.panels, None if p.bias is None else _float32(p.bias)) for p in layer.products()),
                    k_cache, v_cache, *(None if norm is None else _float32(norm.weight)
                                        for norm in (layer.query_norm, layer.key_norm)))
                for layer, (k_cache, v_cache) in zip(structure.layers, kv_caches)
            ]
            decoder = decoder_step.NativeDecoder.of(
                parts, _float32(structure.final_norm.weight), heads=structure.heads, kv_heads=structure.kv_heads,
                head_dim=structure.head_dim, intermediate=structure.intermediate, eps=structure.eps,
                scale=structure.scale)
        self._built[id(structure)] = (key, decoder, kernels)
        return decoder, kernels


def _float32(parameter: torch.Tensor) -> torch.Tensor:
    """A norm weight or bias as the step reads it: itself where it is float32, else a
    float32 copy (a bfloat16 model's: exact, and held by the built step)."""
    tensor = parameter.detach()
    return tensor if tensor.dtype == torch.float32 else tensor.float().contiguous()
