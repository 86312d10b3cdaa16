"""The linear seam: every kernel equals F.linear, and each TP rank loads its own slice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlmd.layers.linear import (
    adopt_linear_modules,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
    select_linear_kernels,
)
from vlmd.layers.linear.kernels import M_BUCKETS, PACKED, PLAIN, KernelChoice, SelectedKernel, packing_available

pytestmark = pytest.mark.filterwarnings("ignore")


def _loaded(layer, weight, bias=None):
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    return layer


@pytest.mark.parametrize("rows", [1, 3, 8, 40, 200])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_choice_equals_f_linear(rows, bias, dtype):
    torch.manual_seed(rows)
    weight = torch.randn(96, 80).to(dtype)
    b = torch.randn(96).to(dtype) if bias else None
    x = torch.randn(rows, 80).to(dtype)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    choices = [PLAIN, KernelChoice(False, 1)]
    if packing_available(weight):
        choices += [PACKED, KernelChoice(True, 1)]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if packing_available(weight) else None
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    for choice in choices:
        kernel = SelectedKernel((choice,) * len(M_BUCKETS), weight, packed)
        got = kernel(x, b)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance, msg=choice.name)
    threads = torch.get_num_threads()
    SelectedKernel((KernelChoice(False, 1),) * len(M_BUCKETS), weight, packed)(x, b)
    assert torch.get_num_threads() == threads  # a one-thread kernel restores the count


def test_selection_keeps_results_and_frees_replaced_weights():
    torch.manual_seed(0)
    model = nn.Sequential(ReplicatedLinear(64, 128), ReplicatedLinear(128, 32, bias=False))
    for layer in model:
        nn.init.normal_(layer.weight)
    x3 = torch.randn(2, 7, 64)  # any leading shape, as F.linear
    before = model(x3)
    for mode in ("packed", "auto", "plain"):
        fresh = nn.Sequential(ReplicatedLinear(64, 128), ReplicatedLinear(128, 32, bias=False))
        fresh.load_state_dict(model.state_dict())
        report = select_linear_kernels(fresh, mode)
        assert report["mode"] == mode
        torch.testing.assert_close(fresh(x3), before, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(fresh(x3[0, :1]), before[0, :1], rtol=1e-5, atol=1e-4)
        if mode == "packed" and packing_available(before):
            assert all(layer.weight is None for layer in fresh)  # no second copy kept
    with pytest.raises(ValueError, match="not one of"):
        select_linear_kernels(model, "fastest")


def test_a_weight_shared_with_an_embedding_is_kept():
    embed = nn.Embedding(50, 16)
    head = ReplicatedLinear(16, 50, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    select_linear_kernels(model, "packed")
    assert head.weight is embed.weight
    torch.testing.assert_close(head(torch.ones(2, 16)), F.linear(torch.ones(2, 16), embed.weight))


def test_column_parallel_ranks_hold_row_slices_and_concatenate_to_the_whole():
    torch.manual_seed(1)
    weight, bias, x = torch.randn(12, 5), torch.randn(12), torch.randn(3, 5)
    parts = []
    for rank in range(2):
        layer = _loaded(ColumnParallelLinear(5, 12, tp=TPGroup(2, rank)), weight, bias)
        assert layer.weight.shape == (6, 5)
        torch.testing.assert_close(layer.weight, weight[rank * 6 : (rank + 1) * 6])
        parts.append(layer(x))
    torch.testing.assert_close(torch.cat(parts, -1), F.linear(x, weight, bias))


def test_row_parallel_partial_sums_add_up_and_the_bias_is_added_once():
    torch.manual_seed(2)
    weight, bias, x = torch.randn(4, 10), torch.randn(4), torch.randn(3, 10)
    total = torch.zeros(3, 4)
    for rank in range(2):
        layer = _loaded(RowParallelLinear(10, 4, tp=TPGroup(2, rank), reduce_results=False), weight, bias)
        assert layer.weight.shape == (4, 5)
        torch.testing.assert_close(layer.weight, weight[:, rank * 5 : (rank + 1) * 5])
        torch.testing.assert_close(layer.bias, bias)  # whole on every rank
        total += layer(x[:, rank * 5 : (rank + 1) * 5])
    torch.testing.assert_close(total, F.linear(x, weight, bias))
    single = _loaded(RowParallelLinear(10, 4), weight, bias)
    torch.testing.assert_close(single(x), F.linear(x, weight, bias))


def test_merged_and_qkv_loaders_place_each_rank_s_share():
    torch.manual_seed(3)
    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    for rank in range(2):
        merged = MergedColumnParallelLinear(6, [8, 8], bias=False, tp=TPGroup(2, rank))
        merged.weight.weight_loader(merged.weight, gate, 0)
        merged.weight.weight_loader(merged.weight, up, 1)
        expected = torch.cat([gate[rank * 4 : rank * 4 + 4], up[rank * 4 : rank * 4 + 4]])
        torch.testing.assert_close(merged.weight, expected)
    head_dim, heads, kv_heads = 2, 4, 2
    q, k, v = torch.randn(heads * head_dim, 6), torch.randn(kv_heads * head_dim, 6), torch.randn(kv_heads * head_dim, 6)
    for tp_size in (1, 2, 4):  # at 4 ranks each k/v head is held by two ranks
        for rank in range(tp_size):
            qkv = QKVParallelLinear(6, head_dim, heads, kv_heads, bias=False, tp=TPGroup(tp_size, rank))
            for shard, tensor in (("q", q), ("k", k), ("v", v)):
                qkv.weight.weight_loader(qkv.weight, tensor, shard)
            q_rows = heads * head_dim // tp_size
            kv_rows = max(kv_heads // tp_size, 1) * head_dim
            kv_index = rank // max(tp_size // kv_heads, 1)
            expected = torch.cat([
                q[rank * q_rows : (rank + 1) * q_rows],
                k[kv_index * kv_rows : (kv_index + 1) * kv_rows],
                v[kv_index * kv_rows : (kv_index + 1) * kv_rows],
            ])
            torch.testing.assert_close(qkv.weight, expected)
    with pytest.raises(ValueError, match="shard"):
        qkv.weight.weight_loader(qkv.weight, q, "o")


def test_bad_shapes_and_groups_raise():
    layer = ReplicatedLinear(4, 3)
    with pytest.raises(ValueError, match="shape"):
        layer.weight.weight_loader(layer.weight, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="divisible"):
        ColumnParallelLinear(4, 7, tp=TPGroup(2, 0))
    with pytest.raises(ValueError, match="rank"):
        TPGroup(2, 2)


def test_an_exhausted_measuring_budget_falls_back_to_packed_weights():
    model = nn.Sequential(ReplicatedLinear(24, 40), ReplicatedLinear(40, 8))
    report = select_linear_kernels(model, "auto", budget_s=0.0)
    assert all(entry["ms"] is None for entry in report["shapes"].values())
    expected = "packed" if packing_available(torch.zeros(1)) else "plain"
    assert all(entry["chosen"] == [expected] * len(M_BUCKETS) for entry in report["shapes"].values())


@pytest.mark.parametrize("cache_bytes,streamed", [(1 << 40, False), (1024, True)])
def test_weights_that_outgrow_the_cache_are_never_timed_at_one_thread(monkeypatch, cache_bytes, streamed):
    from vlmd.layers.linear import selection

    monkeypatch.setattr(selection, "last_level_cache_bytes", lambda: cache_bytes)
    monkeypatch.setattr(selection, "_DECISIONS", {})
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = nn.Sequential(ReplicatedLinear(48, 96), ReplicatedLinear(96, 48))
        report = select_linear_kernels(model, "auto")
    finally:
        torch.set_num_threads(previous)
    assert report["streamed"] is streamed
    timed = {name for entry in report["shapes"].values() for bucket in entry["ms"].values() for name in bucket}
    assert any(name.endswith("@1t") for name in timed) is not streamed
    if streamed:
        assert not any(c.endswith("@1t") for entry in report["shapes"].values() for c in entry["chosen"])
        if packing_available(torch.zeros(1)):  # and the decode buckets take the packed weight
            assert all(entry["chosen"][:-1] == ["packed"] * (len(M_BUCKETS) - 1) for entry in report["shapes"].values())


def test_adopted_linears_of_a_borrowed_module_keep_names_parameters_and_results():
    torch.manual_seed(0)
    tower = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    names = [name for name, _ in tower.named_parameters()]
    weight = tower[0].weight
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = tower(x)
    assert adopt_linear_modules(tower) == 2
    assert isinstance(tower[0], ReplicatedLinear) and isinstance(tower[2][0], ReplicatedLinear)
    assert tower[0].weight is weight  # the same parameter: loading by name is unchanged
    assert [name for name, _ in tower.named_parameters()] == names
    report = select_linear_kernels(tower, "packed")
    assert report["mode"] == "packed"
    with torch.inference_mode():
        torch.testing.assert_close(tower(x), expected, rtol=1e-5, atol=1e-5)
    assert adopt_linear_modules(tower) == 0  # already on the seam


needs_packing = pytest.mark.skipif(not packing_available(torch.zeros(1)), reason="no oneDNN packing here")


@needs_packing
@pytest.mark.parametrize("shape", [(1, 80), (2, 80), (1, 1, 80)])
def test_a_padded_product_keeps_its_own_rows(monkeypatch, shape):
    from vlmd.layers.linear import kernels

    seen = []
    real = kernels.packed_linear
    monkeypatch.setattr(kernels, "packed_linear", lambda x, packed, bias: seen.append(x.shape[0]) or real(x, packed, bias))
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 80), torch.randn(96), torch.randn(*shape)
    kernel = SelectedKernel((PACKED,) * len(M_BUCKETS), None, kernels.pack_weight(weight))
    kernel.pad_rows = 6
    got = kernel(x, bias)
    assert seen == [6] and got.shape == (*shape[:-1], 96)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    kernel(torch.randn(7, 80), bias)  # as many rows as the padding, or more: as it is
    assert seen[-1] == 7


def test_packing_is_offered_only_where_onednn_packs_the_dtype():
    # Where oneDNN cannot pack a dtype on this host (bfloat16 without AVX-512), the seam must
    # not offer the packed kernels: selecting one would raise at load time.
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(32, 16).to(dtype)
        try:
            torch.ops.mkldnn._reorder_linear_weight(weight, None)
            packs = True
        except (RuntimeError, AttributeError):
            packs = False
        assert packing_available(weight) == (packs and torch.backends.mkldnn.is_available())
    assert not packing_available(torch.zeros(4, 4, dtype=torch.float16))
