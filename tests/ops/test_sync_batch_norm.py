"""nn.SyncBatchNorm's statistics ops on neuron (ops/sync_batch_norm.py): one replica's chain of
them gives batch norm's forward, running statistics and gradients, as on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEV = "neuron"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_batch_norm_chain_is_batch_norm(dtype):
    torch.manual_seed(0)
    x = (torch.randn(4, 3, 5, 5) * 2 + 1).to(dtype)
    w, b = torch.randn(3).to(dtype), torch.randn(3).to(dtype)
    grad = torch.randn(4, 3, 5, 5).to(dtype)
    rm, rv = torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype)
    xr = x.float().requires_grad_()
    wr, br = w.float().requires_grad_(), b.float().requires_grad_()
    rmr, rvr = rm.float().clone(), rv.float().clone()
    ref = F.batch_norm(xr, rmr, rvr, wr, br, training=True, momentum=0.1, eps=1e-5)
    ref.backward(grad.float())

    xd, wd, bd, gd = (t.to(DEV) for t in (x, w, b, grad))
    rmd, rvd = rm.to(DEV), rv.to(DEV)
    mean, invstd = torch.batch_norm_stats(xd, 1e-5)
    assert mean.dtype == torch.float32
    count = torch.tensor([x.numel() // 3], device=DEV)
    mean, invstd = torch.batch_norm_gather_stats_with_counts(xd, mean[None], invstd[None], rmd, rvd, 0.1, 1e-5,
                                                             count)
    out = torch.batch_norm_elemt(xd, wd, bd, mean, invstd, 1e-5)
    sum_dy, sum_dy_xmu, grad_w, grad_b = torch.batch_norm_backward_reduce(gd, xd, mean, invstd, wd, True, True, True)
    grad_x = torch.batch_norm_backward_elemt(gd, xd, mean, invstd, wd, sum_dy, sum_dy_xmu, count.int())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out.cpu().float(), ref.detach(), **tol)
    torch.testing.assert_close(grad_x.cpu().float(), xr.grad, **tol)
    torch.testing.assert_close(grad_w.cpu().float(), wr.grad, **tol)
    torch.testing.assert_close(grad_b.cpu().float(), br.grad, **tol)
    torch.testing.assert_close(rmd.cpu().float(), rmr, **tol)
    torch.testing.assert_close(rvd.cpu().float(), rvr, **tol)


def test_two_replicas_combine_as_one_batch():
    torch.manual_seed(0)
    x = torch.randn(6, 2, 4)
    parts = [x[:2].to(DEV), x[2:].to(DEV)]
    stats = [torch.batch_norm_stats(p, 1e-5) for p in parts]
    mean, invstd = torch.batch_norm_gather_stats_with_counts(
        parts[0], torch.stack([s[0] for s in stats]), torch.stack([s[1] for s in stats]), None, None, 0.1, 1e-5,
        torch.tensor([8.0, 16.0], device=DEV))
    var, ref_mean = torch.var_mean(x, dim=(0, 2), correction=0)
    torch.testing.assert_close(mean.cpu(), ref_mean)
    torch.testing.assert_close(invstd.cpu(), torch.rsqrt(var + 1e-5))
