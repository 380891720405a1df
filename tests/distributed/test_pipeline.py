"""Pipeline parallelism (`torch.distributed.pipelining`, GPipe and 1F1B) over two neuron ranks: the
last stage's losses and every stage's gradients equal a single-process run of the whole model."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from helpers import batch, cpu_grads, max_diff, mlp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

MICROBATCHES = 4
SPLIT = 4  # layers [0, 4) on stage 0, the rest on stage 1


def _stage_modules() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = mlp(depth=4)
    return model[:SPLIT], model[SPLIT:]


def _pipeline_job() -> dict:
    dist.init_process_group("neuron")
    rank = dist.get_rank()
    device = torch.device("neuron", torch.neuron.current_device())
    x, y = batch(0, 0, rows=4 * MICROBATCHES, device="neuron")
    out = {}
    for name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        module = _stage_modules()[rank].to(device)
        stage = PipelineStage(module, stage_index=rank, num_stages=2, device=device)
        schedule = schedule_class(stage, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        out[name] = {"losses": [loss.item() for loss in losses], "grads": cpu_grads(module)}
    dist.destroy_process_group()
    return out


def _reference() -> list[dict]:
    first, last = _stage_modules()
    x, y = batch(0, 0, rows=4 * MICROBATCHES)
    losses = [F.mse_loss(last(first(xm)), ym) for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]
    (sum(losses) / MICROBATCHES).backward()  # the schedules average gradients over microbatches
    return [{"losses": [], "grads": cpu_grads(first)}, {"losses": [loss.item() for loss in losses],
                                                         "grads": cpu_grads(last)}]


@pytest.fixture(scope="module")
def stages(pool2):
    return pool2.run(_pipeline_job, timeout=150)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_schedule_matches_single_process(stages, schedule):
    reference = _reference()
    for out, expected in zip(stages, reference):
        assert out[schedule]["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert max_diff(out[schedule]["grads"], expected["grads"]) < 1e-6
