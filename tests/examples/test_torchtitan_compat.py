"""The pre-split micro-batch backport torchtitan's pipeline trainer needs on torch 2.13: a schedule
stepped with `arg_mbs`/`target_mbs` lists gives the losses and gradients of the same schedule
stepped with the whole batch, for single-stage (GPipe, 1F1B) and multi-stage (Interleaved1F1B)
schedules, on one neuron rank; mixing the two input modes is refused. Needs no torchtitan."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from torchneuron.distributed import free_port
from torchneuron.examples import torchtitan_compat

pytestmark = pytest.mark.timeout(120)

MICROBATCHES = 2


@pytest.fixture(scope="module")
def one_rank_group():
    torchtitan_compat.install()
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _schedule(schedule_class: type, stages: int) -> tuple[object, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(stages))).to("neuron")
    pipeline = [PipelineStage(model[i], stage_index=i, num_stages=stages, device=torch.device("neuron", 0))
                for i in range(stages)]
    return schedule_class(pipeline if stages > 1 else pipeline[0], n_microbatches=MICROBATCHES,
                          loss_fn=F.mse_loss), model


@pytest.mark.parametrize("schedule_class,stages", [(ScheduleGPipe, 1), (Schedule1F1B, 1),
                                                   (ScheduleInterleaved1F1B, 2)],
                         ids=["gpipe", "1f1b", "interleaved1f1b"])
def test_presplit_microbatches_equal_the_whole_batch(one_rank_group, schedule_class, stages):
    x, y = torch.randn(4, 8, device="neuron"), torch.randn(4, 8, device="neuron")
    whole, whole_model = _schedule(schedule_class, stages)
    whole_losses: list[torch.Tensor] = []
    whole.step(x, target=y, losses=whole_losses)

    presplit, presplit_model = _schedule(schedule_class, stages)
    presplit_losses: list[torch.Tensor] = []
    presplit.step(arg_mbs=[(mb,) for mb in x.chunk(MICROBATCHES)], target_mbs=list(y.chunk(MICROBATCHES)),
                  losses=presplit_losses)

    assert len(presplit_losses) == MICROBATCHES
    torch.testing.assert_close(torch.stack(presplit_losses).cpu(), torch.stack(whole_losses).cpu(), rtol=0, atol=0)
    for got, want in zip(presplit_model.parameters(), whole_model.parameters()):
        torch.testing.assert_close(got.grad.cpu(), want.grad.cpu(), rtol=0, atol=0)


def test_presplit_eval_equals_the_whole_batch(one_rank_group):
    """torchtitan's validator calls `eval(arg_mbs=..., target_mbs=...)`: forward only, no gradients."""
    x, y = torch.randn(4, 8, device="neuron"), torch.randn(4, 8, device="neuron")
    schedule, model = _schedule(Schedule1F1B, 1)
    whole_losses: list[torch.Tensor] = []
    schedule.eval(x, target=y, losses=whole_losses)
    presplit_losses: list[torch.Tensor] = []
    schedule.eval(arg_mbs=[(mb,) for mb in x.chunk(MICROBATCHES)], target_mbs=list(y.chunk(MICROBATCHES)),
                  losses=presplit_losses)
    torch.testing.assert_close(torch.stack(presplit_losses).cpu(), torch.stack(whole_losses).cpu(), rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())


def test_presplit_and_whole_batch_inputs_do_not_mix(one_rank_group):
    schedule, _ = _schedule(ScheduleGPipe, 1)
    x = torch.randn(4, 8, device="neuron")
    with pytest.raises(TypeError, match="cannot be mixed.*target"):
        schedule.step(arg_mbs=[(mb,) for mb in x.chunk(MICROBATCHES)], target=x)
