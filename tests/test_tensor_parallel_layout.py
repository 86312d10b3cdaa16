"""Tensor-parallel layout without processes: which ranks a node runs, which cores a rank
gets, and the settings refused before anything starts."""

from __future__ import annotations

import os
import threading

import pytest

from vlmd.config import ServeConfig
from vlmd.distributed.world import WorldSpec, cores_for
from vlmd.engine.rank_launcher import RankSpec, local_rank_specs
from vlmd.engine.tp_startup import pin_engine_thread


def test_ranks_are_laid_out_node_by_node():
    world = WorldSpec(size=4, nnodes=2, master_addr="10.0.0.1", master_port=29500, timeout_s=60)
    assert list(world.ranks_of_node(0)) == [0, 1] and list(world.ranks_of_node(1)) == [2, 3]
    node0 = local_rank_specs(world, 0, "/m", "float32", None, "info", skip_rank_zero=True)
    assert [(s.rank, s.local_index, s.local_ranks) for s in node0] == [(1, 1, 2)]
    node1 = local_rank_specs(world, 1, "/m", "float32", 2, "info", skip_rank_zero=False)
    assert [(s.rank, s.local_index) for s in node1] == [(2, 0), (3, 1)]
    assert RankSpec.from_json(node1[1].to_json()) == node1[1]
    assert node1[1].world_spec == world


def test_each_rank_gets_its_own_cores():
    available = sorted(os.sched_getaffinity(0))
    first, threads = cores_for(0, 2, None)
    second, _ = cores_for(1, 2, None)
    assert threads == max(1, len(available) // 2) == len(first)
    if len(available) >= 2:
        assert not set(first) & set(second)
    assert cores_for(1, 2, 1) == ([available[1 % len(available)]], 1)
    # More ranks than cores: still bound, wrapping around.
    many, _ = cores_for(len(available), len(available) + 1, 1)
    assert many == [available[0]]


def test_rank_zero_pins_the_calling_thread_alone():
    # The engine thread is pinned before its first torch op (its OpenMP team copies the
    # pin); the other ranks start under the process's mask, returned by the pin.
    config = ServeConfig(model="/m", tensor_parallel_size=2, torch_threads=1)
    before = os.sched_getaffinity(0)
    seen = {}

    def engine_thread() -> None:
        seen["pin"] = pin_engine_thread(config)
        seen["own"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    pin = seen["pin"]
    assert pin.process_mask == before
    assert seen["own"] == set(pin.cores) and pin.threads == 1 and len(pin.cores) == 1
    assert os.sched_getaffinity(0) == before, "the other threads keep the process's cores"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 1234}, "is not a multiple of --nnodes"),
        ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2, "master_port": 1234}, "must be below --nnodes"),
        ({"nnodes": 2, "tensor_parallel_size": 2}, "needs --master-port"),
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size must be at least 1"),
    ],
)
def test_bad_layouts_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(model="m", **settings).validate()
