"""Random weights for tiny checkpoints: one seeded generator, a scale per tensor by name.

Why not torch's default init (or N(0, 0.02) everywhere): that gives near-uniform attention and
a model that, at the "small" width, repeats one token forever, so parity tests prove little.
Every builder instead overwrites every parameter from ``torch.Generator().manual_seed(seed)``,
in sorted-name order (so the bytes depend on the seed and the parameter names only, never on
torch's global RNG or module construction order), with a (mean, std) its family's rule picks
by name. Most families use :class:`StdRule`:

1. norms (``LayerNorm`` and ``*RMSNorm`` modules): weights 1 + N(0, 0.1), biases N(0, 0.02),
   so a loader that drops a norm weight or bias is caught;
2. the family's ``fixed`` scales (position embeddings, class tokens, layer scales);
3. other 1-D parameters (biases): N(0, 0.02);
4. ``lm_head``: 2/sqrt(hidden), so logits have std ~2 and greedy top-1/top-2 gaps sit far
   above float32 noise;
5. token embeddings: unit std;
6. everything else gain/sqrt(fan_in): attention queries and keys at gain 1 (sharp,
   position-dependent attention), the family's ``gains`` (patch embeddings, projectors that
   put media vectors on the scale of token embeddings), other projections at 0.5.

A family whose architecture needs other choices (Gemma's 1 + w norms, Whisper's tied
embeddings) passes its own rule; the draw order is the same. The ``lm_head`` rows of special
tokens are zeroed: their logit is exactly 0 while the best of thousands of ordinary tokens is
well above it, so greedy decoding writes ordinary text only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["StdRule", "init_buffers", "init_weights", "norm_parameter_names", "random_model"]

# (name, shape, is_norm) -> (mean, std), or None to keep the parameter as the constructor built it.
Rule = Callable[[str, tuple[int, ...], bool], "tuple[float, float] | None"]

SHARP = ("q_proj.weight", "k_proj.weight")  # attention queries and keys: gain 1
DEFAULT_GAIN = 0.5


@dataclass(frozen=True)
class StdRule:
    """The common rule above with a family's exceptions. A pattern matches a parameter whose
    name contains it (a suffix such as ``attn.qkv.weight`` or a path part such as ``.merger.``)."""

    # (patterns, mean, std): drawn at a set scale, checked right after the norms.
    fixed: Sequence[tuple[Sequence[str], float, float]] = ()
    # (patterns, gain): fan-in scaled at this gain, checked before the queries and keys.
    gains: Sequence[tuple[Sequence[str], float]] = ()

    def __call__(self, name: str, shape: tuple[int, ...], is_norm: bool) -> tuple[float, float]:
        if is_norm:
            return (1.0, 0.1) if name.endswith("weight") else (0.0, 0.02)
        for patterns, mean, std in self.fixed:
            if _matches(name, patterns):
                return mean, std
        if len(shape) == 1:
            return 0.0, 0.02  # biases
        if name.startswith("lm_head"):
            return 0.0, 2.0 / math.sqrt(shape[1])  # [vocab, hidden]
        if name.endswith("embed_tokens.weight"):
            return 0.0, 1.0
        gain = next((gain for patterns, gain in self.gains if _matches(name, patterns)), None)
        if gain is None:
            gain = 1.0 if name.endswith(SHARP) else DEFAULT_GAIN
        return 0.0, gain / math.sqrt(math.prod(shape[1:]))


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(pattern in name for pattern in patterns)


def norm_parameter_names(model) -> set[str]:
    """Names of the parameters of ``LayerNorm`` and ``*RMSNorm`` modules (any family's)."""
    import torch

    names: set[str] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
            names.update(f"{module_name}.{p}" if module_name else p for p, _ in module.named_parameters(recurse=False))
    return names


def init_weights(model, seed: int, rule: Rule, zero_output_rows: Sequence[int] = ()) -> None:
    """Overwrite every parameter ``rule`` names a scale for, from one generator seeded with
    ``seed``, in sorted-name order; then zero the output embedding's ``zero_output_rows``."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    norms = norm_parameter_names(model)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            scale = rule(name, tuple(param.shape), name in norms)
            if scale is None:
                continue
            mean, std = scale
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std + mean)
        if len(zero_output_rows):
            model.get_output_embeddings().weight[list(zero_output_rows)] = 0.0


def init_buffers(model, seed: int, scales: Callable[[str], "tuple[float, float] | None"]) -> None:
    """Overwrite the buffers ``scales`` names a (mean, std) for (checkpoint buffers a family
    draws too: Gemma 4's layer scalars, its tower's standardization), from their own generator
    seeded with ``seed``, in sorted-name order, as :func:`init_weights` does parameters."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            scale = scales(name)
            if scale is None:
                continue
            mean, std = scale
            buffer.copy_(torch.randn(buffer.shape, generator=gen, dtype=torch.float32) * std + mean)


def random_model(model_class, config, seed: int, rule: Rule, zero_output_rows: Sequence[int] = ()):
    """``model_class(config)`` in float32 eval mode with :func:`init_weights`' weights."""
    import torch

    torch.manual_seed(seed)  # the constructor's own init, for what the rule keeps as built
    model = model_class(config).to(torch.float32).eval()
    init_weights(model, seed, rule, zero_output_rows)
    return model
