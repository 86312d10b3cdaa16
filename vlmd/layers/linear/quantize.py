"""Weight-only int8 for a model's decoder and its LM head (``--quantization int8``), at load time.

Every linear layer of the decoders a model describes (``DecoderStructure.products()``:
q/k/v, o, gate/up, down of each layer) and each such decoder's LM head (its
``logits_head()``: vlmd's Llama decoder and the Qwen decoders built on it) gets its
float32 weight quantized per output channel, symmetric, into int8 panels
(``layers/cpu/panel_packing.int8_panels``); the layer's float32 weight is dropped, so only
the int8 bytes (a quarter) and a float32 scale per output channel stay. An LM head tied to
the embeddings keeps the float weight for the embedding lookup (the int8 copy serves the
logits product alone), so there the int8 bytes add to the float ones. The panels are the
layer's buffers, so everything that counts a model's bytes (the start-up memory plan's
``weight_bytes_of``) counts them; ``int8_savings`` is what ``vlmd cost`` subtracts.
Embeddings and vision or audio towers stay float.

Why only weights: a decode step reads every weight once and does little arithmetic on
each, so its time is the weights' bytes; the rows stay float32 and the kernels widen int8
to float32 (no int8 arithmetic, so no activation scales to calibrate). Why the LM head:
it is one product per sequence in a step, and on a small checkpoint a large share of what
a step reads (the small LLaVA's 8192 x 768 head: 25 MB of float32 beside 57 MB of int8
decoder products). The accuracy bound against the float32 model is docs/decisions.md D88
(tests/test_quantized_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from vlmd.config import QUANTIZATIONS
from vlmd.layers.cpu import packed_linear as native_linear
from vlmd.layers.cpu.panel_packing import int8_bytes, int8_panels
from vlmd.layers.decoder_structure import DecoderStructure, decoder_structures
from vlmd.layers.linear.kernels import INT8_CHOICES, SelectedKernel
from vlmd.layers.linear.layers import LinearBase


def quantizable_layers(model: nn.Module) -> list[LinearBase]:
    """What ``--quantization int8`` quantizes, in model order: the described decoders'
    products, then their LM heads."""
    layers = {id(p): p for structure in decoder_structures(model) for p in structure.products()}
    layers.update((id(head), head) for head in logits_heads(model))
    return [layer for layer in layers.values() if isinstance(layer, LinearBase)]


def logits_heads(model: nn.Module) -> list[LinearBase]:
    """The LM heads of the decoders ``model`` describes: each module with a
    ``DecoderStructure`` that names its head (``logits_head()``). A decoder not described
    (a mixture of experts: ``decoder_structure`` None) keeps a float head."""
    heads = []
    for module in model.modules():
        named = getattr(module, "logits_head", None)
        if isinstance(getattr(module, "decoder_structure", None), DecoderStructure) and callable(named):
            heads.append(named())
    return heads


def int8_savings(model: nn.Module, element_bytes: int) -> int:
    """Bytes ``quantize_decoder`` saves on ``model`` whose weights hold ``element_bytes``
    each: every quantized layer's float weight less its int8 panels and scales, except that
    a weight another module also holds (an LM head tied to the embeddings) stays, so there
    the int8 copy only adds. Works on a model built on the meta device (``vlmd cost``)."""
    held: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        held[id(param)] = held.get(id(param), 0) + 1
    return sum((0 if held.get(id(layer.weight), 0) > 1 else layer.weight.numel() * element_bytes)
               - int8_bytes(layer.output_size, layer.input_size) for layer in quantizable_layers(model))


@torch.inference_mode()
def quantize_decoder(model: nn.Module, quantization: str) -> list[LinearBase]:
    """Quantize the decoder's linear layers and its LM head in place (``quantization``
    "int8"); returns them (none for "none"). Raises where it cannot: no kernel library, a
    decoder the model does not describe, weights that are not float32 CPU tensors."""
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
        # The int8 panels replace it: no float copy is kept for the product (a tied
        # embedding keeps its own reference to the weight for its lookup).
        layer.weight = None
        layer.register_buffer("weight_int8", storage[0], persistent=False)
        layer.register_buffer("weight_scales", storage[1], persistent=False)
        layer.kernel = SelectedKernel(INT8_CHOICES, None, None, panels, storage)
    return layers
