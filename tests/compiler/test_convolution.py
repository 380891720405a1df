"""Convolutions under torch.compile: the device's results have the layout fake tensors predict
for a backend's own convolution (contiguous), so compiled epilogues index them correctly."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode


def conv2d(x, w, b):
    return F.conv2d(x, w, b, stride=(2, 2), padding=2)


def conv_transpose2d(x, w, b):
    return F.conv_transpose2d(x, w, b, stride=(2, 2), padding=2, output_padding=(1, 1))


@pytest.mark.parametrize("fn", [conv2d, conv_transpose2d])
def test_compiled_convolution_with_bias_matches_cpu(fn):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 3, 4, 4, generator=g), torch.randn(3, 3, 3, 3, generator=g), torch.randn(3, generator=g)
    compiled = torch.compile(fn, backend="neuron", dynamic=False)
    got = compiled(x.to("neuron"), w.to("neuron"), b.to("neuron"))
    torch.testing.assert_close(got.cpu(), fn(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_eager_convolution_layout_is_what_fake_tensors_predict(transposed):
    x = torch.randn(2, 3, 6, 6, device="neuron").to(memory_format=torch.channels_last)
    w = torch.randn(3, 3, 3, 3, device="neuron", requires_grad=True).to(memory_format=torch.channels_last)
    fn = conv_transpose2d if transposed else conv2d
    with FakeTensorMode() as mode:
        fake = fn(mode.from_tensor(x), mode.from_tensor(w), None)
    real = fn(x, w, None)
    assert real.shape == fake.shape and real.stride() == fake.stride()
    (grad_w,) = torch.autograd.grad(real.sum(), w)
    assert grad_w.is_contiguous()
