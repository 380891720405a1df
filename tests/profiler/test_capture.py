"""Device events of known programs: counts, modeled durations, source lines, modules, phases,
fallbacks, copies, work charged from Python, and the capture's limits."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchneuron.profiler as neuron_profiler
from torchneuron.hardware.model import Cost, launch_cost, op_cost
from torchneuron.profiler.capture import DeviceCapture
from torchneuron.hardware import worklog
from torchneuron.hardware.worklog import charge
from torchneuron.runtime.extension import runtime_ops

from .conftest import here

F32 = torch.float32


def test_eager_ops_are_counted_and_priced_by_the_model(profiled):
    a = torch.randn(64, 64, device="neuron")
    b = torch.randn(64, 64, device="neuron")
    charge("busy_elsewhere", Cost(1e-3, "vector", 0.0, 0.0, "latency"), stream=3)  # a stream far ahead
    lines = []

    def program():
        for _ in range(3):
            lines.append(here() + 1)
            torch.add(a, b)
        lines.append(here() + 1)
        torch.mm(a, b)

    events = neuron_profiler.device_events(profiled(program))
    assert [e.name for e in events] == ["aten::add.Tensor"] * 3 + ["aten::mm"]
    sig = (F32, (64, 64))
    add = op_cost("aten::add.Tensor", [sig, sig], [sig])
    mm = op_cost("aten::mm", [sig, sig], [sig])
    for e, cost in zip(events, [add, add, add, mm]):
        assert e.duration_us == pytest.approx((cost.duration_s + launch_cost()) * 1e6, rel=1e-9)
        assert (e.engine, e.bound, e.flops, e.bytes) == (cost.engine, cost.bound, cost.flops, cost.bytes)
        assert e.kind == "op" and not e.fallback and e.launch_us == pytest.approx(launch_cost() * 1e6)
    # back to back on the default stream, from the start of the profile
    assert events[0].start_us == pytest.approx(0.0, abs=1e-9)
    for prev, nxt in zip(events, events[1:]):
        assert nxt.start_us == pytest.approx(prev.start_us + prev.duration_us)
    assert {(e.device, e.stream) for e in events} == {(0, 0)}
    assert [e.source_line for e in events] == lines
    assert {e.source_file for e in events} == {__file__}
    assert {e.source_function for e in events} == {
        "test_eager_ops_are_counted_and_priced_by_the_model.<locals>.program"}
    assert events[3].shapes == "f32[64, 64], f32[64, 64] -> f32[64, 64]" and events[3].dtype == "f32"
    assert [e.host_op for e in events] == ["aten::add"] * 3 + ["aten::mm"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_modules_phases_and_backward_attribution(profiled):
    net = Net().to("neuron")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 16, device="neuron")
    line = {}

    def step():
        line["forward"] = here() + 1
        loss = net(x).sum()
        line["backward"] = here() + 1
        loss.backward()
        line["optimizer"] = here() + 1
        opt.step()

    events = neuron_profiler.device_events(profiled(step))
    fwd = [e for e in events if e.phase == "forward"]
    assert [(e.name, e.module_path, e.module_type) for e in fwd] == [
        ("aten::addmm", "layers.0.fc", "Linear"), ("aten::relu", "layers.0", "Block"),
        ("aten::addmm", "layers.1.fc", "Linear"), ("aten::relu", "layers.1", "Block")]
    block_line = Block.forward.__code__.co_firstlineno + 1
    assert {(e.source_function, e.source_line) for e in fwd} == {("Block.forward", block_line)}
    bwd = [e for e in events if e.phase == "backward"]
    assert {e.source_line for e in bwd} == {line["backward"]}
    mm_grads = [e for e in bwd if e.autograd_node == "AddmmBackward0"]
    assert {e.module_path for e in mm_grads} == {"layers.0.fc", "layers.1.fc"}
    assert {e.forward_source for e in mm_grads} == {f"{Block.forward.__code__.co_filename}:{block_line}:Block.forward"}
    relu_grads = [e for e in bwd if e.autograd_node == "ReluBackward0"]
    assert [e.module_path for e in relu_grads] == ["layers.1", "layers.0"]
    opt_events = [e for e in events if e.phase == "optimizer"]
    # SGD's foreach update of the 4 parameters is one multi-tensor device op
    assert [e.name for e in opt_events] == ["aten::_foreach_add_.List"]
    assert {e.source_line for e in opt_events} == {line["optimizer"]}


def test_ops_run_by_accumulate_grad_are_attributed(profiled):
    # A non-contiguous gradient reaching a leaf is cloned by AccumulateGrad, a node outside the
    # forward's sequence numbering (its number is UINT64_MAX): the op is still captured.
    leaf = torch.randn(4, 6, device="neuron", requires_grad=True)

    def step():
        (leaf.t() * 2).t().sum().backward()

    events = neuron_profiler.device_events(profiled(step))
    assert any(e.autograd_node == "AccumulateGrad" for e in events)
    assert leaf.grad is not None


def test_cpu_fallback_and_copies_are_flagged(profiled):
    x = torch.randn(32, 8, device="neuron")
    line = {}

    def program():
        line["fallback"] = here() + 1
        y = x.double().sum()
        line["read"] = here() + 1
        y.cpu()
        line["upload"] = here() + 1
        torch.ones(100).to("neuron")

    events = neuron_profiler.device_events(profiled(program))
    fallback = [e for e in events if e.fallback]
    assert [(e.name, e.engine, e.dtype) for e in fallback] == [("aten::sum.dim_IntList", "host", "f64")]
    assert fallback[0].host_fallback_us > 0 and fallback[0].source_line == line["fallback"]
    copies = [(e.copy_kind, e.bytes, e.source_line) for e in events if e.kind == "copy"]
    assert copies == [("d2d", 32 * 8 * 4 * 2, line["fallback"]),  # the .double() conversion
                      ("d2h", 8, line["read"]), ("h2d", 400, line["upload"])]


def test_work_charged_from_python_is_captured_with_its_meta(profiled):
    instructions = [{"kind": "nc_matmul", "engine": "tensor", "start": 0.0, "end": 2e-6, "where": "k.py:3"},
                    {"kind": "dma", "engine": "dma", "start": 1e-6, "end": 3e-6, "where": "k.py:4"}]
    line = {}

    def program():
        line["nki"] = here() + 1
        charge("my_kernel", Cost(4e-6, "tensor", 1e6, 1e4, "compute"),
               meta={"kind": "nki", "instructions": instructions})
        charge("all_reduce", Cost(10e-6, "link", 0.0, 1e6, "memory"), stream=1, meta={"kind": "collective"})

    events = neuron_profiler.device_events(profiled(program))
    nki, coll = events
    assert (nki.kind, nki.name, nki.engine, nki.flops) == ("nki", "my_kernel", "tensor", 1e6)
    assert nki.duration_us == pytest.approx(4.0)
    assert nki.source_line == line["nki"] and nki.meta["instructions"] == instructions
    assert (coll.kind, coll.stream, coll.duration_us) == ("collective", 1, pytest.approx(10.0))


def test_threshold_is_restored_and_captures_do_not_nest():
    capture = DeviceCapture().start()
    try:
        with pytest.raises(RuntimeError, match="already recording"):
            DeviceCapture().start()
        assert neuron_profiler.is_recording()
    finally:
        capture.stop()
    assert not neuron_profiler.is_recording()
    worklog.drain()
    torch.ones(4, device="neuron").add_(1)
    assert runtime_ops().worklog_pending() >= 1  # records wait for a batch again: the hot path is untouched
    worklog.drain()


def test_event_limit_counts_what_it_drops():
    a = torch.ones(8, device="neuron")
    capture = DeviceCapture(max_events=5).start()
    try:
        for _ in range(8):
            a.add_(1)
    finally:
        capture.stop()
    assert len(capture.events) == 5 and capture.dropped == 3
    assert [e.id for e in capture.events] == [0, 1, 2, 3, 4]


def test_memory_samples_follow_allocations(profiled):
    def program():
        keep = [torch.empty(1024, device="neuron").fill_(1.0) for _ in range(3)]
        return keep

    # a cached block up to a quarter larger may serve a request; start from an empty cache so each
    # 4 KiB tensor gets a 4 KiB block
    torch.neuron.empty_cache()
    prof = profiled(program, profile_memory=True)
    capture = neuron_profiler.captures_of(prof)[0]
    fills = [m.allocated_bytes for m in capture.memory]
    assert len(fills) == 3 and fills[1] - fills[0] == 4096 and fills[2] - fills[1] == 4096
    assert capture.peak_bytes[0] >= fills[2]


def test_cross_entropy_and_item_have_sources(profiled):
    logits = torch.randn(4, 10, device="neuron")
    target = torch.randint(0, 10, (4,), device="neuron")
    line = here() + 1
    events = neuron_profiler.device_events(profiled(lambda: F.cross_entropy(logits, target).item()))
    assert events and {e.source_line for e in events} == {line}
    assert events[-1].name == "aten::_local_scalar_dense"


def test_work_charged_between_eager_ops_leaves_their_source_lines_alone():
    """Charged work notes a context of its own between two records': each record keeps its own."""
    x = torch.randn(8, 8, device="neuron")
    capture = DeviceCapture().start()
    try:
        a, line_a = x.mul(3), here()
        charge("my_kernel", Cost(4e-6, "tensor", 1e6, 1e4, "compute")); line_k = here()
        b, line_b = a.add(1), here()
        b.exp(); line_c = here()
    finally:
        capture.stop()
    lines = [(ev.name, ev.source_line) for ev in capture.events]
    assert lines == [("aten::mul.Tensor", line_a), ("my_kernel", line_k), ("aten::add.Tensor", line_b),
                     ("aten::exp", line_c)]
    assert capture.unmatched == 0
