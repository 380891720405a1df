"""A fused kernel's elementwise work is issued as NKI instructions and spread over the Vector,
Scalar and GpSimd engines (compiler/engine_balance.py), as the cost model prices it."""
import math

import pytest

from torchneuron.compiler.cost import compute_only, kernel_cost
from torchneuron.compiler.engine_balance import engine_loads, passes_of
from torchneuron.compiler.plan import KernelSpec, OpSpec, TensorSpec
from torchneuron.hardware.model import op_cost
from torchneuron.hardware.targets import TRN2

ROWS, COLS = 1024, 1024          # 8192 elements a partition lane: four 2048-element tiles
SCALAR = TensorSpec("float32", ())
ALU = ("vector", "scalar", "gpsimd")


def t(dtype: str) -> TensorSpec:
    return TensorSpec(dtype, (ROWS, COLS))


def op(name: str, ins, outs) -> OpSpec:
    return OpSpec(name, tuple(ins), tuple(outs))


def kernel(*ops: OpSpec) -> KernelSpec:
    return KernelSpec("k", "fused", list(ops), reads=[], writes=[])


def loads(k: KernelSpec) -> dict[str, float]:
    fast = compute_only(TRN2)
    priced = [(o.op, [(s.torch_dtype(), s.shape) for s in o.inputs], [(s.torch_dtype(), s.shape) for s in o.outputs],
               op_cost(o.op, [(s.torch_dtype(), s.shape) for s in o.inputs],
                       [(s.torch_dtype(), s.shape) for s in o.outputs], fast)) for o in k.ops]
    return engine_loads(*passes_of(priced, TRN2), TRN2)


def pass_cycles() -> float:
    lanes = ROWS * COLS // TRN2.partitions
    return lanes + math.ceil(lanes / 2048) * TRN2.instruction_fixed_cycles


def all_alu_hz() -> float:
    return sum(TRN2.clock_hz(e) for e in ALU)


def test_fp8_cast_chain_is_three_instructions_spread_over_three_engines():
    """torchao's tensor-wise cast: amax = abs(x).max() (one pass, the reduction rides on it);
    x.float() * scale, clamp_min, clamp_max, .to(fp8): the casts ride on their neighbours and the
    three ALU ops fill two tensor_scalar instructions. Seven eager passes, three fused."""
    chain = kernel(
        op("aten::abs", [t("bfloat16")], [t("bfloat16")]),
        op("aten::max", [t("bfloat16")], [TensorSpec("bfloat16", ())]),
        op("prims::convert_element_type", [t("bfloat16")], [t("float32")]),
        op("aten::mul.Tensor", [t("float32"), SCALAR], [t("float32")]),
        op("aten::clamp_min", [t("float32")], [t("float32")]),
        op("aten::clamp_max", [t("float32")], [t("float32")]),
        op("prims::convert_element_type", [t("float32")], [t("float8_e4m3fn")]))
    busy = loads(chain)
    assert set(busy) == {"vector", "scalar", "gpsimd"}
    level = max(busy.values())
    assert all(b == pytest.approx(level, rel=1e-2) for b in busy.values())  # they finish together
    assert level == pytest.approx(3 * pass_cycles() / all_alu_hz(), rel=1e-2)
    one_vector_pass = pass_cycles() / TRN2.clock_hz("vector")
    assert kernel_cost(chain, target=compute_only(TRN2)).duration_s < 7 * one_vector_pass / 4


def test_a_cast_with_no_engine_neighbour_is_a_pass_of_its_own():
    """bf16 -> fp8 read from HBM and consumed only by the Tensor engine needs an instruction."""
    weight = TensorSpec("float8_e4m3fn", (COLS, COLS))
    alone = kernel(op("prims::convert_element_type", [t("bfloat16")], [t("float8_e4m3fn")]),
                   op("aten::_scaled_mm", [t("float8_e4m3fn"), weight, SCALAR, SCALAR], [t("bfloat16")]))
    busy = loads(alone)
    assert sum(busy[e] * TRN2.clock_hz(e) for e in ALU) == pytest.approx(pass_cycles(), rel=1e-2)


def test_tensor_tensor_ops_run_on_vector_and_gpsimd_only():
    k = kernel(op("aten::add.Tensor", [t("float32"), t("float32")], [t("float32")]),
               op("aten::mul.Tensor", [t("float32"), t("float32")], [t("float32")]))
    busy = loads(k)
    assert busy.get("scalar", 0.0) == 0.0
    assert busy["vector"] == pytest.approx(busy["gpsimd"])
    rate = TRN2.clock_hz("vector") + TRN2.clock_hz("gpsimd")
    assert busy["vector"] == pytest.approx(2 * pass_cycles() / rate, rel=1e-6)


def test_transcendentals_stay_on_scalar_and_integer_ops_on_vector():
    k = kernel(op("aten::exp", [t("float32")], [t("float32")]),
               op("aten::bitwise_and.Tensor", [t("int32"), t("int32")], [t("int32")]))
    busy = loads(k)
    assert busy["scalar"] == pytest.approx(pass_cycles() / TRN2.clock_hz("scalar"), rel=1e-6)
    assert busy["vector"] == pytest.approx(pass_cycles() / TRN2.clock_hz("vector"), rel=1e-6)
    assert busy.get("gpsimd", 0.0) == 0.0


def test_movable_passes_fill_the_engines_a_matmul_leaves_idle():
    """A scalar-operand pass next to fixed Scalar work (an exp) goes to Vector and GpSimd first."""
    k = kernel(op("aten::exp", [t("float32")], [t("float32")]),
               op("aten::mul.Tensor", [t("float32"), SCALAR], [t("float32")]))
    busy = loads(k)
    exp_s = pass_cycles() / TRN2.clock_hz("scalar")
    assert busy["scalar"] == pytest.approx(exp_s)  # the multiply did not queue behind the exp
    assert busy["vector"] == pytest.approx(busy["gpsimd"]) and busy["vector"] < exp_s
