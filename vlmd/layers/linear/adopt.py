"""Bringing the ``nn.Linear`` layers of a borrowed module (a transformers vision or audio
tower) onto the linear seam, so kernel selection covers them too.

Each ``nn.Linear`` becomes a :class:`ReplicatedLinear` holding the very same parameter
objects, under the same attribute name, so checkpoint names, loading and outputs are
unchanged until ``select_linear_kernels`` gives it a kernel. Why: the CLIP tower of the
small LLaVA spent as much engine time as the whole decoder's prefill at half its FLOPs; its
products at M = 577 ran plain ``F.linear`` (150-190 GFLOP/s here) where pre-packed oneDNN
weights reach 200-220 (AMD EPYC fam 25 model 17, 2 threads).

Only for modules that call their linears (``layer(x)``) and never read ``layer.weight``
themselves: a packed kernel replaces the plain weight, so such a read would find ``None``.
"""

from __future__ import annotations

from torch import nn

from vlmd.layers.linear.layers import ReplicatedLinear


def adopt_linear_modules(module: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` under ``module`` in place; returns how many."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            adopted = ReplicatedLinear(child.in_features, child.out_features, bias=child.bias is not None)
            adopted.weight = child.weight
            adopted.weight.weight_loader = adopted.weight_loader
            adopted.weight.requires_grad_(False)
            if child.bias is not None:
                adopted.bias = child.bias
                adopted.bias.weight_loader = adopted.weight_loader
                adopted.bias.requires_grad_(False)
            setattr(parent, name, adopted)
            replaced += 1
    return replaced
