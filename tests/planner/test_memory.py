"""The memory plan: arithmetic checked by hand, and the traced parameter bytes of a real model."""
import pytest
import torch

from torchneuron.planner.build import ParallelSpec
from torchneuron.planner.memory import GIB, MemoryPlan
from torchneuron.planner.step import StepSetup, trace_step
from torchneuron.planner.world import simulated_world

from tests.planner.conftest import TINY


def test_arithmetic_and_fit():
    plan = MemoryPlan({"parameters": 2 * GIB, "gradients": 2 * GIB, "optimizer state": 4 * GIB,
                       "activations": 6 * GIB, "communication buffers": 1 * GIB}, hbm_bytes=24 * GIB,
                      reserved_fraction=0.1)
    assert plan.total == 15 * GIB
    assert plan.capacity == pytest.approx(21.6 * GIB)
    assert plan.fits and plan.verdict().startswith("fits: 15.00 GiB of 21.60 GiB")


def test_does_not_fit_names_the_largest_item_and_the_sharding_it_needs():
    plan = MemoryPlan({"parameters": 8 * GIB, "gradients": 8 * GIB, "optimizer state": 16 * GIB,
                       "activations": 4 * GIB, "communication buffers": 1.6 * GIB}, hbm_bytes=24 * GIB)
    assert not plan.fits
    # shardable 32 GiB must fit in 21.6 - 5.6 = 16 GiB: twice the sharding
    assert plan.sharding_factor() == pytest.approx(2.0)
    message = plan.verdict()
    assert "does not fit: needs 37.60 GiB of 21.60 GiB" in message
    assert "largest item is optimizer state (16.00 GiB)" in message and "2x more" in message and "--fsdp" in message


def test_activations_advice_depends_on_checkpointing():
    items = {"parameters": 1 * GIB, "activations": 30 * GIB}
    off = MemoryPlan(dict(items), hbm_bytes=24 * GIB, checkpointing=False)
    on = MemoryPlan(dict(items), hbm_bytes=24 * GIB, checkpointing=True)
    assert "activation checkpointing" in off.advice() and "activation checkpointing" not in on.advice()
    assert "cut activations by 9.4 GiB" in on.advice()   # 31 GiB needed, 21.6 usable


def test_traced_parameters_match_the_hand_count():
    d, h, v, layers = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"], TINY["num_hidden_layers"]
    per_layer = 4 * d * d + 3 * d * h + 2 * d          # q, k, v, o; gate, up, down; two norms
    numel = 2 * v * d + layers * per_layer + d          # embedding, untied output layer, final norm
    with simulated_world(2):
        trace = trace_step(StepSetup(dict(TINY), ParallelSpec(fsdp=2), torch.bfloat16, 1, 16))
    assert trace.param_numel == numel // 2              # FSDP: each rank holds half
    assert trace.param_bytes == numel // 2 * 4          # FP32 sharded parameters (bf16 compute)
    assert trace.optimizer_bytes == 2 * numel // 2 * 4  # AdamW: two FP32 moments per element
