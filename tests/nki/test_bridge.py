"""The PyTorch bridge: kernels on neuron tensors (charged to the device timeline), kernels
as torch custom ops (eager, neuron, torch.compile) and autograd through a backward kernel."""
import pytest
import torch

import torchneuron  # noqa: F401  (registers the neuron device)
import torchneuron.nki as nki
from torchneuron.hardware import timeline
from torchneuron.kernels import norms
from torchneuron.kernels import torch_ops as kops


def test_kernel_on_neuron_tensors_runs_on_device_and_is_charged():
    x, w = torch.randn(200, 256), torch.randn(256)
    xd, wd = x.to("neuron"), w.to("neuron")
    seen = []
    timeline.add_listener(seen.append)
    try:
        out = norms.rmsnorm(xd, wd)
        torch.neuron.synchronize()
    finally:
        timeline.remove_listener(seen.append) if hasattr(timeline, "remove_listener") else None
    assert out.device.type == "neuron"
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(out.cpu(), ref, atol=1e-5)
    entry = next(e for e in seen if e.name == "nki::rmsnorm")
    assert entry.duration_s >= norms.rmsnorm.last_stats.latency_s
    assert entry.meta["instructions"] == norms.rmsnorm.last_stats.instructions


def test_kernel_writing_a_neuron_input_in_place():
    @nki.jit
    def scale_(x):
        import torchneuron.nki.language as nl
        nl.store(x, value=nl.multiply(nl.load(x), 2.0))

    xd = torch.ones(64, 32, device="neuron")
    scale_(xd)
    assert torch.equal(xd.cpu(), torch.full((64, 32), 2.0))


def test_nki_op_eager_cpu_and_neuron():
    x, w = torch.randn(130, 64), torch.randn(64)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(torch.ops.nki_kernels.rmsnorm(x, w, 1e-6), ref, atol=1e-5)
    out = kops.rmsnorm(x.to("neuron"), w.to("neuron"))
    assert out.device.type == "neuron" and torch.allclose(out.cpu(), ref, atol=1e-5)


def test_nki_op_under_torch_compile():
    x, w = torch.randn(128, 64), torch.randn(64)

    def f(x, w):
        return kops.rmsnorm(x * 2.0, w) + 1.0
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fake impl + functionalization
    assert torch.allclose(compiled(x, w), f(x, w), atol=1e-5)
    xg = x.clone().requires_grad_()
    compiled(xg, w).sum().backward()
    xr = x.clone().requires_grad_()
    f(xr, w).sum().backward()
    assert torch.allclose(xg.grad, xr.grad, atol=1e-4)


def test_autograd_through_backward_kernel():
    x = torch.randn(96, 64, dtype=torch.float32, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    kops.rmsnorm(x, w).pow(2).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * w2).pow(2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-4)
    assert torch.allclose(w.grad, w2.grad, atol=1e-3)


def test_flash_attention_op():
    q, k, v = (torch.randn(256, 64) for _ in range(3))
    out = kops.flash_attention(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    assert torch.allclose(out, ref, atol=1e-5)
