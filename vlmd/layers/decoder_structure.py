"""A decoder's layer structure as data: what a backend needs to run a whole decode step itself.

A model describes its decoder once (``LlamaForCausalLM.decoder_structure``) and hands the
description to the step's attention backend (``AttentionBackend.decode_step``); a backend
with a fused kernel for that structure runs every layer in one call (the CPU room:
``layers/cpu/fused_step.py``), any other returns None and the model's modules run. So the
model never imports a kernel, and a new family's layer either matches a structure a
backend runs or says what differs (the fields below), instead of silently falling off a
fast path it was never taught.

The layers' modules are referenced, not copied: a backend reads their weights and
kernels when it builds its step, after the linear selection has chosen them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class PreNormLayer:
    """Llama's layer: h = x + o(attend(rotary(qkv(norm(x))))); out = h + down(act(gate) * up),
    with [gate, up] = gate_up(post_norm(h)). q/k/v and gate/up are fused products.
    ``query_norm``/``key_norm``: where the layer has them (Qwen3), an RMSNorm over
    ``head_dim`` of each q head and of each k head, between qkv and rotary.
    ``post_attention_norm``/``post_feedforward_norm``: where the layer has them (Gemma 3's
    four norms a layer), RMSNorms of the attention's and of the MLP's output before each is
    added to the residual (``post_norm`` is then the norm before the MLP).
    ``window``: tokens the layer attends back (a sliding-window layer), None for all.
    ``rotary``: which of the step's rotary tables rotates its q and k (Gemma 3's local and
    global layers rotate by different bases)."""

    input_norm: nn.Module  # RMSNorm
    qkv: nn.Module  # LinearBase: [q | k | v] columns
    o: nn.Module
    post_norm: nn.Module  # RMSNorm
    gate_up: nn.Module  # LinearBase: [gate | up] columns
    down: nn.Module
    query_norm: nn.Module | None = None  # RMSNorm of head_dim
    key_norm: nn.Module | None = None
    post_attention_norm: nn.Module | None = None  # RMSNorm of hidden
    post_feedforward_norm: nn.Module | None = None
    window: int | None = None
    rotary: int = 0

    def products(self) -> tuple[nn.Module, ...]:
        return self.qkv, self.o, self.gate_up, self.down


@dataclass(frozen=True)
class DecoderStructure:
    """Every layer of a pre-norm decoder, then its final RMSNorm. ``heads`` and
    ``kv_heads`` are this rank's; attention is causal over the paged cache, rotate-half
    rotary on q and k. The fields after ``tensor_parallel`` name what a family's layer
    adds to Llama's, so a backend that does not run them can say so (``additions``)."""

    layers: tuple[PreNormLayer, ...]
    final_norm: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # this rank's columns of gate (and of up)
    scale: float
    eps: float  # every RMSNorm's
    activation: str  # of the gate: "silu", "gelu", "gelu_pytorch_tanh"
    tensor_parallel: int = 1  # ranks the products are split over
    # Every RMSNorm scales by ``norm_offset + weight`` (Gemma's norms: 1 + w); the modules'
    # ``kernel_weight()`` is that sum.
    norm_offset: float = 0.0
    rotary_tables: int = 1  # the step's cos/sin are [rotary_tables, rows, head_dim] when more than one

    def __post_init__(self):
        # A backend runs every layer alike: q/k norms in some layers only, or a q norm
        # without a k norm, is a structure no backend reads; so are the norms after
        # attention and MLP.
        kinds = {(layer.query_norm is not None, layer.key_norm is not None) for layer in self.layers}
        if len(kinds) > 1 or kinds & {(True, False), (False, True)}:
            raise ValueError("query and key norms must be in every layer of a decoder or in none")
        kinds = {(layer.post_attention_norm is not None, layer.post_feedforward_norm is not None)
                 for layer in self.layers}
        if len(kinds) > 1 or kinds & {(True, False), (False, True)}:
            raise ValueError("post-attention and post-feedforward norms must be in every layer of a decoder or in none")
        for layer in self.layers:
            if layer.window is not None and layer.window < 1:
                raise ValueError(f"a sliding window must be >= 1 token, got {layer.window}")
            if not 0 <= layer.rotary < self.rotary_tables:
                raise ValueError(f"rotary table {layer.rotary} of {self.rotary_tables}")

    @property
    def query_key_norm(self) -> bool:
        """Whether every layer norms its q and k heads before rotary (Qwen3, and others)."""
        return bool(self.layers) and self.layers[0].query_norm is not None

    @property
    def sandwich_norms(self) -> bool:
        """Whether every layer norms its attention's and its MLP's outputs (Gemma 3)."""
        return bool(self.layers) and self.layers[0].post_attention_norm is not None

    def additions(self) -> list[str]:
        """What the layers add to Llama's and Qwen3's (a backend that runs only those
        refuses the structure when this is not empty)."""
        found = []
        if self.sandwich_norms:
            found.append("norms after attention and MLP")
        if self.norm_offset:
            found.append(f"norms scaling by {self.norm_offset} + weight")
        if any(layer.window is not None for layer in self.layers):
            found.append("sliding-window layers")
        if self.rotary_tables != 1:
            found.append("rotary tables per layer")
        return found

    def products(self) -> list[nn.Module]:
        """Every layer's products in the order a step runs them."""
        return [product for layer in self.layers for product in layer.products()]


def decoder_structures(model: nn.Module) -> list[DecoderStructure]:
    """The decoders ``model`` describes as data (a family's language model does; one that
    cannot be described, such as a mixture of experts, has ``decoder_structure`` None)."""
    found = []
    for module in model.modules():
        structure = getattr(module, "decoder_structure", None)
        if isinstance(structure, DecoderStructure):
            found.append(structure)
    return found
