"""Bad input and faults across ranks: every rank gets a clear error, nothing hangs, and the group
stays usable after a mismatch."""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from torchneuron.distributed import CollectiveMismatchError, spawn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _ones(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device="neuron")


def _mismatch_job() -> dict:
    dist.init_process_group("neuron")
    r = dist.get_rank()
    calls = {
        "shape": lambda: dist.all_reduce(_ones(4 + r)),
        "dtype": lambda: dist.all_reduce(_ones(4, torch.float32 if r == 0 else torch.float64)),
        "collective": lambda: dist.all_reduce(_ones(4)) if r == 0 else dist.broadcast(_ones(4), 0),
        "gather_output": lambda: dist.all_gather_into_tensor(_ones(8 + r), _ones(4)),
        "splits": lambda: dist.all_to_all_single(_ones(4), _ones(4), [1, 3] if r == 0 else [2, 2], [2, 2]),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except CollectiveMismatchError as error:
            out[name] = str(error)
    t = _ones(2)
    dist.all_reduce(t)
    out["usable_after"] = t.cpu().tolist()
    return out


def test_mismatches_raise_on_every_rank_and_the_group_survives(pool2):
    results = pool2.run(_mismatch_job, timeout=120)
    for out in results:
        assert "input sizes differ" in out["shape"] and "4 elements" in out["shape"] and "5 elements" in out["shape"]
        assert "different dtypes" in out["dtype"]
        assert "different collectives" in out["collective"] and "broadcast" in out["collective"]
        assert "world_size times the input" in out["gather_output"]
        assert "split sizes do not match" in out["splits"]
        assert out["usable_after"] == [2.0, 2.0]


def _dead_rank_job(timeout_s: float):
    dist.init_process_group("neuron", timeout=datetime.timedelta(seconds=timeout_s))
    t = _ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        os._exit(17)  # a crash mid-training: no cleanup, sockets closed by the OS
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        return "no error", "", 0.0
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error), time.monotonic() - start


def test_a_rank_that_dies_fails_the_others_fast_with_a_clear_error():
    (name, message, elapsed), dead = spawn(_dead_rank_job, 2, (30.0,), timeout=120, allow_exit=True)
    assert dead is None
    assert name == "DistBackendError"
    assert "peer rank closed its connection" in message and "rank 0 of 2" in message
    assert elapsed < 30.0


def _hung_rank_job(timeout_s: float):
    dist.init_process_group("neuron", timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_rank() == 1:
        time.sleep(timeout_s + 3)  # joins the collective too late
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(_ones(4))
        return "no error", "", 0.0
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error), time.monotonic() - start


def test_a_hung_rank_times_the_others_out_within_the_configured_timeout():
    (name, message, elapsed), _ = spawn(_hung_rank_job, 2, (3.0,), timeout=120)
    assert name == "DistBackendError"
    assert "timed out after 3 s" in message
    assert 2.5 < elapsed < 15.0
