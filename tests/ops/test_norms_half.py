"""Every norm op in half precision gives the CPU's values on neuron, forward and backward, with
CUDA's float32 statistics (runtime/csrc/norms.cpp)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEV = "neuron"


def _running(x):
    return torch.zeros(3, dtype=x.dtype, device=x.device), torch.ones(3, dtype=x.dtype, device=x.device)


NORMS = {
    "batch_norm_train": ((4, 3, 6, 6), 2, lambda x, w, b: F.batch_norm(x, *_running(x), w, b, training=True)),
    "batch_norm_eval": ((4, 3, 6, 6), 2, lambda x, w, b: F.batch_norm(x, *_running(x), w, b, training=False)),
    "instance_norm": ((4, 3, 6, 6), 2, lambda x, w, b: F.instance_norm(x, None, None, w, b)),
    "instance_norm_running": ((4, 3, 6, 6), 0, lambda x: F.instance_norm(x, *_running(x))),
    "instance_norm_1d": ((2, 3, 9), 0, lambda x: F.instance_norm(x)),
    "layer_norm": ((4, 3, 6), 2, lambda x, w, b: F.layer_norm(x, (6,), w, b)),
    "layer_norm_no_affine": ((4, 3, 6), 0, lambda x: F.layer_norm(x, (6,))),
    "group_norm": ((4, 3, 6, 6), 2, lambda x, w, b: F.group_norm(x, 3, w, b)),
    "rms_norm": ((4, 3, 6), 1, lambda x, w: F.rms_norm(x, (6,), w)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(NORMS))
def test_half_precision_norm_matches_cpu(name, dtype):
    shape, n_params, fn = NORMS[name]
    torch.manual_seed(0)
    param_size = shape[-1] if name.startswith(("layer", "rms")) else shape[1]
    x = (torch.randn(shape) * 2 + 1).to(dtype).requires_grad_()
    params = [torch.randn(param_size).to(dtype).requires_grad_() for _ in range(n_params)]
    grad = torch.randn(shape).to(dtype)
    out = fn(x, *params)
    out.backward(grad)
    xd = x.detach().to(DEV).requires_grad_()
    pd = [p.detach().to(DEV).requires_grad_() for p in params]
    outd = fn(xd, *pd)
    outd.backward(grad.to(DEV))
    torch.testing.assert_close(outd.cpu(), out)  # PyTorch's default tolerance for the dtype
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
    for p, q in zip(params, pd):
        torch.testing.assert_close(q.grad.cpu(), p.grad)


@pytest.mark.parametrize("op", ["layer_norm", "batch_norm"])
def test_saved_statistics_are_float32_as_on_cuda(op):
    x = torch.randn(4, 3, 5, device=DEV, dtype=torch.bfloat16)
    if op == "layer_norm":
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, (5,), None, None, 1e-5)
    else:
        _, mean, rstd = torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32
