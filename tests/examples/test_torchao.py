"""torchao 0.18 on neuron: float8 training of a tiny Llama (equal to the CPU running the same recipe,
close to bf16, no host round trip for the float64 scale math) and quantize_ for inference
(int8 and int4 weight-only, float8 dynamic activation + weight) generating the CPU's tokens."""
import copy

import pytest
import torch

import torchneuron

transformers = pytest.importorskip("transformers")
torchao = pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.quantization import quant_api as q  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402

from tests.models import tiny_llama as _tiny_llama  # noqa: E402

from .training import train_losses  # noqa: E402

VOCAB = 128
PROMPT = torch.tensor([[5, 17, 42, 7]])


def tiny_llama(dtype=torch.float32):
    torch.manual_seed(0)
    return _tiny_llama(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_attention_heads=4).to(dtype)


def _fp8_linears(module, fqn):
    return isinstance(module, torch.nn.Linear) and "lm_head" not in fqn


def train(model, device, recipe=None):
    if recipe is not None:
        config = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model.to(device), config=config, module_filter_fn=_fp8_linears)
    return train_losses(model, device, vocab=VOCAB)


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_float8_training_on_neuron_equals_cpu_and_stays_on_device(recipe):
    model = tiny_llama()
    high_precision = train(copy.deepcopy(model), "cpu")
    cpu = train(copy.deepcopy(model), "cpu", recipe)
    torchneuron.reset_fallback_counts()
    torchneuron.set_strict(True)  # torchao's float64 scale math must not leave the device
    try:
        neuron = train(model, "neuron", recipe)
    finally:
        torchneuron.set_strict(False)
    assert torchneuron.fallback_counts() == {}
    assert neuron == pytest.approx(cpu, rel=1e-5, abs=1e-5)
    assert neuron == pytest.approx(high_precision, rel=2e-2)
    assert isinstance(model.model.layers[0].mlp.up_proj, torchao.float8.float8_linear.Float8Linear)


def generate(model, device):
    return model.to(device).generate(PROMPT.to(device), max_new_tokens=6, do_sample=False).cpu()


@pytest.mark.parametrize("config", [
    q.Int8WeightOnlyConfig(),
    pytest.param(q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=q.PerGroup(32)), marks=pytest.mark.slow),
], ids=["int8_weight_only", "int4_weight_only"])
def test_weight_only_quantized_generate_equals_cpu(config):
    model = tiny_llama(torch.bfloat16).eval()
    on_cpu = copy.deepcopy(model)
    quantize_(on_cpu, config)
    on_neuron = model.to("neuron")
    quantize_(on_neuron, config)
    assert type(on_neuron.model.layers[0].mlp.up_proj.weight) is type(on_cpu.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(generate(on_neuron, "neuron"), generate(on_cpu, "cpu"))


@pytest.mark.parametrize("granularity", [q.PerTensor(), pytest.param(q.PerRow(), marks=pytest.mark.slow)],
                         ids=["per_tensor", "per_row"])
def test_float8_dynamic_quantization_is_accepted_on_neuron(granularity):
    config = q.Float8DynamicActivationFloat8WeightConfig(granularity=granularity)
    model = tiny_llama(torch.bfloat16).eval()
    with pytest.raises(AssertionError, match="requires CUDA compute capability"):  # torchao's own check, on CPU
        quantize_(copy.deepcopy(model), config)
    on_neuron = model.to("neuron")
    quantize_(on_neuron, config)
    weight = on_neuron.model.layers[0].mlp.up_proj.weight
    assert type(weight).__name__ == "Float8Tensor" and weight.qdata.dtype == torch.float8_e4m3fn
    tokens = generate(on_neuron, "neuron")
    assert torch.equal(tokens, generate(copy.deepcopy(on_neuron), "cpu"))  # the same quantized model on CPU


class _CpuInt4Linear(torch.nn.Module):
    """A linear layer quantized as torchao's Int4WeightOnlyConfig(tile_packed_to_4d) quantizes it
    (tinygemm's asymmetric qparams, K padded to 1024, N to 8), run by the CPU's own int4 kernel
    (`_weight_int4pack_mm_for_cpu`): the same quantized model, on the CPU."""

    def __init__(self, linear: torch.nn.Linear, group: int):
        from torchao.quantization.quant_primitives import (MappingType, _choose_qparams_affine_tinygemm,
                                                           _quantize_affine_tinygemm)
        from torchao.quantization.utils import pack_tinygemm_scales_and_zeros
        super().__init__()
        w = linear.weight.detach()
        self.n, self.k, self.group, self.bias = w.shape[0], w.shape[1], group, linear.bias
        padded = torch.nn.functional.pad(w, (0, -self.k % 1024, 0, -self.n % 8))
        block = (1, group)
        scale, zero = _choose_qparams_affine_tinygemm(padded, MappingType.ASYMMETRIC, block, torch.int32, 0, 15,
                                                      scale_dtype=w.dtype, zero_point_dtype=w.dtype)
        values = _quantize_affine_tinygemm(padded, list(block), scale, zero, torch.int32, 0, 15)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 8)
        rows = values.shape[0]
        self.scale_and_zero = pack_tinygemm_scales_and_zeros(scale.reshape(rows, -1), zero.reshape(rows, -1), w.dtype)

    def forward(self, x):
        flat = torch.nn.functional.pad(x.reshape(-1, self.k).bfloat16(), (0, -self.k % 1024))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scale_and_zero)
        y = y[:, :self.n].reshape(*x.shape[:-1], self.n)
        return (y if self.bias is None else y + self.bias).to(x.dtype)


def _int4_on_cpu(model, group):
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, _CpuInt4Linear(child, group))
    return model


def test_int4_weight_only_config_generates_the_cpu_int4_kernels_tokens():
    """Int4WeightOnlyConfig (tinygemm's tile_packed_to_4d format): quantized on neuron, whose
    `_weight_int4pack_mm` runs, generating what the same int4 weights give on the CPU's int4
    kernel; the CPU itself cannot run this config (torchao asks for a CUDA GPU)."""
    config = q.Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d")
    model = tiny_llama(torch.bfloat16).eval()
    on_cpu = _int4_on_cpu(copy.deepcopy(model), 32)
    on_neuron = model.to("neuron")
    quantize_(on_neuron, config)
    weight = on_neuron.model.layers[0].mlp.up_proj.weight
    assert type(weight).__name__ == "Int4TilePackedTo4dTensor" and weight.qdata.device.type == "neuron"
    assert torch.equal(generate(on_neuron, "neuron"), generate(on_cpu, "cpu"))


def test_int4_weight_only_config_formats_without_a_neuron_kernel_name_the_one_that_works():
    model = tiny_llama(torch.bfloat16).eval().to("neuron")
    with pytest.raises(ValueError, match="int4_packing_format='tile_packed_to_4d'"):
        quantize_(model, q.Int4WeightOnlyConfig(group_size=32))  # torchao's default: plain (mslk, CUDA)


def test_compiled_float8_training_stays_on_device_in_strict_mode():
    """torch.compile(backend="neuron") places torchao's float64 scale math (casts to float64,
    clamp, reciprocal, mul) on the device, as eager mode does: strict mode compiles it."""
    model = tiny_llama()
    eager = train(copy.deepcopy(model), "neuron", "tensorwise")
    convert_to_float8_training(model.to("neuron"), config=Float8LinearConfig(), module_filter_fn=_fp8_linears)
    model.forward = torch.compile(model.forward, backend="neuron")
    torchneuron.reset_fallback_counts()
    torchneuron.set_strict(True)
    try:
        compiled = train_losses(model, "neuron", vocab=VOCAB)
    finally:
        torchneuron.set_strict(False)
    assert torchneuron.fallback_counts() == {}
    assert compiled == pytest.approx(eager, rel=1e-3)


def test_mxfp8_training_matmul_runs_the_mx_gemm_on_neuron():
    """torchao's MXFP8 linear autograd function (`mx_mm`) with its torch-native cast kernels: on
    neuron the GEMMs are real MXFP8 `_scaled_mm`s (e8m0 scales, 32_4_4-swizzled), close to
    torchao's emulated recipe on the CPU and charged at trn3's MXFP8 rate. (The config's AUTO
    preference hard-codes Triton and CUDA cast kernels, which no CPU-only build has.)"""
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    from torchneuron.hardware import estimate

    e4m3 = torch.float8_e4m3fn

    def run(device, preference):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 512, generator=g).bfloat16().to(device).requires_grad_()
        w = (torch.randn(1024, 512, generator=g) * 0.05).bfloat16().to(device).requires_grad_()
        y = mx_mm.apply(x, w, e4m3, e4m3, e4m3, 32, preference, MXFP8Dim0CastKernelChoice.TORCH,
                        MXFP8Dim1CastKernelChoice.TORCH, ScaleCalculationMode.RCEIL, False)
        y.float().pow(2).mean().backward()
        return [t.cpu().float() for t in (y, x.grad, w.grad)]

    expected = run("cpu", KernelPreference.EMULATED)
    tensor_s = {}
    for target in ("trn2", "trn3"):
        with estimate(target) as e:
            actual = run("neuron", KernelPreference.AUTO)
        (row,) = [r for r in e.per_op if r.name == "aten::_scaled_mm"]
        assert row.count == 3  # forward, grad input, grad weight
        tensor_s[target] = row.time_s
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    assert tensor_s["trn3"] < tensor_s["trn2"] / 1.8  # 315 MXFP8 TFLOPS a core vs trn2's 158 FP8


def _linear_step_plans(fp8: bool) -> list:
    """(plan, bindings) of a compiled forward + backward of one linear layer (torchao's float8
    recipe or bf16), traced with symbolic shapes: the weight is an input, so its sizes are
    symbols too. Traced at 48 tokens, 32 -> 80 features (distinct, so each symbol names a size)."""
    from torchneuron.compiler.program import recorded_plans

    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 80, bias=False).to(torch.bfloat16)
    if fp8:
        layer = convert_to_float8_training(layer)  # a root Linear is replaced, not changed in place
    layer = layer.to("neuron")
    weights = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    loss = torch.compile(lambda w, x: torch.func.functional_call(layer, w, (x,)).float().square().mean(),
                         backend="neuron", dynamic=True)
    with recorded_plans() as charged:
        loss(weights, torch.randn(48, 32, dtype=torch.bfloat16, device="neuron", requires_grad=True)).backward()
        torch.neuron.synchronize()
    assert charged and all(bindings for _, bindings in charged), "the graphs were not traced with symbolic sizes"
    return charged


def test_compiled_float8_linear_is_modeled_faster_than_bf16_when_matmul_bound():
    """At a realistic width the fused cast/amax/scale chains (casts riding on neighbouring
    instructions, spread over Vector, Scalar and GpSimd) cost less than the fp8 rate saves: fp8 is
    modeled faster than bf16 on trn2 (2x FP8 rate) and more so on trn3 (4x). At a tiny width the
    cast passes dominate and fp8 is not faster."""
    from torchneuron.compiler.cost import plan_costs
    from torchneuron.hardware.targets import TARGETS

    plans = {fp8: _linear_step_plans(fp8) for fp8 in (False, True)}

    def seconds(fp8: bool, target: str, tokens: int, width: int) -> float:
        sizes = {48: tokens, 32: width, 80: 4 * width}
        return sum(c.duration_s for plan, bindings in plans[fp8]
                   for c in plan_costs(plan.kernels, {k: sizes[v] for k, v in bindings.items()}, TARGETS[target]))

    speedup = {target: seconds(False, target, 4096, 2048) / seconds(True, target, 4096, 2048)
               for target in ("trn2", "trn3")}
    assert 1.3 < speedup["trn2"] < 2.0 and speedup["trn2"] < speedup["trn3"] < 4.0
    assert seconds(False, "trn2", 64, 64) <= seconds(True, "trn2", 64, 64)


def test_only_torchaos_cuda_library_warnings_are_silenced_on_a_cpu_torch():
    """torchao logs "Failed to load" for its CUDA-only kernel libraries on every import (transformers
    imports it on each model load); on a torch without CUDA those records, and only those, are dropped."""
    import logging

    torchao_logger = logging.getLogger("torchao")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    torchao_logger.addHandler(handler)
    try:
        site = "/venv/lib/python3.11/site-packages/torchao"
        torchao_logger.warning(f"Failed to load {site}/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load")
        torchao_logger.warning(f"Failed to load {site}/_C_cutlass_90a.abi3.so: Could not load")
        torchao_logger.warning(f"Failed to load {site}/_C_new_cpu_kernels.so: Could not load")
        torchao_logger.warning("an unrelated torchao warning")
    finally:
        torchao_logger.removeHandler(handler)
    if torch.version.cuda is None:
        assert records == [f"Failed to load {site}/_C_new_cpu_kernels.so: Could not load", "an unrelated torchao warning"]
    else:
        assert len(records) == 4
