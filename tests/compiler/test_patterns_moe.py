"""transformers' MoE grouped matmul under torch.compile(backend="neuron"): its fallback op
(`transformers::grouped_mm_fallback`, whose backward reads offs on the host) becomes
`torchneuron::grouped_mm`, which AOTAutograd traces, forward and backward equal to the CPU."""
import pytest
import torch

from torchneuron.compiler import patterns, patterns_moe
from torchneuron.hardware import estimate

moe = pytest.importorskip("transformers.integrations.moe")

OFFS = [3, 3, 9, 16]  # ends of 4 groups; group 1 is empty, rows 16 and 17 in none


def _experts(x, w_up, w_down, offs):
    """Two grouped projections as transformers' experts make them, then a loss."""
    hidden = torch.nn.functional.silu(moe._grouped_mm(x, w_up, offs))
    return (moe._grouped_mm(hidden, w_down, offs) ** 2).sum()


def _operands(dtype):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(18, 8, generator=gen).to(dtype), torch.randn(4, 8, 6, generator=gen).to(dtype),
            torch.randn(4, 6, 8, generator=gen).to(dtype), torch.tensor(OFFS, dtype=torch.int32))


# float32: another kernel's summation order (a few ulps); float16: values rounded to 11 bits at
# each of the layers' steps, a few ulps apart (bfloat16 experts use torch's own grouped_mm)
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_compiled_experts_train_as_on_cpu(fresh_dynamo, monkeypatch, dtype):
    counts = []
    original = patterns.substitute
    monkeypatch.setattr(patterns, "substitute", lambda gm: counts.append(original(gm)) or counts[-1])
    x, w_up, w_down, offs = _operands(dtype)
    cpu = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
    # the CPU reference: transformers' own fallback op (its eager backward may read offs)
    want = (torch.ops.transformers.grouped_mm_fallback(
        torch.nn.functional.silu(torch.ops.transformers.grouped_mm_fallback(cpu[0], cpu[1], offs)), cpu[2], offs) ** 2).sum()
    want.backward()
    dev = [t.to("neuron").requires_grad_() for t in (x, w_up, w_down)]
    with estimate("trn2") as modeled:
        got = torch.compile(_experts, backend="neuron", fullgraph=True)(*dev, offs.to("neuron"))
        got.backward()
    assert [c["grouped_mm"] for c in counts] == [2], counts
    # each grouped matmul is charged once, as a kernel of its graph's plan (not also as an eager op):
    # two in the forward graph, each one's two gradients in the backward graph
    kernels = {row.name: row.count for row in modeled.per_op if "grouped_mm" in row.name}
    assert all(name.startswith("nki_grouped_mm") for name in kernels) and sum(kernels.values()) == 6, kernels
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    for mine, reference in zip(dev, cpu):
        scale = reference.grad.float().abs().max()
        torch.testing.assert_close(mine.grad.cpu().float() / scale, reference.grad.float() / scale, **tol)
    assert not dev[0].grad.cpu()[16:].any(), "rows no expert takes get no gradient"


@pytest.mark.parametrize("layout", ["2d_3d", "2d_2d", "3d_2d"])
def test_grouped_mm_op_gradients_in_each_layout(layout):
    """The op's backward (the same op in another layout) against autograd through per-group matmuls."""
    gen = torch.Generator().manual_seed(1)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    a, b = {"2d_3d": ((18, 8), (4, 8, 6)), "2d_2d": ((5, 16), (16, 6)), "3d_2d": ((4, 5, 8), (8, 16))}[layout]
    a, b = torch.randn(*a, generator=gen, dtype=torch.float64), torch.randn(*b, generator=gen, dtype=torch.float64)
    bounds = list(zip([0] + OFFS[:-1], OFFS))

    def reference(a, b):
        if layout == "2d_3d":
            return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(bounds)] + [a[16:] @ b[0] * 0])
        if layout == "2d_2d":
            return torch.stack([a[:, s:e] @ b[s:e] for s, e in bounds])
        return torch.cat([a[g] @ b[:, s:e] for g, (s, e) in enumerate(bounds)], dim=1)

    a_ref, b_ref = a.clone().requires_grad_(), b.clone().requires_grad_()
    want = reference(a_ref, b_ref)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want.backward(grad)
    a_dev, b_dev = (t.float().to("neuron").requires_grad_() for t in (a, b))
    got = torch.ops.torchneuron.grouped_mm(a_dev, b_dev, offs.to("neuron"))
    got.backward(grad.float().to("neuron"))
    for mine, reference_value in [(got, want), (a_dev.grad, a_ref.grad), (b_dev.grad, b_ref.grad)]:
        torch.testing.assert_close(mine.detach().cpu().double(), reference_value.detach(), rtol=1e-5, atol=1e-5)


def test_grouped_mm_op_names_the_operands_it_takes():
    offs = torch.tensor([2, 4], dtype=torch.int32, device="neuron")
    x = torch.randn(4, 8, device="neuron")
    with pytest.raises(ValueError, match=r"a \[M, K\] x b \[G, K, N\].*got a \(4, 8\) torch.float32, b \(2, 5, 6\)"):
        torch.ops.torchneuron.grouped_mm(x, torch.randn(2, 5, 6, device="neuron"), offs)
    with pytest.raises(ValueError, match="offs \\(2,\\) torch.float32"):
        torch.ops.torchneuron.grouped_mm(x, torch.randn(2, 8, 6, device="neuron"), offs.float())


def test_only_neuron_calls_the_grouped_kernel_takes_are_rewritten():
    graph = torch.fx.Graph()
    a, w, offs = (graph.placeholder(name) for name in ("a", "w", "offs"))
    call = graph.call_function(torch.ops.transformers.grouped_mm_fallback, (a, w), {"offs": offs})
    graph.output(call)
    examples = {"a": torch.empty(6, 8), "w": torch.empty(2, 8, 4), "offs": torch.tensor([2, 6], dtype=torch.int32)}
    for node in (a, w, offs):
        node.meta["example_value"] = examples[node.name]
    assert not patterns_moe.is_grouped_mm_fallback(call), "CPU operands keep transformers' op"
    for node in (a, w, offs):
        node.meta["example_value"] = examples[node.name].to("neuron")
    assert patterns_moe.is_grouped_mm_fallback(call)
    w.meta["example_value"] = torch.empty(2, 8, 4, dtype=torch.float64, device="neuron")
    assert not patterns_moe.is_grouped_mm_fallback(call), "float64 keeps transformers' op"
