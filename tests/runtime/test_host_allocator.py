"""Pinned host memory is the neuron device's host allocator: torch.accelerator's host-cache API
works on it after pinned copies (vLLM empties the host cache when it shuts down)."""
import subprocess
import sys

CODE = """
import torch, torchneuron
x = torch.empty(1000, pin_memory=True).fill_(3)
d = torch.zeros(1000, device="neuron")
d.copy_(x, non_blocking=True)
x.copy_(d * 2, non_blocking=True)
torch.accelerator.empty_host_cache()
assert x.is_pinned() and float(x[0]) == 6.0
print("ok")
"""


def test_empty_host_cache_after_pinned_copies():
    # in a child: a regression crashes the interpreter (it was a segfault), not just this test
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
