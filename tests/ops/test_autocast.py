"""torch.autocast("neuron") follows CUDA's policy: PyTorch's CUDA autocast test lists, its banned ops,
and PyTorch's PrivateUse1 contract for the unsupported-dtype warning and the default dtype."""
from __future__ import annotations

import pytest
import torch
from torch.testing._internal.autocast_test_lists import AutocastTestLists

DEV = "neuron"
# CUDA-only kernels in the lists (cuDNN's convolutions): neither CPU nor neuron has them.
CUDA_ONLY = {"cudnn_convolution", "cudnn_convolution_transpose"}


def _lists():
    lists = AutocastTestLists(torch.device(DEV))
    cases = []
    for name, module, expected in [("torch_fp16", torch, torch.float16), ("torch_fp32", torch, torch.float32),
                                   ("torch_need_autocast_promote", torch, torch.float32),
                                   ("nn_fp16", torch._C._nn, torch.float16), ("nn_fp32", torch._C._nn, torch.float32),
                                   ("linalg_fp16", torch._C._linalg, torch.float16)]:
        for entry in getattr(lists, name):
            if len(entry) == 3:  # PyTorch's harness skips these entries too (einsum's is malformed)
                continue
            op, args = entry[0], entry[1]
            if op not in CUDA_ONLY:
                cases.append(pytest.param(module, op, args, expected, id=f"{name}-{op}"))
    return cases


@pytest.mark.parametrize("module,op,args,expected", _lists())
def test_cuda_autocast_lists(module, op, args, expected):
    """Each op of CUDA's lists returns the dtype CUDA's autocast gives it (fp16 autocast)."""
    with torch.autocast(DEV, dtype=torch.float16):
        out = getattr(module, op)(*args)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == expected


def test_dot_and_vdot_promote_to_float32():
    a, b = torch.randn(8, device=DEV, dtype=torch.float16), torch.randn(8, device=DEV)
    with torch.autocast(DEV, dtype=torch.float16):
        assert torch.dot(a, b).dtype == torch.float32
        assert torch.vdot(a, b).dtype == torch.float32
        assert torch.dot(a, a).dtype == torch.float16


def test_binary_cross_entropy_is_banned():
    x, y = torch.rand(2, 3, device=DEV), torch.rand(2, 3, device=DEV)
    with torch.autocast(DEV, dtype=torch.float16):
        with pytest.raises(RuntimeError, match="binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(x, y)
        torch.nn.functional.binary_cross_entropy_with_logits(x, y)  # the safe form runs
    torch.nn.functional.binary_cross_entropy(x, y)  # and outside autocast, the op itself


def test_unsupported_dtype_warning_lists_pytorch_order():
    with pytest.warns(UserWarning, match="neuron Autocast only supports dtypes of torch.float16, torch.bfloat16 "
                                         "currently."):
        with torch.autocast(DEV, dtype=torch.float32):
            pass


def test_default_dtype_and_fp32_ops():
    assert torch.get_autocast_dtype(DEV) == torch.half
    with torch.autocast(DEV, dtype=torch.bfloat16):
        assert torch.asin(torch.rand(2, device=DEV, dtype=torch.bfloat16)).dtype == torch.float32
        assert torch.mm(torch.rand(2, 3, device=DEV), torch.rand(3, 2, device=DEV)).dtype == torch.bfloat16
