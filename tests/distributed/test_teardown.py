"""Two real rank processes (not a RankPool, whose ranks skip the interpreter's teardown) train a
tensor-parallel model with torch.optim.SGD next to DDP, FSDP2, point-to-point, an unwaited async
collective and a subgroup, then exit with and without destroy_process_group: both ranks exit 0 (no
SIGABRT from a thread or static destructor at exit) and the TP+SGD parameters equal one process's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from torchneuron.distributed import free_port

from .helpers import norm_mlp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3


def tp_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step))


def train(model: nn.Module, device: str) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # neuron's default: foreach
    for step in range(STEPS):
        model(tp_batch(step).to(device)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def rank_main(destroy: bool, out: str) -> None:
    """One rank's whole job (run in a fresh interpreter by the test)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import torchneuron  # noqa: F401

    dist.init_process_group("neuron")
    rank = dist.get_rank()
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = parallelize_module(norm_mlp().to("neuron"), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    train(model, "neuron")
    params = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().tolist()
              for k, p in model.named_parameters()}

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 8).to("neuron"))
    ddp(torch.randn(4, 8, device="neuron")).sum().backward()
    sharded = fully_shard(nn.Linear(8, 8).to("neuron"))
    sharded(torch.randn(4, 8, device="neuron")).sum().backward()
    message = torch.full((4,), float(rank), device="neuron")
    if rank == 0:
        dist.send(message, 1)
    else:
        dist.recv(message, 0)
    subgroup = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4, device="neuron"), group=subgroup)
    dist.all_reduce(torch.ones(4, device="neuron"), async_op=True)  # left unwaited on purpose
    if destroy:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(params, f)


def _launch(destroy: bool, tmp_path) -> tuple[list[subprocess.CompletedProcess], dict]:
    out, port = tmp_path / f"params_{destroy}.json", free_port()
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); from tests.distributed.test_teardown import rank_main; "
            f"rank_main({destroy}, {str(out)!r})")
    processes = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        processes.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    done = []
    for process in processes:
        output, _ = process.communicate(timeout=200)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, output))
    return done, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize("destroy", [True, False], ids=["destroy_process_group", "no_destroy"])
def test_two_ranks_exit_zero_and_tp_sgd_matches_one_process(destroy, tmp_path):
    ranks, params = _launch(destroy, tmp_path)
    for rank, result in enumerate(ranks):
        assert result.returncode == 0, f"rank {rank} exited with {result.returncode}:\n{result.stdout[-3000:]}"
        assert "terminate called" not in result.stdout
    reference = norm_mlp()
    train(reference, "cpu")
    for name, value in reference.named_parameters():
        torch.testing.assert_close(torch.tensor(params[name]), value.detach(), rtol=1e-5, atol=1e-6)
