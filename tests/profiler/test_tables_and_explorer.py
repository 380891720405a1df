"""The profile directory (Parquet tables, schema, manifest, trace) and the explorer: planted
bottlenecks are found, damaged directories are reported and still analysed."""
import json
import os
import re

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from rich.console import Console

import torchneuron.profiler as neuron_profiler
from torchneuron.profiler.analysis import analyse
from torchneuron.profiler.capture import DeviceCapture
from torchneuron.profiler.explorer_cli import main as explorer
from torchneuron.profiler.report_html import render_html
from torchneuron.profiler.report_text import render
from torchneuron.profiler.tables import SCHEMA, read_profile

from .conftest import here, run_profiled

LINES: dict[str, int] = {}


def planted_program():
    x = torch.randn(128, 128, device="neuron")
    big = torch.randn(1024, 1024, device="neuron")
    for _ in range(2):
        LINES["fallback"] = here() + 1
        x.double().sum()                          # float64: runs on the host
        LINES["chain"] = here() + 1
        ((x * 2 + 1).relu() - 3).sigmoid()        # five eager elementwise kernels in a row
        LINES["memory"] = here() + 1
        big.mul(big)                              # streams 12 MiB for 1M FLOPs


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    prof = run_profiled(planted_program, profile_memory=True)
    path = str(tmp_path_factory.mktemp("profiles") / "planted")
    neuron_profiler.export_profile(prof, path)
    return prof, path


def test_directory_holds_every_table_with_its_schema(planted):
    prof, path = planted
    with open(os.path.join(path, "schema.json")) as f:
        schema = json.load(f)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["complete"] and set(manifest["tables"]) == set(SCHEMA) == set(schema["tables"])
    for name, spec in schema["tables"].items():
        df = pd.read_parquet(os.path.join(path, f"{name}.parquet"))
        assert list(df.columns) == [c["name"] for c in spec["columns"]]
        assert len(df) == manifest["tables"][name]["rows"]
        assert all(c["description"] for c in spec["columns"])
    events = pd.read_parquet(os.path.join(path, "events.parquet"))
    device = neuron_profiler.device_events(prof)
    assert len(events) == len(device) and events["duration_us"].tolist() == [e.duration_us for e in device]
    assert events["end_us"].tolist() == pytest.approx((events["start_us"] + events["duration_us"]).tolist())
    summary = pd.read_parquet(os.path.join(path, "summary.parquet")).iloc[0]
    assert summary["events"] == len(device) and summary["target"] == "trn2"
    assert summary["device_time_us"] == pytest.approx(events["duration_us"].sum())
    assert summary["fallback_count"] == 2 and summary["peak_memory_bytes"] >= 2 * 1024 * 1024 * 4  # big and its product
    kernels = pd.read_parquet(os.path.join(path, "kernels.parquet"))
    mul = kernels[kernels["shapes"].str.startswith("f32[1024, 1024]") & (kernels["name"] == "aten::mul.Tensor")]
    assert mul["count"].tolist() == [2] and mul["bound"].tolist() == ["memory"]
    host = pd.read_parquet(os.path.join(path, "host_ops.parquet"))
    assert (events["host_op_id"] >= 0).all()  # every device event is linked to the op that issued it
    assert host.loc[host["depth"] == 0, "device_us"].sum() == pytest.approx(events["duration_us"].sum())
    assert host["self_device_us"].sum() == pytest.approx(events["duration_us"].sum())
    with open(os.path.join(path, "trace.json")) as f:
        assert any(e.get("cat") == "neuron_op" for e in json.load(f)["traceEvents"])


def test_explorer_finds_the_planted_bottlenecks(planted):
    _, path = planted
    findings = {f.key: f for f in analyse(read_profile(path)).findings}
    assert {"cpu_fallback", "unfused_elementwise", "memory_bound"} <= set(findings)
    assert f"{os.path.relpath(__file__)}:{LINES['fallback']}" in findings["cpu_fallback"].where[0]
    assert "float32" in findings["cpu_fallback"].suggestion
    chain = findings["unfused_elementwise"]
    assert chain.where[0].startswith("mul -> add -> relu -> sub -> sigmoid at ")  # the 1M-element mul is not fed by it
    assert f":{LINES['chain']} " in chain.where[0] and "torch.compile" in chain.suggestion
    assert "aten::mul.Tensor f32[1024, 1024]" in findings["memory_bound"].where[0]
    assert f":{LINES['memory']} " in findings["memory_bound"].where[0]


def test_explorer_command_and_html_report(planted, tmp_path, capsys):
    _, path = planted
    report = tmp_path / "report.html"
    assert explorer([path, "--top", "5", "--html", str(report)]) == 0
    out = capsys.readouterr().out
    for text in ("CPU fallback", "Unfused elementwise", "Memory-bound", "suggestion:", "Top source lines"):
        assert text in out
    page = report.read_text()
    assert page.count("<svg") == 3 and "Roofline" in page and "<script" not in page and "http" not in page


def test_partial_directory_is_reported_and_still_analysed(planted, tmp_path, capsys):
    _, path = planted
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("events", "summary", "kernels"):
        (damaged / f"{name}.parquet").write_bytes(open(os.path.join(path, f"{name}.parquet"), "rb").read())
    (damaged / "kernels.parquet").write_bytes(b"PAR1 truncated")
    profile = read_profile(str(damaged))
    assert any("manifest.json is missing" in p for p in profile.problems)
    assert any(p.startswith("kernels.parquet is unreadable") for p in profile.problems)
    keys = {f.key for f in analyse(profile).findings}
    assert {"cpu_fallback", "unfused_elementwise"} <= keys and "memory_bound" not in keys
    assert explorer([str(damaged)]) == 0
    out = capsys.readouterr().out
    assert "manifest.json is missing" in out and "CPU fallback" in out


def test_unreadable_directories_fail_clearly(tmp_path, capsys):
    assert explorer([str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().out
    (tmp_path / "events.parquet").write_text("not parquet")
    assert explorer([str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "no readable profile table" in out and "events.parquet is unreadable" in out


def test_truncated_capture_and_empty_profile_are_explained(tmp_path):
    a = torch.ones(16, device="neuron")
    capture = DeviceCapture(max_events=3).start()
    for _ in range(5):
        a.add_(1)
    capture.stop()
    path = neuron_profiler.export_profile(capture, str(tmp_path / "truncated"))
    profile = read_profile(path)
    assert profile["summary"]["dropped_events"].tolist() == [2] and len(profile["events"]) == 3
    assert any("2 device events were not recorded" in p for p in profile.problems)
    empty = DeviceCapture().start().stop()
    profile = read_profile(neuron_profiler.export_profile(empty, str(tmp_path / "empty")))
    analysis = analyse(profile)
    assert analysis.findings == [] and any("no device events" in p for p in analysis.problems)
    console = Console(record=True, width=120)
    render(analysis, console)
    assert "no device events" in console.export_text()


def test_tables_read_with_pyarrow_filters(planted):
    _, path = planted
    fallbacks = pq.read_table(os.path.join(path, "events.parquet"), filters=[("fallback", "=", True)])
    assert fallbacks.column("op").to_pylist() == ["aten::sum", "aten::sum"]
    assert fallbacks.column("source_line").to_pylist() == [LINES["fallback"]] * 2


def test_charged_kernels_fill_the_nki_dma_and_collective_tables(tmp_path):
    from torchneuron.hardware.model import Cost
    from torchneuron.nki.scheduler import Record
    from torchneuron.hardware.worklog import charge

    torch.neuron.synchronize()  # all streams start together
    trace = [Record("nc_matmul", "tensor", 0.0, 2e-6, "k.py:3"), Record("dma", "dma", 1e-6, 3e-6, "k.py:4")]
    capture = DeviceCapture().start()
    charge("nki::my_kernel", Cost(4e-6, "tensor", 1e6, 1e4, "compute"), stream=0, meta={"trace": trace})
    charge("fused_kernel_0", Cost(6e-6, "vector", 0.0, 1e6, "memory"), stream=0, meta={"graph": "g0", "kind": "fused"})
    charge("c10d::all_reduce", Cost(10e-6, "link", 0.0, 1e6, "memory"), stream=1)
    charge("c10d::all_gather", Cost(5e-6, "link", 0.0, 5e5, "memory"), stream=1)
    capture.stop()
    profile = read_profile(neuron_profiler.export_profile(capture, str(tmp_path / "p")))
    events = profile["events"]
    assert events[["kind", "category"]].values.tolist() == [["nki", "nki"], ["graph", "fused"],
                                                            ["collective", "collective"], ["collective", "collective"]]
    nki = profile["nki_instructions"]
    assert nki[["engine", "instruction"]].values.tolist() == [["tensor", "nc_matmul"], ["dma", "dma"]]
    assert nki["start_us"].tolist() == pytest.approx([0.0, 1.0])
    assert nki["duration_us"].tolist() == pytest.approx([2.0, 2.0])
    assert profile["dma"]["kind"].tolist() == ["nki"]
    coll = profile["collectives"]
    assert coll["overlapped_us"].tolist() == pytest.approx([10.0, 0.0], abs=1e-6)  # microseconds
    assert coll["exposed_us"].tolist() == pytest.approx([0.0, 5.0], abs=1e-6)  # clocks far from 0 round off
    summary = profile["summary"].iloc[0]
    assert summary["collective_exposed_us"] == pytest.approx(5.0) and summary["busy_us"] == pytest.approx(15.0)
    analysis = analyse(profile)
    assert analysis.top_ops.set_index("op")["engine"].to_dict() == {
        "c10d::all_reduce": "link", "fused_kernel_0": "vector", "c10d::all_gather": "link", "nki::my_kernel": "tensor"}
    assert "exposed_communication" in {f.key for f in analysis.findings}


def test_explorer_accepts_the_directory_given_to_profile_dir_handler(tmp_path, capsys):
    """profile_dir_handler(DIR) writes one DIR/<host>_<pid>_step<N>/ per cycle: the explorer takes DIR,
    analyses the newest cycle and lists the others."""
    from torch.profiler import ProfilerActivity, profile, schedule

    x = torch.randn(32, 32, device="neuron")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
                 schedule=schedule(wait=0, warmup=0, active=1, repeat=2),
                 on_trace_ready=neuron_profiler.profile_dir_handler(str(tmp_path), worker_name="w")) as prof:
        for _ in range(2):
            (x @ x).sum().item()
            prof.step()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w_step1", "w_step2"]
    assert explorer([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "interrupted" not in out and "analysing the newest, w_step2" in out and "w_step1" in out


def test_report_headers_name_quantities_and_cells_carry_units(planted):
    """HTML and text tables share analysis.COLUMNS: 'device time' headers, '1.89 ms'-style cells, never
    a raw column name such as device_us over a value in ms."""
    prof, path = planted
    profile = read_profile(path)
    page = render_html(analyse(profile), profile)
    headers = set(re.findall(r"<th>([^<]*)</th>", page))
    assert "device time" in headers and not any(h.endswith("_us") or h == "count" for h in headers)
    cells = re.findall(r"<td>([^<]*)</td>", page)
    assert any(re.fullmatch(r"[\d.]+ (us|ms|s)", c) for c in cells)


def test_no_finding_without_device_time(planted):
    _, path = planted
    profile = read_profile(path)
    events = profile.tables["events"]
    free = events[events["fallback"]].head(1).assign(op="aten::free_op", name="aten::free_op", duration_us=0.0,
                                                    launch_us=0.0, host_fallback_us=0.0)
    profile.tables["events"] = pd.concat([events, free], ignore_index=True)
    findings = analyse(profile).findings
    assert findings and all(f.time_us > 0 for f in findings)
    assert not any("free_op" in f.title for f in findings)


def test_advice_already_followed_is_not_given(planted):
    """The launch / memory / matmul suggestions drop what the profiled code already does."""
    from torchneuron.profiler.analysis import _advice, _practices

    _, path = planted
    events = read_profile(path).tables["events"]
    assert "foreach" not in _practices(events)
    foreach = events.head(1).assign(name="aten::_foreach_add_.List", op="aten::_foreach_add_", kind="op")
    done = _practices(pd.concat([events, foreach], ignore_index=True))
    assert "foreach" in done
    advice = (("foreach", "use foreach"), (None, "use larger batches"))
    assert _advice(*advice, done=done) == "use larger batches"
    assert _advice(*advice, done=set()) == "use foreach; use larger batches"
    low = events.assign(dtype="bf16")
    assert "low_precision" in _practices(low) and "low_precision" not in _practices(events)


def test_a_profile_with_python_stacks_exports(tmp_path):
    """with_stack=True (vLLM's profiler default) records Python-stack events whose thread torch reports
    as 2**64 - 1: the export keeps them (thread -1) instead of failing on the int64 column."""
    import threading

    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(16, 16, device="neuron")
    profiles = []

    def profiled_in_a_thread():  # the thread's frames predate the profile, as in vLLM's engine thread
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], with_stack=True) as p:
            (x @ x).sum().item()
        profiles.append(p)

    worker = threading.Thread(target=profiled_in_a_thread)
    worker.start()
    worker.join()
    prof = profiles[0]
    neuron_profiler.export_profile(prof, str(tmp_path / "p"))
    profile_read = read_profile(str(tmp_path / "p"))
    assert not profile_read.problems
    host_ops = profile_read["host_ops"]
    assert host_ops["name"].str.contains("threading.py").any()
    # whether torch reports any of the thread's events as 2**64 - 1 varies from run to run; those
    # that it does are kept as -1, so the column is int64 and nothing is below -1
    assert host_ops["thread"].dtype == "int64" and (host_ops["thread"] >= -1).all()
