"""Collective pricing on the cluster topology, and logical NeuronCores."""
import pytest
import torch

from torchneuron.hardware import TARGETS, collective_cost
from torchneuron.planner.cluster import instance, logical_target
from torchneuron.planner.topology import Topology

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def topology(nodes=4, target="trn2", lnc=2):
    return Topology(instance(target), logical_target(target, lnc), nodes)


def test_lnc2_is_two_physical_cores():
    one, two = logical_target("trn2", 1), logical_target("trn2", 2)
    assert two.peak_flops(torch.bfloat16) == 2 * one.peak_flops(torch.bfloat16)
    assert two.hbm_bytes == 2 * one.hbm_bytes and two.cores_per_chip == one.cores_per_chip // 2
    assert topology(1).world_size == 16 * 4 and topology(1, lnc=1).world_size == 16 * 8
    with pytest.raises(ValueError, match="LNC=1"):
        logical_target("trn1", 2)


def test_ranks_are_placed_core_major():
    topo = topology(2)
    assert topo.place(0) == (0, 0, 0) and topo.place(5) == (0, 1, 1) and topo.place(64) == (1, 0, 0)
    with pytest.raises(ValueError, match="outside"):
        topo.place(128)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ranks", [range(4), range(0, 64, 4), range(64), range(0, 256, 64), range(256)])
def test_cost_grows_with_bytes(kind, ranks):
    topo = topology(4)
    times = [topo.collective(kind, n, list(ranks))[0].duration_s for n in (1 << 10, 1 << 20, 1 << 26, 1 << 30)]
    assert all(a < b for a, b in zip(times, times[1:])), times


@pytest.mark.parametrize("kind", KINDS)
def test_across_nodes_costs_more_than_within_a_node(kind):
    topo = topology(4)
    nbytes = 64 << 20
    within = topo.collective(kind, nbytes, list(range(0, 64, 4)))[0].duration_s      # 16 ranks, one node
    across = topo.collective(kind, nbytes, [n * 64 + c for n in range(4) for c in range(0, 16, 4)])[0].duration_s
    assert across > within
    assert "efa" in topo.collective(kind, nbytes, list(range(0, 256, 16)))[1]


def test_within_a_chip_is_the_device_model_price():
    topo = topology(1)
    cost, algorithm = topo.collective("all_reduce", 1 << 20, [0, 1, 2, 3])
    assert algorithm == "ring(chip)"
    assert cost == collective_cost("all_reduce", 1 << 20, 4, logical_target("trn2", 2))


def test_whole_torus_uses_the_2d_algorithm_and_small_messages_a_tree():
    topo = topology(1)
    big = topo.collective("all_reduce", 1 << 28, list(range(0, 64, 4)))
    assert big[1] == "torus2d"
    small = topo.collective("all_reduce", 64, list(range(0, 64, 4)))
    assert small[1].startswith("tree")
    # the tree's log-depth latency beats the ring's 2(n-1) steps for tiny messages
    assert small[0].duration_s < 2 * 15 * TARGETS["trn2"].link_step_latency_s
