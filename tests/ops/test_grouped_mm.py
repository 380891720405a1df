"""Mixture-of-experts ops on neuron: integer histc/bincount, `_grouped_mm` (forward and backward)
and `_scaled_grouped_mm` in PyTorch's four offsets layouts, charged as one Tensor-engine kernel."""
import pytest
import torch

import torchneuron
from torchneuron.hardware import estimate

E4M3 = torch.float8_e4m3fn
OFFS = [3, 3, 9, 16]  # ends of 4 groups; group 1 is empty


def on(x):
    return x.to("neuron")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
def test_integer_histc_counts_tokens_per_expert_as_cuda(dtype):
    ids = torch.randint(0, 8, (64,), dtype=dtype)
    counts = torch.histc(on(ids), bins=8, min=0, max=7)
    assert counts.dtype == dtype and counts.device.type == "neuron"
    assert torch.equal(counts.cpu().long(), torch.bincount(ids.long(), minlength=8))


def test_integer_histc_edges_range_and_out_of_range_values():
    x = torch.tensor([-5, 0, 1, 2, 3, 4, 5, 9, 10, 11], dtype=torch.int32)
    # CUDA: bin = (x - min) * bins // (max - min), the top edge in the last bin, outside ignored
    assert torch.histc(on(x), bins=4, min=0, max=10).cpu().tolist() == [3, 2, 1, 2]
    assert torch.histc(on(x), bins=2).cpu().tolist() == [4, 6]  # min == max: the data's range
    same = torch.full((5,), 7, dtype=torch.int64)
    assert torch.histc(on(same), bins=3).cpu().tolist() == [0, 5, 0]  # one value: widened by one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_floating_histc_matches_cpu(dtype):
    x = (torch.randn(500) * 3).to(dtype)
    for args in [(10, -2.0, 2.0), (7, 0, 0), (16, -9.5, 9.5)]:
        torch.testing.assert_close(torch.histc(on(x), *args).cpu(), torch.histc(x, *args), rtol=0, atol=0)


def test_bincount_and_histc_are_device_ops_in_strict_mode():
    ids = torch.randint(0, 6, (40,))
    w = torch.rand(40)
    torchneuron.set_strict(True)
    try:
        counts = torch.bincount(on(ids), minlength=8)
        weighted = torch.bincount(on(ids), on(w))
        hist = torch.histc(on(ids.int()), bins=6, min=0, max=5)
    finally:
        torchneuron.set_strict(False)
    assert torch.equal(counts.cpu(), torch.bincount(ids, minlength=8))
    torch.testing.assert_close(weighted.cpu(), torch.bincount(ids, w))
    assert torch.equal(hist.cpu().long(), torch.bincount(ids, minlength=6))


def layouts(dtype=torch.bfloat16, g=4, m=16, k=16, n=24):
    """(name, a, b, offs) for PyTorch's grouped layouts; offs ends each group."""
    offs = torch.tensor(OFFS, dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    return [
        ("2d_3d", r(m, k), r(g, n, k).transpose(-2, -1), offs),           # MoE forward: x @ w[g]^T
        ("3d_3d", r(g, 5, k), r(g, n, k).transpose(-2, -1), None),
        ("3d_2d", r(g, 8, k), r(m, k).t(), offs),                         # columns split by offs
        ("2d_2d", r(8, m), r(m, n), offs),                                # K split: weight gradients
    ]


def reference(a, b, offs):
    """float32 per-group products of the same values."""
    a, b = a.float(), b.float()
    if offs is None:
        return a @ b
    bounds = list(zip([0] + OFFS[:-1], OFFS))
    if a.dim() == 2 and b.dim() == 3:
        return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(bounds)])
    if a.dim() == 3:
        return torch.cat([a[i] @ b[:, s:e] for i, (s, e) in enumerate(bounds)], dim=1)
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in bounds])


@pytest.mark.parametrize("case", range(4), ids=[c[0] for c in layouts()])
def test_grouped_mm_forward_and_backward_match_cpu(case):
    _, a, b, offs = layouts()[case]
    a_cpu, b_cpu = a.detach().requires_grad_(), b.detach().requires_grad_()
    a_dev = on(a.detach()).requires_grad_()
    b_dev = on(b.detach()).requires_grad_()
    expected = torch._grouped_mm(a_cpu, b_cpu, offs)
    actual = torch._grouped_mm(a_dev, b_dev, None if offs is None else on(offs))
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(actual.cpu().float(), reference(a, b, offs), rtol=2e-2, atol=2e-2)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected.backward(grad)
    actual.backward(on(grad))
    torch.testing.assert_close(a_dev.grad.cpu(), a_cpu.grad, rtol=0, atol=0)
    torch.testing.assert_close(b_dev.grad.cpu(), b_cpu.grad, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_grouped_mm_of_any_stride_zeroes_rows_past_the_last_group(dtype):
    """Rows 7 floats wide (the CPU's kernel wants rows 16 bytes apart) and 2 rows no group covers
    (PyTorch leaves them unspecified; zero on neuron), in the MoE forward and the K-split layout."""
    gen = torch.Generator().manual_seed(3)
    a, w = torch.randn(18, 7, generator=gen).to(dtype), torch.randn(4, 7, 5, generator=gen).to(dtype)
    out = torch._grouped_mm(on(a), on(w), on(torch.tensor(OFFS, dtype=torch.int32))).cpu()
    bounds = list(zip([0] + OFFS[:-1], OFFS))
    want = torch.cat([a[s:e].float() @ w[i].float() for i, (s, e) in enumerate(bounds)] + [torch.zeros(2, 5)])
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]  # one rounding of the fp32 sum
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    grad_w = torch._grouped_mm(on(a[:16].t()), on(torch.ones(16, 5, dtype=dtype)),
                               on(torch.tensor(OFFS, dtype=torch.int32))).cpu()
    want_w = torch.stack([a[s:e].float().t() @ torch.ones(e - s, 5) for s, e in bounds])
    torch.testing.assert_close(grad_w.float(), want_w, rtol=tol, atol=tol)


def _scales(a, b, offs):
    """Positive row-wise scales in `_scaled_grouped_mm`'s shapes for each layout."""
    gen = torch.Generator().manual_seed(2)
    r = lambda *shape: torch.rand(*shape, generator=gen) + 0.5  # noqa: E731
    groups = len(OFFS)
    if a.dim() == 2 and b.dim() == 3:
        return r(a.shape[0]), r(b.shape[0], b.shape[2])
    if a.dim() == 3 and b.dim() == 3:
        return r(a.shape[0], a.shape[1]), r(b.shape[0], b.shape[2])
    if a.dim() == 3:
        return r(a.shape[0], a.shape[1]), r(b.shape[1])
    return r(groups * a.shape[0]), r(groups * b.shape[1])


def _scaled_reference(a8, b8, sa, sb, offs):
    out = reference(a8, b8, offs)
    bounds = list(zip([0] + OFFS[:-1], OFFS))
    if a8.dim() == 3 and b8.dim() == 3:
        return out * sa[:, :, None] * sb[:, None, :]
    if a8.dim() == 2 and b8.dim() == 2:
        g, m, n = out.shape
        return out * sa.view(g, m, 1) * sb.view(g, 1, n)
    for i, (s, e) in enumerate(bounds):
        if a8.dim() == 2:
            out[s:e] *= sa[s:e, None] * sb[i]
        else:
            out[:, s:e] *= sa[i][:, None] * sb[s:e]
    return out


@pytest.mark.parametrize("case", range(4), ids=[c[0] for c in layouts()])
def test_scaled_grouped_mm_against_float32_reference(case):
    _, a, b, offs = layouts(torch.float32)[case]
    a8 = a.to(E4M3)
    b8 = b.transpose(-2, -1).contiguous().to(E4M3).transpose(-2, -1)  # column-major, as required
    sa, sb = _scales(a8, b8, offs)
    out = torch._scaled_grouped_mm(on(a8), on(b8), on(sa), on(sb), offs=None if offs is None else on(offs),
                                   out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    expected = _scaled_reference(a8, b8, sa, sb, offs).bfloat16()
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


def test_scaled_grouped_mm_bad_input_raises_pytorchs_error():
    _, a, b, offs = layouts(torch.float32)[0]
    a8, b8 = a.to(E4M3), b.transpose(-2, -1).contiguous().to(E4M3).transpose(-2, -1)
    sa, sb = _scales(a8, b8, offs)
    with pytest.raises(RuntimeError, match="Expected mat_b tensor to be column major"):
        torch._scaled_grouped_mm(on(a8), on(b8.contiguous()), on(sa), on(sb), offs=on(offs))
    with pytest.raises(RuntimeError, match="Expected scale_a to have 16 elements"):
        torch._scaled_grouped_mm(on(a8), on(b8), on(sa[:5]), on(sb), offs=on(offs))
    with pytest.raises(RuntimeError, match="Offsets tensor must be integer"):
        torch._scaled_grouped_mm(on(a8), on(b8), on(sa), on(sb), offs=on(offs.long()))


def test_grouped_mm_is_one_tensor_engine_kernel_cheaper_than_a_loop():
    g, m, k, n = 8, 1024, 512, 512
    x = on(torch.randn(m, k, dtype=torch.bfloat16))
    w = on(torch.randn(g, k, n, dtype=torch.bfloat16))
    offs = on(torch.arange(1, g + 1, dtype=torch.int32) * (m // g))
    with estimate("trn2") as grouped:
        torch._grouped_mm(x, w, offs)
    with estimate("trn2") as loop:
        for i in range(g):
            x[i * m // g:(i + 1) * m // g] @ w[i]
    (row,) = [r for r in grouped.per_op if "grouped_mm" in r.name]
    assert row.count == 1 and row.engine == "tensor" and row.flops == 2 * m * k * n
    assert loop.flops == grouped.flops
    assert grouped.device_time_s < loop.device_time_s


E8M0 = torch.float8_e8m0fnu
MX_K_OFFS = [32, 32, 96, 128]  # groups along K (2d x 2d) are multiples of MX's 32-element blocks


def _swizzled(grid):
    """[rows, cols] e8m0 scales -> cuBLAS's 32_4_4 blocked layout, flat (128x4 tiles padded)."""
    rows, cols = grid.shape
    r, c = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.full((r, c), 1.0).to(E8M0)
    padded[:rows, :cols] = grid
    return padded.view(r // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)


def _mx_case(name, g=4, m=16, k=64, n=24, offs=OFFS):
    """(a8, b8, offs, a pieces, b pieces) of MXFP8's two layouts (a 3d mat_a's MX scales are
    refused by PyTorch's own check): each piece (index into the [..., rows, K] view, e8m0 grid)."""
    gen = torch.Generator().manual_seed(11)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(E4M3)  # noqa: E731
    grid = lambda rows, cols: (2.0 ** torch.randint(-4, 4, (rows, -(-cols // 32)), generator=gen)).to(E8M0)  # noqa: E731
    rows_of = lambda ends: list(zip([0] + ends[:-1], ends))  # noqa: E731
    if name == "2d_3d":
        a, b = r(m, k), r(g, n, k).transpose(-2, -1)
        pa = [((slice(s, e), slice(None)), grid(e - s, k)) for s, e in rows_of(offs)]
        pb = [((i,), grid(n, k)) for i in range(g)]
    else:
        a, b, offs = r(8, 128), r(n, 128).t(), MX_K_OFFS
        pa = [((slice(None), slice(s, e)), grid(8, e - s)) for s, e in rows_of(MX_K_OFFS)]
        pb = [((slice(None), slice(s, e)), grid(n, e - s)) for s, e in rows_of(MX_K_OFFS)]
    return a, b, offs, pa, pb


def _mx_scales(x, pieces):
    """The scale tensor CUDA's MXFP8 grouped GEMM reads: [G, blocked] for a 3d operand, the
    groups' blocks concatenated (2d) for a 2d one."""
    blocks = [_swizzled(grid) for _, grid in pieces]
    if x.dim() == 3:
        return torch.stack(blocks)
    flat = torch.cat([b for b, (_, grid) in zip(blocks, pieces) if grid.numel()])
    cols = -(-pieces[0][1].shape[1] // 4) * 4 if x.dim() == 2 and pieces[0][0][1] == slice(None) else 4
    return flat.reshape(-1, cols)


def _mx_reference(a, b, offs, pa, pb):
    """Per-group float32 products of the dequantized operands."""
    def dequantized(view, pieces):
        out = view.float().clone()
        for index, grid in pieces:
            part = out[index]
            out[index] = part * grid.float().repeat_interleave(32, 1)[:, :part.shape[1]]
        return out
    a32 = dequantized(a, pa)
    b32 = dequantized(b.transpose(-2, -1), pb).transpose(-2, -1)
    if offs is None:
        return a32 @ b32
    bounds = list(zip([0] + offs[:-1], offs))
    if a.dim() == 2 and b.dim() == 3:
        return torch.cat([a32[s:e] @ b32[i] for i, (s, e) in enumerate(bounds)])
    if a.dim() == 3:
        return torch.cat([a32[i] @ b32[:, s:e] for i, (s, e) in enumerate(bounds)], dim=1)
    return torch.stack([a32[:, s:e] @ b32[s:e] for s, e in bounds])


@pytest.mark.parametrize("api", ["v1", "v2"])
@pytest.mark.parametrize("case", ["2d_3d", "2d_2d"])  # MoE forward / grad input, and weight gradients
def test_mxfp8_scaled_grouped_mm_with_e8m0_block_scales(case, api):
    a, b, offs, pa, pb = _mx_case(case)
    sa, sb = _mx_scales(a, pa), _mx_scales(b, pb)
    offs_dev = None if offs is None else on(torch.tensor(offs, dtype=torch.int32))
    if api == "v1":
        out = torch._scaled_grouped_mm(on(a), on(b), on(sa), on(sb), offs=offs_dev, out_dtype=torch.bfloat16)
    else:
        out = torch.nn.functional.scaled_grouped_mm(
            on(a), on(b), on(sa), torch.nn.functional.ScalingType.BlockWise1x32, on(sb),
            torch.nn.functional.ScalingType.BlockWise1x32, swizzle_a=torch.nn.functional.SwizzleType.SWIZZLE_32_4_4,
            swizzle_b=torch.nn.functional.SwizzleType.SWIZZLE_32_4_4, offs=offs_dev)
    torch.testing.assert_close(out.cpu(), _mx_reference(a, b, offs, pa, pb).bfloat16(), rtol=0, atol=0)


def test_mxfp8_grouped_scales_of_the_wrong_size_name_the_layout():
    a, b, offs, pa, pb = _mx_case("2d_3d")
    sa, sb = _mx_scales(a, pa), _mx_scales(b, pb)
    with pytest.raises(RuntimeError, match="32_4_4-swizzled blocks"):
        torch._scaled_grouped_mm(on(a), on(b), on(sa[:-4]), on(sb), offs=on(torch.tensor(offs, dtype=torch.int32)))
    with pytest.raises(NotImplementedError, match="SWIZZLE_32_4_4"):
        torch.nn.functional.scaled_grouped_mm(
            on(a), on(b), on(sa), torch.nn.functional.ScalingType.BlockWise1x32, on(sb),
            torch.nn.functional.ScalingType.BlockWise1x32, offs=on(torch.tensor(offs, dtype=torch.int32)))


def test_mxfp8_grouped_mm_on_trn3_scales_in_the_array():
    a, b, offs, pa, pb = _mx_case("2d_3d", m=512, k=512, n=512, offs=[o * 32 for o in OFFS])
    sa, sb = on(_mx_scales(a, pa)), on(_mx_scales(b, pb))
    args = (on(a), on(b))
    offs_dev = on(torch.tensor(offs, dtype=torch.int32))
    row = on(torch.ones(a.shape[0])), on(torch.ones(4, 512))
    times = {}
    for target in ("trn2", "trn3"):
        with estimate(target) as mx:
            torch._scaled_grouped_mm(*args, sa, sb, offs=offs_dev)
        with estimate(target) as rowwise:
            torch._scaled_grouped_mm(*args, *row, offs=offs_dev)
        times[target] = mx.device_time_s / rowwise.device_time_s
    assert times["trn3"] == pytest.approx(1.0, rel=0.02), times  # MX scaling is free in trn3's array (scale bytes aside)
    assert times["trn2"] > 1.2, times            # trn2 applies each 32-block's scale in the evacuation
