"""Convolutions under torch.compile: the device's results have the CPU kernel's layout
(channels_last for channels_last inputs or weights), and fake tensors predict that layout
(ops/conv_layout.py), so compiled epilogues index them correctly."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode


def conv2d(x, w, b):
    return F.conv2d(x, w, b, stride=(2, 2), padding=2)


def conv_transpose2d(x, w, b):
    return F.conv_transpose2d(x, w, b, stride=(2, 2), padding=2, output_padding=(1, 1))


def _operands(layout: str, requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 6, 6, generator=g), torch.randn(3, 3, 3, 3, generator=g), torch.randn(3, generator=g)
    if layout in ("input", "both"):
        x = x.to(memory_format=torch.channels_last)
    if layout in ("weight", "both"):
        w = w.to(memory_format=torch.channels_last)
    return x, w.requires_grad_(requires_grad), b


@pytest.mark.parametrize("layout", ["contiguous", "input"])
@pytest.mark.parametrize("fn", [conv2d, conv_transpose2d])
def test_compiled_convolution_with_bias_matches_cpu(fn, layout):
    torch._dynamo.reset()
    x, w, b = _operands(layout)
    compiled = torch.compile(lambda x, w, b: fn(x, w, b).relu() + 1, backend="neuron", dynamic=False)
    got = compiled(x.to("neuron"), w.to("neuron"), b.to("neuron"))
    expected = fn(x, w, b).relu() + 1
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert got.stride() == expected.stride()


@pytest.mark.parametrize("layout", ["contiguous", "input", "weight", "both"])
@pytest.mark.parametrize("transposed", [False, True])
def test_eager_convolution_layout_is_the_cpus_and_what_fake_tensors_predict(transposed, layout):
    fn = conv_transpose2d if transposed else conv2d
    x, w, _ = _operands(layout, requires_grad=True)
    xn, wn = x.detach().to("neuron"), w.detach().to("neuron").requires_grad_()
    with FakeTensorMode() as mode:
        fake = fn(mode.from_tensor(xn), mode.from_tensor(wn), None)
    real, cpu = fn(xn, wn, None), fn(x, w, None)
    assert real.shape == fake.shape == cpu.shape
    assert real.stride() == fake.stride() == cpu.stride()
    (grad_w,), (cpu_grad_w,) = torch.autograd.grad(real.sum(), wn), torch.autograd.grad(cpu.sum(), w)
    assert grad_w.stride() == cpu_grad_w.stride()
    torch.testing.assert_close(grad_w.cpu(), cpu_grad_w, atol=1e-5, rtol=1e-5)
