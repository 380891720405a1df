"""Pipeline parallelism (`torch.distributed.pipelining`, GPipe and 1F1B) over 2 and 4 neuron ranks:
the last stage's losses and every stage's gradients equal a single-process run of the whole model."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .helpers import batch, cpu_grads, max_diff, mlp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

MICROBATCHES = 4


def _stage_modules(stages: int) -> list[torch.nn.Module]:
    """The layers of one MLP split into `stages` consecutive pieces."""
    model = mlp(depth=4)
    bounds = [round(i * len(model) / stages) for i in range(stages + 1)]
    return [model[bounds[i]:bounds[i + 1]] for i in range(stages)]


def _pipeline_job() -> dict:
    dist.init_process_group("neuron")
    rank, stages = dist.get_rank(), dist.get_world_size()
    device = torch.device("neuron", torch.neuron.current_device())
    x, y = batch(0, 0, rows=4 * MICROBATCHES, device="neuron")
    out = {}
    for name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        module = _stage_modules(stages)[rank].to(device)
        stage = PipelineStage(module, stage_index=rank, num_stages=stages, device=device)
        schedule = schedule_class(stage, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == stages - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        out[name] = {"losses": [loss.item() for loss in losses], "grads": cpu_grads(module)}
    dist.destroy_process_group()
    return out


def _reference(stages: int) -> list[dict]:
    pieces = _stage_modules(stages)
    model = torch.nn.Sequential(*pieces)
    x, y = batch(0, 0, rows=4 * MICROBATCHES)
    losses = [F.mse_loss(model(xm), ym) for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]
    (sum(losses) / MICROBATCHES).backward()  # the schedules average gradients over microbatches
    out = [{"losses": [], "grads": cpu_grads(piece)} for piece in pieces]
    out[-1]["losses"] = [loss.item() for loss in losses]
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2stages", "4stages"])
def stages(request):
    return request.getfixturevalue(f"pool{request.param}").run(_pipeline_job, timeout=150)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_schedule_matches_single_process(stages, schedule):
    reference = _reference(len(stages))
    for out, expected in zip(stages, reference):
        assert out[schedule]["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert max_diff(out[schedule]["grads"], expected["grads"]) < 1e-6
