"""Automated bottleneck analysis of a profile directory: rankings and findings with suggestions.

This module owns `analyse(profile) -> Analysis`: the top ops, source lines and modules by
modeled device time, engine utilisation, the compute/memory/latency-bound split, and a list of
`Finding`s, each with the device time it concerns, the evidence (ops, source lines) and a
concrete suggestion. Checks: CPU fallbacks, host<->device copies, unfused elementwise chains,
memory-bound kernels, launch overhead, idle gaps, exposed communication, inefficient matmuls.

It works on whatever tables could be read (see tables.read_profile): a check whose table is
missing is skipped and named in `Analysis.problems`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from torchneuron.profiler.overlap import gaps
from torchneuron.profiler.tables import Profile

FALLBACK_DTYPES = {"f64", "c64", "c128", "complex32"}
ELEMENTWISE = {"elementwise", "transcendental"}
CHAIN_MIN = 3                 # eager elementwise kernels in a row worth fusing
LAUNCH_SHARE = 0.15           # launch overhead worth reporting
MEMORY_BOUND_SHARE = 0.10     # device time in memory-bound kernels worth reporting
IDLE_SHARE = 0.05
EXPOSED_SHARE = 0.05
MATMUL_EFFICIENCY = 0.20      # achieved / peak below which a matmul is inefficient
MATMUL_SHARE = 0.05


@dataclass
class Finding:
    """One bottleneck: what, how much device time it concerns, where, and what to do."""

    key: str
    title: str
    time_us: float
    share: float
    detail: str
    suggestion: str
    where: list[str] = field(default_factory=list)


@dataclass
class Analysis:
    overview: dict[str, Any] = field(default_factory=dict)
    top_ops: pd.DataFrame | None = None
    top_sources: pd.DataFrame | None = None
    top_modules: pd.DataFrame | None = None
    engines: pd.DataFrame | None = None
    bounds: pd.DataFrame | None = None
    findings: list[Finding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def source_label(file: Any, line: Any, function: Any) -> str:
    if not isinstance(file, str) or not file:
        return "(unknown source)"
    try:
        shown = os.path.relpath(file)
        if shown.startswith(".." + os.sep + ".."):
            shown = file
    except ValueError:
        shown = file
    return f"{shown}:{int(line)} ({function})"


def _sources(df: pd.DataFrame) -> pd.Series:
    return pd.Series([source_label(f, l, fn) for f, l, fn in
                      zip(df["source_file"], df["source_line"], df["source_function"])], index=df.index, dtype=object)


def _fmt_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} us"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_cell(kind: str, value: Any) -> str:
    """One ranking cell as shown: `kind` is time (a *_us column: the unit goes with the value), count,
    share or text."""
    if kind == "time":
        return _fmt_us(float(value))
    if kind == "count":
        return str(int(value))
    if kind == "share":
        return f"{float(value):.1%}"
    return str(value)


# What each ranking of an Analysis shows, in every renderer: (header, column, kind of cell). Headers name
# the quantity, never the column: a *_us column's cells carry their own unit ("1.89 ms").
COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "top_ops": [("op", "op", "text"), ("calls", "count", "count"), ("device time", "device_us", "time"),
                ("share", "share", "share"), ("engine", "engine", "text"), ("bound", "bound", "text"),
                ("fallbacks", "fallbacks", "count")],
    "top_sources": [("source", "source", "text"), ("events", "count", "count"), ("device time", "device_us", "time"),
                    ("share", "share", "share"), ("top op", "top_op", "text")],
    "top_modules": [("module", "module", "text"), ("events", "count", "count"), ("device time", "device_us", "time"),
                    ("forward", "forward_us", "time"), ("backward", "backward_us", "time"),
                    ("share", "share", "share")],
    "engines": [("engine", "engine", "text"), ("kernels", "kernels", "count"), ("busy", "busy_us", "time"),
                ("utilisation", "utilisation", "share")],
    "bounds": [("bound", "bound", "text"), ("kernels", "kernels", "count"), ("device time", "device_us", "time"),
               ("share", "share", "share")],
}


def _practices(ev: pd.DataFrame) -> set[str]:
    """What the profiled code already does, so findings do not advise it: foreach (foreach or fused
    optimizer/list ops ran), compiled (compiled graphs or fused kernels ran), low_precision (every
    floating-point kernel worked in bf16/fp16/fp8)."""
    done = set()
    names = ev["name"].astype(str)
    if names.str.contains("::_foreach_|::_fused_", regex=True).any():
        done.add("foreach")
    if ev["kind"].astype(str).isin(["graph", "fused"]).any():
        done.add("compiled")
    dtypes = set(ev.loc[ev["kind"].astype(str) != "copy", "dtype"].astype(str)) - {"", "None", "nan"}
    floats = {d for d in dtypes if d.startswith(("f", "bf"))}
    if floats and all(d in ("bf16", "f16") or d.startswith("f8") for d in floats):
        done.add("low_precision")
    return done


def _advice(*parts: tuple[str | None, str], done: set[str]) -> str:
    """The suggestion parts whose practice (None: always relevant) the code does not follow yet."""
    return "; ".join(text for practice, text in parts if practice is None or practice not in done)


def _top_where(df: pd.DataFrame, n: int = 3) -> list[str]:
    by = df.assign(_src=_sources(df)).groupby("_src", observed=True)["duration_us"].agg(["sum", "count"])
    by = by.sort_values("sum", ascending=False).head(n)
    return [f"{src}: {int(row['count'])}x, {_fmt_us(row['sum'])}" for src, row in by.iterrows()]


# ------------------------------------------------------------------------------------------------
# Rankings
# ------------------------------------------------------------------------------------------------
def _rankings(a: Analysis, ev: pd.DataFrame, total: float, top: int) -> None:
    longest_first = ev.sort_values("duration_us", ascending=False)  # "first" = the longest call's value
    ops = longest_first.groupby("op", observed=True).agg(count=("id", "size"), device_us=("duration_us", "sum"),
                                          main_engine=("engine", "first"), bound=("bound", "first"),
                                          fallbacks=("fallback", "sum"))
    ops = ops.rename(columns={"main_engine": "engine"})  # agg(engine=...) is pandas' numba switch
    ops["share"] = ops["device_us"] / total
    a.top_ops = ops.sort_values("device_us", ascending=False).head(top).reset_index()
    src = longest_first.assign(source=_sources(longest_first)).groupby("source", observed=True).agg(
        count=("id", "size"), device_us=("duration_us", "sum"), top_op=("op", "first"))
    src["share"] = src["device_us"] / total
    a.top_sources = src.sort_values("device_us", ascending=False).head(top).reset_index()
    mods = ev[(ev["module_path"] != "") | (ev["module_type"] != "")]
    if len(mods):
        grouped = mods.assign(
            module=[p if p else f"<{t}>" for p, t in zip(mods["module_path"], mods["module_type"])],
            forward_us=mods["duration_us"].where(mods["phase"] == "forward", 0.0),
            backward_us=mods["duration_us"].where(mods["phase"] == "backward", 0.0),
        ).groupby("module", observed=True).agg(count=("id", "size"), device_us=("duration_us", "sum"),
                                forward_us=("forward_us", "sum"), backward_us=("backward_us", "sum"))
        grouped["share"] = grouped["device_us"] / total
        a.top_modules = grouped.sort_values("device_us", ascending=False).head(top).reset_index()
    spans = ev.groupby("device", observed=True).agg(start=("start_us", "min"), end=("end_us", "max"))
    span_total = float((spans["end"] - spans["start"]).sum()) or 1.0
    eng = ev.groupby("engine", observed=True).agg(busy_us=("duration_us", "sum"), kernels=("id", "size"))
    eng["utilisation"] = eng["busy_us"] / span_total
    a.engines = eng.sort_values("busy_us", ascending=False).reset_index()
    bounds = ev.groupby("bound", observed=True).agg(device_us=("duration_us", "sum"), kernels=("id", "size"))
    bounds["share"] = bounds["device_us"] / total
    a.bounds = bounds.sort_values("device_us", ascending=False).reset_index()


# ------------------------------------------------------------------------------------------------
# Checks (each appends findings; each reads only the events/kernels/summary it needs)
# ------------------------------------------------------------------------------------------------
def _fallbacks(a: Analysis, ev: pd.DataFrame, total: float) -> None:
    fb = ev[ev["fallback"].astype(bool)]
    for (op, dtype), group in fb.groupby(["op", "dtype"], observed=True):
        t = float(group["duration_us"].sum())
        if dtype in FALLBACK_DTYPES:
            why = f"ran on the host because its operands are {dtype}: the NeuronCore has no FP64/complex hardware"
            fix = (f"compute in float32 or bfloat16 (e.g. `.float()` before {op}), or keep this step on the CPU "
                   "deliberately")
        else:
            why = "ran on the host because it has no NeuronCore implementation"
            fix = (f"replace {op} with supported ops, or implement it as an NKI kernel (torchneuron.nki) and "
                   "register it with nki_op; TORCHNEURON_STRICT=1 turns fallbacks into errors to find them")
        a.findings.append(Finding(
            "cpu_fallback", f"CPU fallback: {op} ({dtype or '?'}) ran on the host {len(group)}x", t, t / total,
            f"{op} {why}. Each call copies its operands to the host and back and runs at host speed: "
            f"{_fmt_us(t)} of modeled device time ({t / total:.1%}), {_fmt_us(group['host_fallback_us'].sum())} "
            "of it host compute.", fix, _top_where(group)))


def _copies(a: Analysis, ev: pd.DataFrame, total: float) -> None:
    copies = ev[ev["copy_kind"].isin(["h2d", "d2h"])]
    if not len(copies):
        return
    t = float(copies["duration_us"].sum())
    d2h = copies[copies["copy_kind"] == "d2h"]
    small_d2h = d2h[d2h["bytes"] <= 64]
    detail = (f"{len(copies)} copies between host and device ({_fmt_bytes(copies['bytes'].sum())}): "
              f"{(copies['copy_kind'] == 'h2d').sum()} host->device, {len(d2h)} device->host, "
              f"{_fmt_us(t)} ({t / total:.1%} of device time).")
    fix = ("keep tensors on the device across steps (move the model and data once; create tensors with "
           "device='neuron'); load batches with pin_memory=True and .to('neuron', non_blocking=True)")
    if len(small_d2h):
        detail += (f" {len(small_d2h)} of them read a few bytes back (.item(), .cpu(), printing, Python "
                   "control flow on tensor values), which makes the host wait for the device.")
        fix = ("avoid reading scalars back inside the step (log with .detach() and read every N steps, keep "
               "conditions on the device with torch.where); " + fix)
    a.findings.append(Finding("host_copies", "Host<->device copies", t, t / total, detail, fix, _top_where(copies)))


_SIGNATURE = re.compile(r"\w+\[[^\]]*\]")


def _signature_lists(shapes: str) -> tuple[list[str], list[str]]:
    """"f32[8, 8], i64[] -> f32[8, 8]" -> (["f32[8, 8]", "i64[]"], ["f32[8, 8]"])."""
    ins, _, outs = shapes.partition(" -> ")
    return _SIGNATURE.findall(ins), _SIGNATURE.findall(outs)


def _chains(ev: pd.DataFrame) -> list[list[int]]:
    """Runs of >= CHAIN_MIN eager elementwise kernels back to back on one stream, each consuming a
    tensor of the shape the previous one produced (a proxy for the data dependence)."""
    eligible = (ev["kind"] == "op") & ev["category"].isin(ELEMENTWISE) & ~ev["fallback"].astype(bool)
    chains: list[list[int]] = []
    for _, lane in ev.sort_values("start_us").groupby(["device", "stream", "cycle"], observed=True):
        run: list[int] = []
        produced: list[str] = []
        for idx, ok, shapes in zip(lane.index, eligible.loc[lane.index], lane["shapes"]):
            ins, outs = _signature_lists(shapes)
            if ok and run and set(produced) & set(ins):
                run.append(idx)
            else:
                if len(run) >= CHAIN_MIN:
                    chains.append(run)
                run = [idx] if ok else []
            produced = outs
        if len(run) >= CHAIN_MIN:
            chains.append(run)
    return chains


def _unfused(a: Analysis, ev: pd.DataFrame, total: float, launch_us: float) -> None:
    chains = _chains(ev)
    if not chains:
        return
    spent = saving = 0.0
    groups: dict[str, list[float]] = {}
    for chain in chains:
        part = ev.loc[chain]
        t = float(part["duration_us"].sum())
        spent += t
        saving += t - float(part["duration_us"].max())  # fused: about one pass and one launch
        ops = " -> ".join(o.removeprefix("aten::") for o in part["op"].head(6)) + (" ..." if len(part) > 6 else "")
        first = part.iloc[0]
        key = f"{ops} at {source_label(first['source_file'], first['source_line'], first['source_function'])}"
        groups.setdefault(key, []).append(t)
    where = [f"{k}: {len(v)}x, {_fmt_us(sum(v))}" for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))][:3]
    a.findings.append(Finding(
        "unfused_elementwise", f"Unfused elementwise chains: {len(chains)} chains of {CHAIN_MIN}+ eager kernels",
        spent, spent / total,
        f"{sum(len(c) for c in chains)} elementwise kernels run back to back in {len(chains)} chains "
        f"({_fmt_us(spent)}, {spent / total:.1%}); each kernel pays a launch and a round trip of its operands "
        f"through HBM. Fusing each chain into one kernel would save up to about {_fmt_us(saving)}.",
        "fuse them: torch.compile(model, backend='neuron') runs such chains as one kernel (so does the "
        "adaptive eager mode); or write the chain as one NKI kernel", where))


def _memory_bound(a: Analysis, kernels: pd.DataFrame, summary: pd.DataFrame, total: float,
                  done: set[str]) -> None:
    mem = kernels[(kernels["bound"] == "memory") & (kernels["kind"] != "copy")]
    t = float(mem["total_us"].sum())
    if not len(mem) or t / total < MEMORY_BOUND_SHARE:
        return
    peak, bw = float(summary["peak_flops_bf16"].iloc[0]), float(summary["hbm_bytes_per_s"].iloc[0])
    ridge = peak / bw if bw else 0.0
    where = []
    for _, k in mem.head(3).iterrows():
        where.append(f"{k['name']} {k['shapes']}: {int(k['count'])}x, {_fmt_us(k['total_us'])}, "
                     f"{k['arithmetic_intensity']:.2f} FLOP/B, {k['achieved_bytes_per_s'] / 1e9:.0f} GB/s at "
                     f"{source_label(k['source_file'], k['source_line'], k['source_function'])}")
    a.findings.append(Finding(
        "memory_bound", f"Memory-bound kernels: {_fmt_us(t)} ({t / total:.1%})", t, t / total,
        f"{len(mem)} kernels are limited by HBM bandwidth ({bw / 1e9:.0f} GB/s per core): their arithmetic "
        f"intensity is below the ridge point of {ridge:.0f} FLOP/B (BF16), so the engines wait for data.",
        "raise arithmetic intensity: " + _advice(
            ("compiled", "fuse producers with consumers (torch.compile backend='neuron') so intermediates stay "
                         "in SBUF"),
            ("low_precision", "use bfloat16 to halve the bytes"), (None, "batch small tensors together"),
            done=done), where))


def _launch(a: Analysis, ev: pd.DataFrame, total: float, done: set[str]) -> None:
    launch = float(ev["launch_us"].sum())
    if launch / total < LAUNCH_SHARE:
        return
    n = int((ev["launch_us"] > 0).sum())
    mean = float(ev.loc[ev["launch_us"] > 0, "duration_us"].mean())
    a.findings.append(Finding(
        "launch_overhead", f"Launch overhead: {launch / total:.1%} of device time", launch, launch / total,
        f"{n} eager kernels with a mean duration of {_fmt_us(mean)} each pay the modeled launch cost "
        f"({_fmt_us(launch / max(n, 1))}): {_fmt_us(launch)} in total.",
        "dispatch fewer, larger kernels: " + _advice(
            ("compiled", "torch.compile(model, backend='neuron') turns the step into a few fused kernels"),
            (None, "use larger batches"),
            ("foreach", "use foreach/fused optimizers (AdamW(foreach=True) or fused=True)"), done=done),
        _top_where(ev[ev["launch_us"] > 0])))


def _idle(a: Analysis, ev: pd.DataFrame) -> None:
    for (device, cycle), dev in ev.groupby(["device", "cycle"], observed=True):
        span = float(dev["end_us"].max() - dev["start_us"].min())
        found = gaps(list(zip(dev["start_us"], dev["end_us"])))
        idle = sum(b - s for s, b in found)
        if not span or idle / span < IDLE_SHARE:
            continue
        largest = max(found, key=lambda g: g[1] - g[0])
        before = dev[dev["end_us"] <= largest[0] + 1e-9].sort_values("end_us").tail(1)
        after = dev[dev["start_us"] >= largest[1] - 1e-9].sort_values("start_us").head(1)
        where = [f"largest gap {_fmt_us(largest[1] - largest[0])} between "
                 f"{before['name'].iat[0] if len(before) else '?'} and {after['name'].iat[0] if len(after) else '?'}"
                 + (f" issued at {_sources(after).iat[0]}" if len(after) else "")]
        a.findings.append(Finding(
            "idle_gaps", f"Device {device} idle {idle / span:.1%} of the time in {len(found)} gaps", idle, idle / span,
            f"No stream of neuron:{device} had work for {_fmt_us(idle)} of a {_fmt_us(span)} span: streams waited "
            "for events on other streams or for the host.",
            "remove waits from the step: avoid torch.neuron.synchronize()/event.synchronize() in the loop, let "
            "side streams (copies, communication) run ahead and wait on them only where results are needed",
            where))


def _exposed(a: Analysis, tables: dict, total: float) -> None:
    coll = tables.get("collectives")
    if coll is None or not len(coll):
        return
    exposed = float(coll["exposed_us"].sum())
    if exposed / total < EXPOSED_SHARE:
        return
    a.findings.append(Finding(
        "exposed_communication", f"Communication not overlapped: {_fmt_us(exposed)}", exposed, exposed / total,
        f"{len(coll)} collectives took {_fmt_us(coll['duration_us'].sum())}, of which {_fmt_us(exposed)} "
        "ran while no other stream computed.",
        "overlap communication with compute: DDP buckets gradients during backward (tune bucket_cap_mb), "
        "FSDP2 prefetches (reshard_after_forward, set_modules_to_forward_prefetch); issue collectives with "
        "async_op=True and wait() only when the result is needed",
        _top_where(coll.rename(columns={"event_id": "id"}))))


def _matmuls(a: Analysis, kernels: pd.DataFrame, total: float, done: set[str]) -> None:
    mm = kernels[(kernels["category"] == "matmul") & (kernels["peak_flops_per_s"] > 0)]
    weak = mm[(mm["achieved_flops_per_s"] / mm["peak_flops_per_s"] < MATMUL_EFFICIENCY)]
    t = float(weak["total_us"].sum())
    if not len(weak) or t / total < MATMUL_SHARE:
        return
    where = [f"{k['name']} {k['shapes']}: {k['achieved_flops_per_s'] / k['peak_flops_per_s']:.1%} of peak, "
             f"{int(k['count'])}x, {_fmt_us(k['total_us'])}" for _, k in weak.head(3).iterrows()]
    a.findings.append(Finding(
        "inefficient_matmul", f"Matmuls below {MATMUL_EFFICIENCY:.0%} of Tensor-engine peak", t, t / total,
        f"{len(weak)} matmul kernels ({_fmt_us(t)}) reach less than {MATMUL_EFFICIENCY:.0%} of peak: small "
        "shapes are dominated by fixed costs, and dimensions that are not multiples of 128 waste passes of "
        "the 128x128 array.",
        "give the Tensor engine bigger tiles: " + _advice(
            (None, "larger batch or sequence length"), (None, "hidden sizes that are multiples of 128"),
            ("low_precision", "bfloat16 operands (4x the FP32 rate)"), done=done), where))


# ------------------------------------------------------------------------------------------------
def analyse(profile: Profile, top: int = 10) -> Analysis:
    """Rankings and findings (most device time first) of a profile read by tables.read_profile."""
    a = Analysis(problems=list(profile.problems))
    tables = profile.tables
    ev = tables.get("events")
    summary = tables.get("summary")
    if summary is not None and len(summary):
        s = summary
        a.overview = {
            "target": str(s["target"].iat[0]), "devices": len(s), "events": int(s["events"].sum()),
            "span_us": float(s["span_us"].max()), "busy_us": float(s["busy_us"].sum()),
            "device_time_us": float(s["device_time_us"].sum()), "flops": float(s["flops"].sum()),
            "peak_memory_bytes": int(s["peak_memory_bytes"].max()), "cycles": int(s["cycles"].max()),
            "launch_cost_us": float(s["launch_cost_us"].iat[0]),
        }
    if ev is None or not len(ev):
        a.problems.append("no device events to analyse" + ("" if ev is not None else " (events.parquet unreadable)"))
        kernels = tables.get("kernels")
        if kernels is not None and len(kernels):
            by_name = kernels.groupby("name", observed=True).agg(device_us=("total_us", "sum"), count=("count", "sum"))
            a.top_ops = by_name.sort_values("device_us", ascending=False).head(top).reset_index() \
                .rename(columns={"name": "op"})
        return a
    total = float(ev["duration_us"].sum()) or 1.0
    a.overview.setdefault("device_time_us", total)
    priced_as_host = ev[(ev["engine"] == "host") & ~ev["fallback"].astype(bool)]
    if len(priced_as_host):
        a.problems.append(
            f"{len(priced_as_host)} events ({_fmt_us(priced_as_host['duration_us'].sum())}) ran on the device but the "
            "performance model priced them as host round trips (e.g. a 0-dim float64 scalar operand): "
            + ", ".join(sorted(set(priced_as_host["op"].astype(str)))[:5]))
    launch = float(a.overview.get("launch_cost_us", 0.0))
    _rankings(a, ev, total, top)
    _fallbacks(a, ev, total)
    _copies(a, ev, total)
    _unfused(a, ev, total, launch)
    done = _practices(ev)
    _launch(a, ev, total, done)
    _idle(a, ev)
    _exposed(a, tables, total)
    kernels = tables.get("kernels")
    if kernels is not None and len(kernels) and summary is not None and len(summary):
        _memory_bound(a, kernels, summary, total, done)
        _matmuls(a, kernels, total, done)
    else:
        a.problems.append("kernels or summary table unreadable: memory-bound and matmul checks skipped")
    # a finding is about device time: one that costs none (a fallback of a 0-us op) is not a bottleneck
    a.findings = sorted((f for f in a.findings if f.time_us > 0), key=lambda f: -f.time_us)
    return a
