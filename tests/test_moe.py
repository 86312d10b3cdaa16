"""The sparse mixture-of-experts block (``vlmd/layers/moe.py``) against transformers'
Qwen3-VL-MoE block: same outputs from the same weights, read from the checkpoint layout or
transformers' own; under tensor parallelism the ranks' partial sums add up to it."""

from __future__ import annotations

import pytest
import torch

from vlmd.layers.linear import TPGroup
from vlmd.layers.moe import SparseMoeBlock


def _reference(seed: int = 0):
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    config = Qwen3VLMoeTextConfig(hidden_size=48, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=20,
                                  hidden_act="silu")
    block = Qwen3VLMoeTextSparseMoeBlock(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return config, block


def _checkpoint(block) -> dict[str, torch.Tensor]:
    """The tensors as a published checkpoint stores them (transformers transposes on load)."""
    return {"gate.weight": block.gate.weight.detach(),
            "experts.gate_up_proj": block.experts.gate_up_proj.detach().transpose(1, 2).contiguous(),
            "experts.down_proj": block.experts.down_proj.detach().transpose(1, 2).contiguous()}


def _ours(config, tensors, tp=TPGroup()) -> SparseMoeBlock:
    block = SparseMoeBlock(config, tp)
    params = dict(block.named_parameters())
    for name, tensor in tensors.items():
        loader = getattr(params[name], "weight_loader", None)
        if loader is None:
            with torch.no_grad():
                params[name].copy_(tensor)
        else:
            loader(params[name], tensor)
    return block.eval()


@pytest.mark.parametrize("layout", ["checkpoint", "transformers"])
def test_same_output_as_transformers_block(layout):
    config, reference = _reference()
    tensors = _checkpoint(reference)
    if layout == "transformers":
        tensors = {name: (t.transpose(1, 2) if t.dim() == 3 else t) for name, t in tensors.items()}
    ours = _ours(config, tensors)
    hidden = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(hidden[None])[0]
        got = ours(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_a_token_batch_with_unrouted_experts_and_a_single_token():
    config, reference = _reference(seed=3)
    ours = _ours(config, _checkpoint(reference))
    for rows in (1, 2):
        hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            torch.testing.assert_close(ours(hidden), reference(hidden[None])[0], rtol=1e-6, atol=1e-6)


def test_tensor_parallel_ranks_sum_to_the_whole():
    config, reference = _reference(seed=5)
    tensors = _checkpoint(reference)
    hidden = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(2))
    whole = _ours(config, tensors)
    with torch.no_grad():
        probs = torch.softmax(whole.gate(hidden), -1, dtype=torch.float32)
        weights, experts = torch.topk(probs, whole.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        partial = [_ours(config, tensors, TPGroup(2, rank)).experts(hidden, experts, weights) for rank in (0, 1)]
        torch.testing.assert_close(partial[0] + partial[1], whole(hidden), rtol=1e-5, atol=1e-6)
    assert whole.experts.gate_up_proj.shape[1] == 2 * 20 and _ours(config, tensors, TPGroup(2, 1)).experts.intermediate == 10


def test_a_wrong_shape_is_an_error_naming_the_tensor():
    config, reference = _reference()
    tensors = _checkpoint(reference)
    tensors["experts.down_proj"] = tensors["experts.down_proj"][:, :-1]
    with pytest.raises(ValueError, match="experts.down_proj has shape"):
        _ours(config, tensors)
