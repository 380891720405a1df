"""torch.profiler itself reports neuron device activity: key_averages, events, the Chrome trace,
schedules, on_trace_ready, interruption, and profiles without neuron work."""
import gzip
import warnings
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

import torchneuron.profiler as neuron_profiler
from torchneuron.profiler.trace import DEVICE_PID_BASE

from .conftest import ACTIVITIES

pytestmark = [pytest.mark.filterwarnings("ignore:Profiler won't be using warmup"),
              pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")]


@pytest.fixture(scope="module")
def two_ops():
    a = torch.randn(64, 64, device="neuron")
    with profile(activities=ACTIVITIES) as prof:
        b = torch.mm(a, a)
        torch.add(b, a)
    return prof


def test_key_averages_show_modeled_device_time(two_ops):
    events = neuron_profiler.device_events(two_ops)
    modeled = {e.op: e.duration_us for e in events}
    rows = {r.key: r for r in two_ops.key_averages()}
    assert rows["aten::mm"].self_device_time_total == pytest.approx(modeled["aten::mm"])
    assert rows["aten::add"].self_device_time_total == pytest.approx(modeled["aten::add"])
    assert rows["neuron: aten::mm"].device_time_total == pytest.approx(modeled["aten::mm"])
    assert rows["neuron: aten::mm"].cpu_time_total == 0
    table = two_ops.key_averages().table(sort_by="self_device_time_total", row_limit=5)
    assert "Self NEURON" in table and "neuron: aten::mm" in table
    assert f"{sum(modeled.values()):.3f}us" in table  # "Self NEURON time total"


def test_profiler_bookkeeping_is_hidden(two_ops):
    names = {e.name for e in two_ops.events()}
    assert not any("worklog" in n for n in names)
    assert {"aten::mm", "aten::add"} <= names


def test_chrome_trace_has_host_and_device_tracks(two_ops, tmp_path):
    for name in ("trace.json", "trace.json.gz"):
        path = tmp_path / name
        two_ops.export_chrome_trace(str(path))
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt") as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        device = [e for e in events if e.get("pid") == DEVICE_PID_BASE and e["ph"] == "X"]
        assert [e["name"] for e in device] == ["aten::mm", "aten::add.Tensor"]
        assert device[0]["args"]["engine"] == "tensor" and device[0]["args"]["modeled"] is True
        assert device[1]["ts"] == pytest.approx(device[0]["ts"] + device[0]["dur"])
        host = {e["args"]["External id"]: e for e in events if e.get("cat") == "cpu_op"}
        starts = [e for e in events if e["ph"] == "s"]
        assert len(starts) == 2 and {host_event["name"] for host_event in
                                     (next(h for h in host.values() if h["ts"] == s["ts"]) for s in starts)} \
            == {"aten::mm", "aten::add"}
        assert not any("worklog" in e.get("name", "") for e in events)
        names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
        assert any(n.startswith("neuron:0") for n in names)


def test_trace_loader_reads_gzip_by_content_and_survives_invalid_utf8(tmp_path):
    # Kineto copies names byte for byte: a stray continuation byte (0x9c, as in a cut-off "\u201c")
    # must not fail the export, and a gzip'd trace is gzip whatever its file is named
    from torchneuron.profiler.trace import load_json

    raw = b'{"traceEvents": [{"name": "op \x9c", "ph": "X"}]}'
    plain, packed = tmp_path / "plain.json", tmp_path / "packed.json"
    plain.write_bytes(raw)
    packed.write_bytes(gzip.compress(raw))
    for path in (plain, packed):
        assert load_json(str(path))["traceEvents"][0]["name"] == "op \ufffd"


def test_schedule_records_only_active_steps_and_calls_on_trace_ready():
    ready = []
    x = torch.ones(8, device="neuron")

    def on_ready(p):
        ready.append([(e.name, e.shapes.split(" -> ")[-1]) for e in neuron_profiler.device_events(p)])

    with profile(activities=ACTIVITIES, schedule=schedule(wait=1, warmup=1, active=2, repeat=1),
                 on_trace_ready=on_ready) as prof:
        for step in range(6):
            x.new_ones(step + 1).add_(1)  # a distinct shape per step
            prof.step()
    # steps 0 (wait) and 1 (warmup) are not recorded; 2 and 3 are; 4 and 5 come after the only cycle
    assert ready == [[("aten::fill_.Scalar", "f32[3]"), ("aten::add_.Tensor", "f32[3]"),
                      ("aten::fill_.Scalar", "f32[4]"), ("aten::add_.Tensor", "f32[4]")]]


def test_interrupted_profile_keeps_what_ran_and_restores_the_runtime():
    x = torch.ones(8, device="neuron")
    prof = profile(activities=ACTIVITIES)
    with pytest.raises(KeyboardInterrupt):
        with prof:
            x.add_(1)
            raise KeyboardInterrupt
    assert [e.name for e in neuron_profiler.device_events(prof)] == ["aten::add_.Tensor"]
    assert not neuron_profiler.is_recording()


def test_profile_without_neuron_work_says_so(tmp_path):
    with pytest.warns(UserWarning, match="no neuron device work"):
        with profile(activities=ACTIVITIES) as prof:
            torch.ones(4).add_(1)
    assert neuron_profiler.device_events(prof) == []
    with profile(activities=[ProfilerActivity.CPU]) as cpu_only:
        torch.ones(4, device="neuron").add_(1)
    assert not neuron_profiler.captures_of(cpu_only)
    with pytest.raises(ValueError, match="no neuron device activity"):
        neuron_profiler.export_profile(cpu_only, str(tmp_path / "p"))


def test_profile_dir_handler_writes_one_directory_per_cycle(tmp_path):
    x = torch.ones(8, device="neuron")
    handler = neuron_profiler.profile_dir_handler(str(tmp_path), worker_name="w")
    with profile(activities=ACTIVITIES, schedule=schedule(wait=0, warmup=0, active=1, repeat=2),
                 on_trace_ready=handler) as prof:
        for _ in range(3):
            x.add_(1)
            prof.step()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w_step1", "w_step2"]
    for cycle in ("w_step1", "w_step2"):
        profile_dir = neuron_profiler.load_profile(str(tmp_path / cycle))
        assert profile_dir.problems == [] and profile_dir["events"]["name"].tolist() == ["aten::add_.Tensor"]


def test_acc_events_keeps_every_cycle():
    x = torch.ones(8, device="neuron")
    with profile(activities=ACTIVITIES, schedule=schedule(wait=0, warmup=0, active=1, repeat=2),
                 acc_events=True) as prof:
        for n in range(3):
            x.new_ones(n + 1).add_(1)
            prof.step()
    outputs = [e.shapes.split(" -> ")[-1] for e in neuron_profiler.device_events(prof) if e.name == "aten::add_.Tensor"]
    assert outputs == ["f32[1]", "f32[2]"]
    rows = {r.key: r for r in prof.key_averages()}
    assert rows["aten::add_"].count == 2 and rows["aten::add_"].self_device_time_total > 0


def _assert_times_are_sane(events) -> None:
    for e in events:
        assert e.cpu_time_total >= 0 and e.self_cpu_time_total >= 0, (e.key, e.cpu_time_total, e.self_cpu_time_total)
        assert e.device_time_total >= 0 and e.self_device_time_total >= 0, e.key


def test_legacy_profiler_with_use_device_neuron_times_ops_on_the_device():
    """torch.autograd.profiler.profile(use_device="neuron") (PyTorch's PrivateUse1 fallback state, as
    its backend tests use it): registered profiler stubs time each op on the modeled device timeline."""
    x = torch.randn(128, 128, device="neuron")
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    torch.mm(x, x)
    end.record()
    end.synchronize()
    modeled_us = start.elapsed_time(end) * 1e3
    with torch.autograd.profiler.profile(use_device="neuron") as prof:
        torch.mm(x, x).relu().sum().item()
    averages = prof.key_averages()
    _assert_times_are_sane(averages)
    _assert_times_are_sane(prof.function_events)
    mm = next(e for e in averages if e.key == "aten::mm")
    assert mm.device_time_total > 0  # whole microseconds: the legacy profiler keeps integer us
    assert mm.device_time_total == pytest.approx(modeled_us, abs=1.0)
    assert mm.cpu_time_total > 0 and prof.function_events.total_average().self_cpu_time_total > 0
    assert "NEURON" in averages.table(sort_by="self_cpu_time_total").upper()


def test_privateuse1_activity_alone_and_with_cpu_give_sane_times():
    x = torch.randn(64, 64, device="neuron")
    for activities in ([ProfilerActivity.PrivateUse1], [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with profile(activities=activities) as prof:
                (x @ x).sum().item()
        averages = prof.key_averages()
        _assert_times_are_sane(averages)
        assert sum(e.self_device_time_total for e in averages) > 0
