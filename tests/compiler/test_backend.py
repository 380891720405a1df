"""torch.compile(backend="neuron"): registration, modes, graph breaks, recompiles, dynamic
shapes, failures, artifacts, caching, and the device timeline charge of compiled graphs."""
import json
import os
import warnings

import pytest
import torch

import torchneuron.compiler
from torchneuron.compiler import NeuronCompileError, cache
from torchneuron.hardware import estimate

from tests.models import GeluMLP


def fn(x, y):
    return torch.relu(x @ y + 2).sum(dim=0) * 3


def inputs(n=8, device="neuron"):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 8, generator=g).to(device), torch.randn(8, 8, generator=g).to(device)


def test_backend_is_found_by_name():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "neuron" in list_backends()
    assert lookup_backend("neuron") is torchneuron.compiler.neuron_backend


def test_device_interface_exposes_the_neuron_runtime():
    from torch._dynamo.device_interface import get_interface_for_device

    interface = get_interface_for_device("neuron")
    properties = interface.get_device_properties()
    assert properties.multi_processor_count == torch.neuron.get_device_properties().multi_processor_count > 0
    assert interface.device_count() == torch.neuron.device_count()
    assert interface.current_device() == torch.neuron.current_device()


def test_compile_matches_eager_on_neuron_and_cpu(fresh_dynamo):
    x, y = inputs()
    out = torch.compile(fn, backend="neuron")(x, y)
    assert out.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), fn(x, y).cpu())
    torch.testing.assert_close(out.cpu(), fn(x.cpu(), y.cpu()), atol=1e-5, rtol=1e-5)


def test_default_backend_and_module_compile(fresh_dynamo):
    # (Module.compile() on a bare torch.nn container compiles nothing in torch 2.13: Dynamo skips
    # frames of torch.nn itself, so the model is a user module.)
    model = GeluMLP(d_in=8, hidden=16, norm=False).to("neuron")
    x = torch.randn(5, 8, device="neuron")
    expected = model(x)
    previous = torch.compiler.get_default_backend()
    torch.compiler.set_default_backend("neuron")
    try:
        model.compile()
        with estimate() as est:
            out = model(x)
    finally:
        torch.compiler.set_default_backend(previous)
    torch.testing.assert_close(out, expected)
    assert any(row.name.startswith("fused_") for row in est.per_op), [r.name for r in est.per_op]


def test_other_modes_warn_once_and_compile_as_default(fresh_dynamo):
    x, y = inputs()
    with pytest.warns(UserWarning, match="mode='reduce-overhead'.*not supported"):
        out = torch.compile(fn, backend="neuron", mode="reduce-overhead")(x, y)
    torch.testing.assert_close(out, fn(x, y))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        torch.compile(fn, backend="neuron", mode="reduce-overhead")(x, y)


def test_graph_breaks_and_recompiles(fresh_dynamo):
    from torch._dynamo.utils import counters

    def broken(x):
        y = x.sin() * 2
        torch._dynamo.graph_break()
        return y.cos() + 1

    before = counters["stats"]["unique_graphs"]
    compiled = torch.compile(broken, backend="neuron", dynamic=False)
    for n in (4, 6, 4):
        x = torch.randn(n, device="neuron")
        torch.testing.assert_close(compiled(x), broken(x))
    assert counters["stats"]["unique_graphs"] - before == 4  # two graphs per shape, two shapes


def test_dynamic_shapes_compile_once(fresh_dynamo):
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    compiled = torch.compile(fn, backend="neuron", dynamic=True)
    for n in (5, 9, 13):
        x, y = inputs(n)
        with estimate() as est:
            out = compiled(x, y)
        torch.testing.assert_close(out, fn(x, y))
        assert est.device_time_s > 0
    assert counters["stats"]["unique_graphs"] - before == 1


def test_compiled_graph_charges_fewer_kernels_and_less_time_than_eager(fresh_dynamo):
    def chain(x):
        return ((x.sin() * 2 + 1).exp() - x).relu().sum(-1)

    x = torch.randn(256, 256, device="neuron")
    compiled = torch.compile(chain, backend="neuron")
    compiled(x)
    with estimate() as eager:
        chain(x)
    with estimate() as fused:
        out = compiled(x)
    torch.testing.assert_close(out, chain(x))
    assert fused.entries < eager.entries / 2
    assert fused.device_time_s < eager.device_time_s / 2


def test_event_timing_around_a_compiled_graph_counts_eager_work_issued_before_it(fresh_dynamo):
    # Without a listener, a graph's plan is charged at once and eager work still in the work log
    # is applied later: events must time the same as when everything is applied in order.
    from torchneuron.hardware.worklog import drain

    compiled = torch.compile(lambda x: (x @ x).relu().sum(0), backend="neuron")
    x = torch.randn(256, 256, device="neuron")
    compiled(x)
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)

    def timed(in_order: bool) -> float:
        start.record()
        drain()  # no control record pending: the graph's charge may leave op records for later
        x * 2    # eager work between the event and the graph
        if in_order:
            drain()
        compiled(x)
        end.record()
        return start.elapsed_time(end)

    deferred, in_order = timed(False), timed(True)
    assert deferred == pytest.approx(in_order, rel=1e-9)
    assert deferred > 0


def test_failure_raises_with_reason_or_falls_back_to_eager(fresh_dynamo, monkeypatch):
    from torchneuron.compiler import graph_fusion

    def broken_fusion(*args, **kwargs):
        raise RuntimeError("fusion exploded")

    monkeypatch.setattr(graph_fusion, "fuse", broken_fusion)
    monkeypatch.setattr("torchneuron.compiler.pipeline.fuse", broken_fusion)
    x, y = inputs(3)
    with pytest.raises(Exception, match="fusion exploded") as raised:
        torch.compile(fn, backend="neuron")(x, y)
    chain = raised.value
    while chain is not None and not isinstance(chain, NeuronCompileError):
        chain = chain.__cause__ or getattr(chain, "inner_exception", None)
    assert isinstance(chain, NeuronCompileError) and "TORCHNEURON_COMPILE_FALLBACK" in str(chain)

    torch._dynamo.reset()
    monkeypatch.setenv("TORCHNEURON_COMPILE_FALLBACK", "eager")
    with pytest.warns(UserWarning, match="fusion exploded.*eagerly"):
        out = torch.compile(fn, backend="neuron")(x, y)
    torch.testing.assert_close(out, fn(x, y))


def test_artifacts_are_written(fresh_dynamo, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_COMPILE_DUMP_DIR", str(tmp_path))

    def attention(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).relu()

    q = torch.randn(1, 2, 16, 8, device="neuron")
    cache.clear()
    torch.compile(attention, backend="neuron")(q)
    dirs = {p.name: p for p in tmp_path.iterdir()}
    dynamo = [p for name, p in dirs.items() if name.startswith("dynamo_graph")]
    graphs = [p for name, p in dirs.items() if name.startswith("graph_")]
    assert dynamo and graphs
    applied = {name: n for name, n in json.loads((dynamo[0] / "substitutions.json").read_text()).items() if n}
    assert applied == {"flash_attention": 1}
    files = set(os.listdir(graphs[0]))
    assert {"aten_before_passes.txt", "aten_after_passes.txt", "partition.json", "kernels.json", "cost.json",
            "generated_code.py"} <= files
    cost = json.loads((graphs[0] / "cost.json").read_text())
    assert cost["kernels"] >= 1 and cost["device_time_s"] > 0
    names = [k["name"] for k in cost["per_kernel"]]
    assert any(name.startswith("nki_flash_attention") for name in names), names
    assert "DeviceProgram.from_json" in (graphs[0] / "generated_code.py").read_text()


def test_gelu_and_silu_stay_whole_and_give_eager_bits(fresh_dynamo, tmp_path, monkeypatch):
    """GELU, SiLU and their derivatives are one Scalar-engine instruction each: the plan prices
    them as one op, and the host code calls their eager kernels, so the results are eager's."""
    monkeypatch.setenv("TORCHNEURON_COMPILE_DUMP_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.SiLU(), torch.nn.Linear(32, 4)).to("neuron")
    x = torch.randn(8, 16, device="neuron")

    def step(run):
        run(x).square().mean().backward()
        grads = [p.grad.cpu() for p in model.parameters()]
        model.zero_grad()
        return grads

    want = step(model)
    cache.clear()
    got = step(torch.compile(model, backend="neuron"))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    ops = set()
    for cost in tmp_path.glob("graph_*/cost.json"):
        ops |= {op.split("::")[1].split(".")[0] for k in json.loads(cost.read_text())["per_kernel"] for op in k["ops"]}
    assert {"gelu", "gelu_backward", "silu", "silu_backward"} <= ops, sorted(ops)
    assert "erf" not in ops and "sigmoid" not in ops


def test_artifacts_are_complete_when_the_graph_is_in_the_caches(fresh_dynamo, tmp_path, monkeypatch):
    def fn(x):
        return (x @ x).relu() + 1

    x = torch.randn(16, 16, device="neuron")
    torch.compile(fn, backend="neuron")(x)  # now in the memory cache and Inductor's disk cache
    torch._dynamo.reset()
    monkeypatch.setenv("TORCHNEURON_COMPILE_DUMP_DIR", str(tmp_path))
    torch.testing.assert_close(torch.compile(fn, backend="neuron")(x), fn(x))
    graphs = [p for p in tmp_path.iterdir() if p.name.startswith("graph_")]
    assert graphs, sorted(p.name for p in tmp_path.iterdir())
    assert {"kernels.json", "cost.json", "generated_code.py"} <= set(os.listdir(graphs[0]))


def test_memory_cache_skips_compilation_of_a_recaptured_graph(fresh_dynamo):
    x, y = inputs(7)
    cache.clear()
    before = cache.stats()
    torch.compile(fn, backend="neuron")(x, y)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="neuron")(x, y)
    after = cache.stats()
    assert after["memory_misses"] - before["memory_misses"] == 1
    assert after["memory_hits"] - before["memory_hits"] == 1
    torch.testing.assert_close(out, fn(x, y))


_PROGRAM = """
import torch
from torchneuron.compiler import cache
from torchneuron.hardware import estimate
def f(x):
    return (x.sin() * x.cos()).sum(0) + 1
x = torch.arange(12.0, device="neuron").view(3, 4)
with estimate() as est:
    print(torch.compile(f, backend="neuron")(x).cpu().tolist())
print(sorted(row.name for row in est.per_op if row.name.startswith("fused")))
s = cache.stats()
print(s["disk_graph_hits"], s["disk_graph_misses"], s["disk_autograd_hits"])
"""


@pytest.mark.slow
def test_disk_cache_serves_a_second_process(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "TORCHNEURON_COMPILE_CACHE_DIR": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)  # Inductor's default: a pool of compile subprocesses
    runs = [subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    (values1, kernels1, counts1), (values2, kernels2, counts2) = (r.stdout.strip().splitlines()[-3:] for r in runs)
    assert values1 == values2
    assert kernels1 == kernels2 and "fused" in kernels2  # the reloaded program still charges its kernels
    assert counts1.split() == ["0", "1", "0"], counts1    # compiled, saved
    assert counts2.split() == ["1", "0", "1"], counts2    # reloaded: no tracing of autograd, no codegen


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_float64_scale_math_and_float8_casts_compile_on_device_in_strict_mode(target):
    """The compiler places ops by eager mode's rules: float64 elementwise arithmetic and casts
    are emulated on the device, FP8 types a generation lacks are cFP8 (trn1's e5m2)."""
    from torchneuron.hardware.targets import get_target, set_target

    def scale_cast(x):
        amax = x.abs().amax().to(torch.float64)
        scale = (448.0 / torch.clamp(amax, min=1e-12)).to(torch.float32)
        return (x * scale).clamp(-448.0, 448.0).to(torch.float8_e5m2).float() / scale

    x = torch.randn(16, 32)
    previous = get_target().name
    set_target(target)
    torchneuron.set_strict(True)
    try:
        out = torch.compile(scale_cast, backend="neuron")(x.to("neuron"))
    finally:
        torchneuron.set_strict(False)
        set_target(previous)
    torch.testing.assert_close(out.cpu(), scale_cast(x), rtol=0, atol=0)
