"""Point-to-point transfers carry the sender's modeled time: a receiver's copy cannot finish before
the sender's data left, so a rank waiting on another (a pipeline stage) waits on its timeline."""
import pytest
import torch
import torch.distributed as dist

from torchneuron.hardware.timeline import flush_pending, get_timeline

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _now(device: torch.device) -> float:
    torch.neuron.synchronize()
    flush_pending()
    return get_timeline(device.index).synchronize()


def _job() -> dict:
    dist.init_process_group("neuron")
    rank = dist.get_rank()
    device = torch.device("neuron", torch.neuron.current_device())
    x = torch.ones(512, 512, device=device)
    out = {}
    if rank == 0:
        for _ in range(30):   # the sender is busy first
            x = x @ x / 512
        out["before_send"] = _now(device)
        dist.send(x, 1)
    else:
        out["before_recv"] = _now(device)
        dist.recv(x, 0)
        out["after_recv"] = _now(device)
        out["value"] = float(x[0, 0].cpu())
    dist.destroy_process_group()
    return out


def test_receiver_waits_for_the_senders_modeled_time(pool2):
    sender, receiver = pool2.run(_job, timeout=100)
    assert receiver["value"] == 1.0
    assert receiver["before_recv"] < sender["before_send"]       # the receiver posted early
    assert receiver["after_recv"] > sender["before_send"]        # ... and got the data after it was sent
