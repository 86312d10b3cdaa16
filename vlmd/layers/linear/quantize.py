"""Weight-only int8 for a model's decoder (``--quantization int8``), at load time.

Every linear layer of the decoders a model describes (``DecoderStructure.products()``:
q/k/v, o, gate/up, down of each layer) gets its float32 weight quantized per output
channel, symmetric, into int8 panels (``layers/cpu/panel_packing.int8_panels``); the
float32 weight is dropped, so only the int8 bytes (a quarter) and a float32 scale per
output channel stay. The panels are the layer's buffers, so everything that counts a
model's bytes (the start-up memory plan's ``weight_bytes_of``) counts them. Embeddings,
the LM head and vision or audio towers stay float: they are not the decoder's products.

Why only weights: a decode step reads every weight once and does little arithmetic on
each, so its time is the weights' bytes; the rows stay float32 and the kernels widen int8
to float32 (no int8 arithmetic, so no activation scales to calibrate). The accuracy
bound against the float32 model is docs/decisions.md D88 (tests/test_quantized_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmd.config import QUANTIZATIONS
from vlmd.layers.cpu import packed_linear as native_linear
from vlmd.layers.cpu.panel_packing import int8_panels
from vlmd.layers.decoder_structure import decoder_structures
from vlmd.layers.linear.kernels import INT8_CHOICES, SelectedKernel
from vlmd.layers.linear.layers import LinearBase


def quantizable_layers(model: nn.Module) -> list[LinearBase]:
    """The decoder products ``--quantization int8`` quantizes, in model order."""
    layers = {id(p): p for structure in decoder_structures(model) for p in structure.products()}
    return [layer for layer in layers.values() if isinstance(layer, LinearBase)]


@torch.inference_mode()
def quantize_decoder(model: nn.Module, quantization: str) -> list[LinearBase]:
    """Quantize the decoder's linear layers in place (``quantization`` "int8"); returns
    them (none for "none"). Raises where it cannot: no kernel library, a decoder the
    model does not describe, weights that are not float32 CPU tensors."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return []
    if not native_linear.available():
        raise ValueError("--quantization int8 needs vlmd's CPU kernels, and no kernel library is loaded here")
    layers = quantizable_layers(model)
    if not layers:
        raise ValueError(f"--quantization int8: {type(model).__name__} describes no decoder whose linear "
                         "layers could be quantized")
    for layer in layers:
        weight = layer.weight
        if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
            what = "no weight" if weight is None else f"{weight.dtype} on {weight.device}"
            raise ValueError(f"--quantization int8 quantizes float32 CPU weights (--dtype float32, a CPU device), "
                             f"not {what}")
    for layer in layers:
        storage, panels = int8_panels(layer.weight)
        layer.weight = None  # the int8 panels replace it: no float copy is kept
        layer.register_buffer("weight_int8", storage[0], persistent=False)
        layer.register_buffer("weight_scales", storage[1], persistent=False)
        layer.kernel = SelectedKernel(INT8_CHOICES, None, None, panels, storage)
    return layers
