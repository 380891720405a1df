"""The device contract PyTorch's CUDA backend keeps, kept by neuron: capability queries, lazy
initialisation across fork, the torch.cuda functions libraries call through a device module, and
autograd's worker threads left alone outside neuron work."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch


def test_accelerator_capability():
    capability = torch.accelerator.get_device_capability()
    dtypes = capability["supported_dtypes"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float8_e4m3fn):
        assert dtype in dtypes
    assert torch.accelerator.get_device_capability("neuron:1")["supported_dtypes"] == dtypes
    with pytest.raises(RuntimeError, match="out of range"):
        torch.accelerator.get_device_capability(7)


def test_pinned_memory_reaches_every_address_of_the_block():
    pinned = torch.arange(16.0).pin_memory()
    storage = pinned.untyped_storage()
    view = torch.empty(0).set_(storage[16:], 0, (4,), (1,))  # a storage over a slice of the pinned one
    assert view.is_pinned() and torch.equal(view, pinned[4:8])
    assert not torch.empty(0).set_(torch.arange(16.0).untyped_storage()[16:], 0, (4,), (1,)).is_pinned()
    assert not torch.arange(4.0).is_pinned()


def test_torch_neuron_answers_what_libraries_ask():
    """The torch.cuda functions transformers, accelerate, vLLM, diffusers and torchao call for a
    device module, with the device's answers."""
    neuron = torch.neuron
    assert neuron.is_bf16_supported() and neuron.is_bf16_supported(including_emulation=False)
    assert neuron.is_tf32_supported()
    assert neuron.is_initialized() and neuron._initialized and not neuron._is_in_bad_fork()
    assert neuron._is_compiled()
    assert neuron.can_device_access_peer(0, 1) and not neuron.can_device_access_peer(0, 0)
    assert not neuron.is_current_stream_capturing()
    assert neuron.OutOfMemoryError is torch.OutOfMemoryError
    x = torch.ones(1024, device="neuron")
    assert neuron.max_memory_allocated() >= x.nbytes
    neuron.reset_max_memory_allocated()
    assert neuron.max_memory_allocated() == neuron.memory_allocated()
    neuron.ipc_collect()
    # submodules, as torch.cuda.random / torch.cuda.memory (transformers' Trainer restores RNG state so)
    state = neuron.random.get_rng_state_all()
    neuron.random.set_rng_state_all(state)
    assert neuron.memory.memory_allocated() == neuron.memory_allocated()
    assert torch.get_device_module("neuron") is neuron
    free, total = neuron.mem_get_info()
    assert 0 < free <= total


def test_transformers_bf16_training_arguments():
    pytest.importorskip("transformers")
    from transformers.utils import import_utils

    import_utils.is_torch_bf16_gpu_available.cache_clear()
    assert import_utils.is_torch_bf16_gpu_available()  # TrainingArguments(bf16=True) asks this


def test_autograd_threads_stay_on_outside_neuron_work():
    """Importing torchneuron leaves autograd's worker threads on for everyone; only a backward pass
    rooted on neuron tensors runs on the calling thread."""
    assert torch.autograd.is_multithreading_enabled()
    threads = []
    x = torch.randn(3, device="neuron", requires_grad=True)
    y = (x * 2).sum()
    y.grad_fn.register_hook(lambda *_: threads.append(threading.get_ident()))
    y.backward()
    assert threads == [threading.get_ident()]
    assert torch.autograd.is_multithreading_enabled()
    torch.testing.assert_close(x.grad.cpu(), torch.full((3,), 2.0))
    (g,) = torch.autograd.grad((x * 3).sum(), x)
    torch.testing.assert_close(g.cpu(), torch.full((3,), 3.0))


_FORK_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch

    def in_child(fn):
        pid = os.fork()
        if pid == 0:
            try:
                fn()
                code = 0
            except RuntimeError as e:
                code = 3 if "Cannot re-initialize neuron in forked subprocess" in str(e) else 4
            except BaseException:
                code = 5
            os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    use = lambda: torch.ones(2, device="neuron").sum().item()
    before = in_child(use)  # the parent has not used the device: the child may
    assert not torch.neuron.is_initialized()
    use()
    assert torch.neuron.is_initialized()
    after = in_child(use)
    def bad_fork():
        if not torch.neuron._is_in_bad_fork() or torch.neuron.is_initialized():
            raise ValueError("the child does not know it is a bad fork")

    after_flag = in_child(bad_fork)
    print(before, after, after_flag)
""")


@pytest.mark.multiprocess
def test_lazy_init_in_a_forked_child_fails_like_cuda():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-3:] == ["0", "3", "0"]


def _timed(fn) -> float:
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def test_events_time_every_piece_of_work():
    """Two events recorded around any device work on their stream are apart: ops, fills, copies in
    and out, device-to-device copies (on the source device's stream, as CUDA runs them)."""
    x = torch.randn(8, device="neuron")
    work = {
        "op": lambda: x + 1, "fill": lambda: torch.ones(8, device="neuron"), "in-place": lambda: x.mul_(1),
        "host to device": lambda: torch.ones(8).to("neuron"), "device to host": lambda: x.cpu(),
        "to another device": lambda: x.to("neuron:1"), "item": lambda: x.sum().item(),
    }
    for name, fn in work.items():
        assert _timed(fn) > 0, name
    assert _timed(lambda: None) == 0.0
