"""DDP on neuron ranks: loss, gradients and parameters equal a single-process run over all ranks' data,
with several gradient buckets, with gradient accumulation under no_sync, and with a Python comm hook
on gradient bucket views."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from .helpers import batch, cpu_grads, cpu_state, data_parallel_reference, max_diff, mlp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

STEPS = 2


def _ddp_job(accumulate: int, python_hook: bool) -> dict:
    dist.init_process_group("neuron")
    rank, group = dist.get_rank(), dist.group.WORLD
    model = mlp().to("neuron")
    # ~2 KB buckets: several per backward; the Python hook path goes through Work.get_future()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002, gradient_as_bucket_view=python_hook)
    if python_hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = {"losses": [], "collectives": []}
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro, rank, device="neuron")
            sync = micro == accumulate - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = F.mse_loss(ddp(x), y) / accumulate
                before = group.issued
                loss.backward()
            out["collectives"].append(group.issued - before)
            out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = cpu_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = cpu_state(model)
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world,accumulate,python_hook", [(2, 1, False), (2, 2, False), (2, 1, True), (4, 2, False)],
                         ids=["2ranks", "2ranks_accumulate2_no_sync", "2ranks_allreduce_hook_bucket_views",
                              "4ranks_accumulate2_no_sync"])
def test_ddp_matches_single_process(request, world, accumulate, python_hook):
    ranks = request.getfixturevalue(f"pool{world}").run(_ddp_job, (accumulate, python_hook), timeout=150)
    reference = data_parallel_reference(len(ranks), STEPS, accumulate)
    for rank, out in enumerate(ranks):
        expected_losses = [loss for r, loss in reference["losses"] if r == rank]
        assert out["losses"] == pytest.approx(expected_losses, rel=1e-5)
        assert max_diff(out["grads"], reference["grads"]) < 1e-5
        assert max_diff(out["params"], reference["params"]) < 1e-5
        synced = out["collectives"][accumulate - 1::accumulate]
        skipped = [n for i, n in enumerate(out["collectives"]) if i % accumulate != accumulate - 1]
        # the first step runs one large first bucket; from the second on, ~2 KB buckets: several all-reduces
        assert synced[0] >= 1 and synced[1] > 1
        assert all(n == 0 for n in skipped)  # no_sync: no all-reduce in backward
