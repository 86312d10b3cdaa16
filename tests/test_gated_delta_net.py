"""The Gated DeltaNet layer (``vlmd/layers/linear_attention/gated_delta_net.py``) against
transformers' ``Qwen3_5GatedDeltaNet`` with the same weights: sequences split into prefill
chunks across steps, then decodes, several sequences per step (one of them fresh), each
sequence's state kept in the KV pool's pages through the recurrent-state seam, equal the
reference run over each whole sequence at once. Under tensor parallelism the ranks' partial
products add up to the whole layer's."""

from __future__ import annotations

import pytest
import torch

from vlmd.layers.attention import attention_backend_for
from vlmd.layers.attention.backend import SequenceChunk
from vlmd.layers.linear import TPGroup, select_linear_kernels
from vlmd.layers.linear_attention.gated_delta_net import GatedDeltaNet
from vlmd.layers.linear_attention.state import commit_states
from vlmd.models.loader import load_into
from vlmd.runner.kv_cache import allocate_kv_slots, layer_caches
from vlmd.types import KVSpec

reference = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

BLOCK = 16
SIZES = dict(hidden_size=64, num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16,
             conv_kernel=4, rms_norm_eps=1e-6)


def _reference_layer(seed: int = 0):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                               num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6,
                               hidden_act="silu")
    layer = reference.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.5 if name == "A_log" else 0.2
            param.copy_(torch.randn(param.shape, generator=generator) * scale + (1.0 if name == "norm.weight" else 0.0))
    return layer


def _ours(layer, tp: TPGroup = TPGroup()) -> GatedDeltaNet:
    ours = GatedDeltaNet(**SIZES, tp=tp)
    params = dict(ours.named_parameters())
    tensors = dict(layer.named_parameters())
    assert set(params) == set(tensors)  # transformers' names, one to one
    for name, tensor in tensors.items():
        load_into(params[name], tensor.detach(), name)
    return ours.eval()


def _pool(layer: GatedDeltaNet, num_blocks: int = 64):
    """A pool with the layer (slot 0, a recurrent group) and one attention layer, as a hybrid
    model's: the layer's cache and the recurrent group's index."""
    spec = KVSpec(2, 2, 8, layer_state_bytes=(layer.state_layout().bytes_per_request, None))
    config = spec.kv_cache_config(BLOCK, 4, 256, 256, num_blocks)
    slots = allocate_kv_slots(spec, config, torch.float32)
    group = next(g for g in config.groups if g.kind.name == "recurrent_state")
    return layer_caches(config, slots, range(2), spec)[0], group


def _run_steps(ours, sequences, steps):
    """``steps``: lists of (sequence, start, count), decodes first. Returns each sequence's
    output rows in order."""
    cache, group = _pool(ours)
    backend = attention_backend_for("cpu", BLOCK, "torch")
    tables = {}
    for name in sequences:  # each request's attention blocks and its state pages, apart
        first = 1 + len(tables) * 16
        tables[name] = {0: list(range(first, first + 12)),
                        group.index: list(range(first + 12, first + 12 + group.blocks_per_request))}
    outputs = {name: [] for name in sequences}
    for step in steps:
        chunks = [SequenceChunk.of(tables[name], start, count) for name, start, count in step]
        decodes = sum(1 for _, start, count in step if count == 1 and start > 0)
        meta = backend.prepare_metadata(chunks, decodes)
        hidden = torch.cat([sequences[name][start:start + count] for name, start, count in step])
        with torch.no_grad():
            out = ours(hidden, meta, cache)
        commit_states(meta)  # as the runner does once the step has run
        row = 0
        for name, start, count in step:
            outputs[name].append(out[row:row + count])
            row += count
    return {name: torch.cat(parts) for name, parts in outputs.items()}


def test_parameters_are_transformers_names_and_state_layout():
    ours = GatedDeltaNet(**SIZES)
    names = {name for name, _ in ours.named_parameters()}
    assert names == {name for name, _ in _reference_layer().named_parameters()}
    layout = ours.state_layout()
    assert (layout.conv_channels, layout.conv_kernel, layout.heads, layout.key_dim, layout.value_dim) == (128, 4, 4, 16, 16)


@pytest.mark.parametrize("kernels", ["plain", "native"])
def test_chunked_prefills_then_batched_decodes_equal_the_reference(kernels):
    """``kernels``: the linear seam's products as loaded (F.linear), or pre-packed with
    vlmd's kernel for small products, as the server selects them."""
    layer = _reference_layer()
    ours = _ours(layer)
    select_linear_kernels(ours, kernels)
    generator = torch.Generator().manual_seed(1)
    lengths = {"long": 153, "short": 43, "fresh": 3}
    sequences = {name: torch.randn(length, 64, generator=generator) for name, length in lengths.items()}
    steps = [
        [("long", 0, 70), ("short", 0, 40)],  # two prompts, the long one's first chunk
        [("short", 40, 1), ("long", 70, 80)],  # a decode, then the rest of the prompt
        [("long", 150, 1), ("short", 41, 1), ("fresh", 0, 1)],  # decodes and a fresh one-token prompt
        [("long", 151, 1), ("short", 42, 1), ("fresh", 1, 1)],  # three decodes, one of a fresh request
        [("fresh", 2, 1), ("long", 152, 1)],
    ]
    got = _run_steps(ours, sequences, steps)
    for name, hidden in sequences.items():
        with torch.no_grad():
            expected = layer(hidden[None])[0]
        torch.testing.assert_close(got[name], expected, rtol=1e-4, atol=5e-5, msg=lambda text: f"{name}: {text}")


def test_tensor_parallel_ranks_sum_to_the_whole():
    layer = _reference_layer(seed=2)
    hidden = torch.randn(30, 64, generator=torch.Generator().manual_seed(3))
    whole = _ours(layer)
    cache, group = _pool(whole)
    backend = attention_backend_for("cpu", BLOCK, "torch")
    tables = {0: list(range(1, 5)), group.index: list(range(5, 5 + group.blocks_per_request))}
    meta = backend.prepare_metadata([SequenceChunk.of(tables, 0, 30)], 0)
    partial = []
    for rank in (0, 1):
        ours = _ours(layer, TPGroup(2, rank))
        assert ours.state_layout().heads == 2 and ours.state_layout().conv_channels == 64
        rank_cache, _ = _pool(ours)
        with torch.no_grad():
            partial.append(ours.out_proj.product(ours.mix(hidden, meta, rank_cache), None))
    with torch.no_grad():
        torch.testing.assert_close(partial[0] + partial[1], whole(hidden, meta, cache), rtol=1e-4, atol=1e-5)


def test_a_wrong_shape_is_an_error_naming_the_tensor():
    layer = _reference_layer()
    ours = GatedDeltaNet(**SIZES)
    params = dict(ours.named_parameters())
    with pytest.raises(ValueError, match="conv1d"):
        load_into(params["conv1d.weight"], layer.conv1d.weight.detach()[:, :, :3], "conv1d.weight")
    with pytest.raises(ValueError, match="in_proj_qkv"):
        load_into(params["in_proj_qkv.weight"], layer.in_proj_qkv.weight.detach()[:-1], "in_proj_qkv.weight")
    with pytest.raises(ValueError, match="multiple"):
        GatedDeltaNet(**{**SIZES, "num_value_heads": 3})


def test_rows_that_do_not_match_the_steps_chunks_are_refused():
    ours = GatedDeltaNet(**SIZES)
    cache, group = _pool(ours)
    backend = attention_backend_for("cpu", BLOCK, "torch")
    tables = {0: [1, 2], group.index: list(range(5, 5 + group.blocks_per_request))}
    meta = backend.prepare_metadata([SequenceChunk.of(tables, 0, 6)], 0)
    with pytest.raises(ValueError, match="cover 6 rows"), torch.no_grad():
        ours(torch.zeros(5, 64), meta, cache)


def test_bfloat16_layer_is_as_close_to_float32_as_the_reference_in_bfloat16():
    """A bfloat16 model (float32 states in the pages): over a prompt in two steps and a
    decode, its outputs are bfloat16 and as close to the float32 layer's as transformers' own
    layer run in bfloat16 is (which convolves in bfloat16; outputs reach 10, so a bfloat16
    rounding is up to 0.04)."""
    reference_layer = _reference_layer(seed=4)
    ours = _ours(reference_layer).to(torch.bfloat16)
    hidden = torch.randn(90, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = _run_steps(ours, {"only": hidden}, [[("only", 0, 50)], [("only", 50, 39)], [("only", 89, 1)]])["only"]
    assert got.dtype == torch.bfloat16
    with torch.no_grad():
        truth = reference_layer(hidden.float()[None])[0]
        theirs = reference_layer.to(torch.bfloat16)(hidden[None])[0].float()
    ours_error, their_error = (got.float() - truth).abs(), (theirs - truth).abs()
    assert ours_error.mean() <= 1.25 * their_error.mean(), (ours_error.mean(), their_error.mean())
    assert ours_error.max() <= 1.25 * their_error.max(), (ours_error.max(), their_error.max())
