"""The FSDP2 + TP example runs on 4 ranks under torchrun and learns."""
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(240)]

LINE = re.compile(r"step (\d+)  loss ([\d.]+)  host ([\d,]+) tokens/s  modeled trn2 step ([\d.]+) ms")


def test_train_distributed_example_under_torchrun():
    done = subprocess.run([sys.executable, "-m", "torchneuron.examples.train_distributed", "--steps", "5"],
                          capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [LINE.search(line) for line in done.stdout.splitlines()]
    steps = [m for m in steps if m]
    assert [int(m[1]) for m in steps] == list(range(5))  # printed once, by rank 0
    losses = [float(m[2]) for m in steps]
    assert losses[-1] < losses[0]
    assert all(float(m[4]) > 0 for m in steps)
