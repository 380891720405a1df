"""The compiler's stages on small ATen graphs, without code generation: FX passes, partition,
fusion into kernels, and the modeled cost of a plan."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torchneuron.compiler import passes
from torchneuron.compiler.cost import eager_cost, kernel_cost, plan_costs
from torchneuron.compiler.graph_fusion import build_kernels, fuse
from torchneuron.compiler.partition import CPU, DEVICE, HOST, partition
from torchneuron.compiler.plan import GraphPlan, TensorSpec
from torchneuron.hardware.model import launch_cost
from torchneuron.ops import policy

aten = torch.ops.aten


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def run_both(fn, gm, *args):
    expected = fn(*args)
    got = gm(*args)
    torch.testing.assert_close(got, expected)


# ---- FX passes ------------------------------------------------------------------------------------

def test_dead_code_is_removed_but_random_ops_stay():
    def fn(x):
        unused = x.sin() * 3  # noqa: F841
        torch.rand_like(x)     # consumes random numbers as in eager: must stay
        return x + 1

    gm = trace(fn, torch.randn(4))
    removed = passes.eliminate_dead_code(gm)
    assert removed == 2
    assert aten.sin.default not in targets(gm) and aten.rand_like.default in targets(gm)


def test_uniform_constants_fold_into_one_full():
    def fn(x):
        a = torch.full((4,), 2.0)
        b = torch.full((4,), 3.0)
        return x * (a * b + 1)

    gm = trace(fn, torch.randn(4))
    assert passes.fold_constants(gm) >= 2
    fulls = [n for n in gm.graph.nodes if n.target is aten.full.default]
    assert len(fulls) == 1 and fulls[0].args[1] == 7.0
    gm.recompile()
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), x * 7.0)


def test_identities_disappear_but_not_on_outputs():
    def fn(x):
        y = x.exp() * 1
        return (y + 0).sin(), x * 1

    gm = trace(fn, torch.randn(4))
    passes.fold_constants(gm)
    muls = [n for n in gm.graph.nodes if n.target in (aten.mul.Tensor, aten.add.Tensor)]
    assert len(muls) == 1  # only `x * 1`, which is an output (it must not alias the input)
    gm.recompile()
    x = torch.randn(4)
    out, same = gm(x)
    torch.testing.assert_close(out, x.exp().sin())
    assert same.data_ptr() != x.data_ptr()


def test_layout_chains_collapse():
    def fn(x):
        y = x.exp().permute(1, 0, 2).permute(2, 1, 0)
        z = x.exp().view(6, 4).view(24)
        return y + 1, z + 1

    gm = trace(fn, torch.randn(2, 3, 4))
    assert passes.normalize_layout(gm) >= 2
    permutes = [n for n in gm.graph.nodes if n.target is aten.permute.default]
    assert len(permutes) == 1 and list(permutes[0].args[1]) == [2, 0, 1]
    gm.recompile()
    x = torch.randn(2, 3, 4)
    run_both(fn, gm, x)


def test_dtype_round_trips_and_no_op_casts_disappear():
    def fn(x):
        y = x.exp()
        back = y.to(torch.float32).to(torch.bfloat16)          # bf16 -> fp32 -> bf16 is exact
        lossy = y.to(torch.float16).to(torch.bfloat16)          # fp16 loses range: must stay
        return back * 2, lossy * 2

    gm = make_fx(fn, tracing_mode="fake", decomposition_table=torch._decomp.core_aten_decompositions())(
        torch.randn(8, dtype=torch.bfloat16))
    casts = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
    before = sum(n.target in casts for n in gm.graph.nodes)
    assert passes.normalize_dtype(gm) >= 1
    after = sum(n.target in casts for n in gm.graph.nodes)
    assert 2 <= after < before  # the lossy pair stays
    gm.recompile()
    x = torch.randn(8, dtype=torch.bfloat16)
    run_both(fn, gm, x)


# ---- partition ------------------------------------------------------------------------------------

def test_partition_places_host_only_ops_and_float64_on_the_host():
    def fn(x, counter):
        a = torch.linalg.svdvals(x)               # no NeuronCore implementation
        b = x.double().sum()                       # float64: no hardware type
        return a.sum() + b.float() + x.relu().sum(), counter + 1

    x = torch.randn(4, 4, device="neuron")
    gm = trace(fn, x, torch.zeros(()))
    with pytest.warns(policy.CPUFallbackWarning, match="linalg_svd"):
        result = partition(gm)
    placements = {n.target: result.of(n) for n in gm.graph.nodes if result.of(n)}
    assert placements[aten.relu.default] == DEVICE
    assert HOST in {result.of(n) for n in gm.graph.nodes if "svd" in str(n.target)}
    assert any(result.of(n) == HOST and "float64" in reason for n in gm.graph.nodes
               for reason in [result.host_reasons.get(n.name, "")])
    assert placements[aten.add.Tensor] in (DEVICE, CPU)
    assert result.to_dict()["counts"][CPU] >= 1  # the CPU counter


def test_strict_mode_refuses_host_ops_in_graphs():
    from torchneuron.compiler.errors import NeuronCompileError

    gm = trace(lambda x: torch.linalg.svdvals(x), torch.randn(3, 3, device="neuron"))
    policy.set_strict(True)
    try:
        with pytest.raises(NeuronCompileError, match="linalg_svd.*strict"):
            partition(gm)
    finally:
        policy.set_strict(False)


# ---- fusion and cost ----------------------------------------------------------------------------

def plan_of(fn, *args) -> GraphPlan:
    gm = trace(fn, *args)
    placements = partition(gm)
    return GraphPlan("test", 0, build_kernels(fuse(gm, placements), placements))


def test_matmul_epilogue_and_the_softmax_of_its_result_fuse_into_one_kernel():
    def fn(x, w, b):
        h = torch.relu(x @ w + b)                  # matmul + bias + activation
        return torch.softmax(h, dim=-1) * 2        # max, sub, exp, sum, div + scale

    x, w, b = (torch.randn(64, 128, device="neuron"), torch.randn(128, 256, device="neuron"),
               torch.randn(256, device="neuron"))
    plan = plan_of(fn, x, w, b)
    assert [k.kind for k in plan.kernels] == ["matmul"]
    (kernel,) = plan.kernels
    assert {o.op.split("::")[1].split(".")[0] for o in kernel.ops} >= {"mm", "add", "relu", "_softmax", "mul"}
    # HBM traffic of a fused kernel is its boundary only: x, w, b in; the result out
    assert len(kernel.reads) == 3 and len(kernel.writes) == 1


def test_independent_pointwise_kernels_meeting_in_one_op_merge_and_keep_dependencies_in_order():
    """Chains over different inputs (an optimizer's updates of each state) meet in one op: their
    kernels merge into one. A kernel reading one of them (the sort) runs after the merged one."""
    def fn(a, b):
        x = a * 0.9 + 0.1
        y = (b * b).sqrt()
        z = torch.sort(y)[0]
        return x / (y + 1e-8), z

    plan = plan_of(fn, torch.randn(64, device="neuron"), torch.randn(64, device="neuron"))
    ops = [[o.op.split("::")[1].split(".")[0] for o in k.ops] for k in plan.kernels]
    assert ops == [["mul", "add", "mul", "sqrt", "add", "div"], ["sort"]]


def _softmax_by_hand(x):
    e = (x - x.amax(-1, keepdim=True)).exp()   # max, then subtract it from the row
    return e / e.sum(-1, keepdim=True)          # sum, then divide the row by it


@pytest.mark.parametrize("width, kernels", [(1024, 1), (32768, 3)])
def test_statistics_are_applied_on_chip_only_to_rows_that_fit_sbuf(width, kernels):
    """A row of 1024 floats stays in SBUF: max, subtract, exp, sum, divide are one kernel. A row of
    32768 floats (128 KiB, over half a trn2 partition's SBUF) streams: each statistic is reduced
    as the row passes, and applied by the next kernel, which reads the row again from HBM."""
    x = torch.randn(8, width, device="neuron")
    plan = plan_of(_softmax_by_hand, x)
    assert len(plan.kernels) == kernels
    row_reads = sum(1 for k in plan.kernels for t in k.reads if t.shape == (8, width))
    assert row_reads == kernels   # the input (and, streaming, the exponentials) once per pass


def test_a_wide_reduction_still_fuses_what_does_not_reread_its_row():
    """exp streams into the sum over a wide row, and the scale of the sums needs no row: one kernel."""
    plan = plan_of(lambda x: x.exp().sum(-1) * 2, torch.randn(8, 32768, device="neuron"))
    assert [k.kind for k in plan.kernels] == ["reduction"]


def test_a_kept_whole_softmax_over_a_wide_row_is_a_kernel_of_its_own():
    fn = lambda x: torch.softmax(x * 3, dim=-1) * 2  # noqa: E731
    narrow = plan_of(fn, torch.randn(8, 1024, device="neuron"))
    wide = plan_of(fn, torch.randn(8, 32768, device="neuron"))
    assert len(narrow.kernels) == 1
    assert [[o.op for o in k.ops] for k in wide.kernels] == [["aten::mul.Tensor"], ["aten::_softmax"],
                                                             ["aten::mul.Tensor"]]


def test_a_norm_fuses_into_the_matmul_it_feeds_but_chained_matmuls_do_not():
    def fn(x, w1, w2):
        h = torch.nn.functional.layer_norm(x, (64,)) @ w1   # norm prologue + projection
        return torch.relu(h) @ w2                           # a matmul of a matmul's result

    x, w1, w2 = (torch.randn(32, 64, device="neuron"), torch.randn(64, 128, device="neuron"),
                 torch.randn(128, 64, device="neuron"))
    plan = plan_of(fn, x, w1, w2)
    first, second = plan.kernels
    assert {"aten::native_layer_norm", "aten::mm", "aten::relu"} <= {o.op for o in first.ops}
    assert [o.op for o in second.ops] == ["aten::mm"]


def test_a_linear_backward_is_one_kernel_loading_the_output_gradient_once():
    x = torch.randn(32, 64, device="neuron", requires_grad=True)
    w = torch.randn(128, 64, device="neuron", requires_grad=True)
    b = torch.randn(128, device="neuron", requires_grad=True)
    grad = torch.randn(32, 128, device="neuron")

    def backward(x, w, b, grad):
        return torch.autograd.grad(torch.nn.functional.linear(x, w, b), (x, w, b), grad)

    plan = plan_of(backward, x, w, b, grad)
    matmuls = [k for k in plan.kernels if any(o.op == "aten::mm" for o in k.ops)]
    assert len(matmuls) == 1, [[o.op for o in k.ops] for k in plan.kernels]
    ops = [o.op for o in matmuls[0].ops]
    assert ops.count("aten::mm") == 2 and "aten::sum.dim_IntList" in ops  # dX, dW and db
    assert TensorSpec("float32", (32, 128)) in matmuls[0].reads


def test_tensors_of_symbolic_scalars_are_generated_in_the_kernel_reading_them():
    """A 0-d tensor of a symbolic scalar (adaptive eager's float arguments, a size) is no kernel and
    no HBM read: a multi-tensor update scaled by one per tensor is one kernel."""
    def fn(x, y):
        scale = x.shape[0] * 0.5
        scalars = [torch.full((), scale, dtype=t.dtype, device=t.device) for t in (x, y)]
        return torch._foreach_mul([x, y], scalars)

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(8, 4, device="neuron"), torch.randn(16, device="neuron"))
    placements = partition(gm)
    plan = GraphPlan("test", 0, build_kernels(fuse(gm, placements), placements))
    assert [[o.op for o in k.ops] for k in plan.kernels] == [["aten::_foreach_mul.List"]]
    assert len(plan.kernels[0].reads) == 2


def test_fused_plan_is_cheaper_than_eager_and_pays_one_launch_per_kernel():
    def fn(x):
        return ((x.sin() * 2 + 1).exp() - x).relu()

    x = torch.randn(1024, 1024, device="neuron")
    plan = plan_of(fn, x)
    assert len(plan.kernels) == 1 and len(plan.kernels[0].ops) == 6
    fused = sum(c.duration_s for c in plan_costs(plan.kernels))
    eager = eager_cost(plan.kernels)
    assert fused < eager / 2
    assert fused > launch_cost()
    single = kernel_cost(plan.kernels[0])
    assert single.bytes == pytest.approx(2 * x.numel() * 4)  # one read of x, one write


def test_plan_survives_json_round_trip():
    plan = plan_of(lambda x: (x @ x).sum(0), torch.randn(8, 8, device="neuron"))
    again = GraphPlan.from_json(plan.to_json())
    assert again == plan
