"""The explorer's HTML report: one self-contained file (inline SVG and CSS, no scripts or fetches).

Owns the page: overview, findings with suggestions, a device timeline (one lane per device and
stream, coloured by engine, hover for details), per-op bars, a roofline plot of the kernels
against the target's compute peak and HBM bandwidth, and the ranking tables.
"""
from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from torchneuron.profiler.analysis import COLUMNS, Analysis, _fmt_bytes, _fmt_us, format_cell
from torchneuron.profiler.tables import Profile

MAX_TIMELINE_EVENTS = 4000
ENGINE_COLOURS = {"tensor": "#4e79a7", "vector": "#59a14f", "scalar": "#edc948", "gpsimd": "#b07aa1",
                  "dma": "#9c755f", "host": "#e15759", "link": "#f28e2b", "sync": "#bab0ac"}
BOUND_COLOURS = {"compute": "#4e79a7", "memory": "#e15759", "latency": "#bab0ac"}
_e = html.escape


def _timeline(ev: pd.DataFrame, width: int = 1100) -> str:
    if ev is None or not len(ev):
        return "<p>No device events.</p>"
    shown = ev if len(ev) <= MAX_TIMELINE_EVENTS else ev.nlargest(MAX_TIMELINE_EVENTS, "duration_us")
    lanes = sorted({(d, s) for d, s in zip(ev["device"], ev["stream"])})
    t0, t1 = float(ev["start_us"].min()), float(ev["end_us"].max())
    scale = (width - 140) / max(t1 - t0, 1e-9)
    lane_h, parts = 26, []
    for i, (device, stream) in enumerate(lanes):
        y = 20 + i * lane_h
        parts.append(f'<text x="0" y="{y + 16}" class="lbl">neuron:{device} s{stream}</text>')
    index = {lane: i for i, lane in enumerate(lanes)}
    for row in shown.itertuples(index=False):
        y = 20 + index[(row.device, row.stream)] * lane_h
        x = 140 + (row.start_us - t0) * scale
        w = max(row.duration_us * scale, 0.5)
        tip = (f"{row.name} [{row.engine}, {row.bound}{', CPU fallback' if row.fallback else ''}] "
               f"{_fmt_us(row.duration_us)} at {_fmt_us(row.start_us - t0)}; {row.shapes}; "
               f"{row.source_file}:{row.source_line}; {row.module_path}")
        parts.append(f'<rect x="{x:.2f}" y="{y + 3}" width="{w:.2f}" height="{lane_h - 6}" '
                     f'fill="{ENGINE_COLOURS.get(row.engine, "#888")}"><title>{_e(tip)}</title></rect>')
    height = 30 + len(lanes) * lane_h
    parts.append(f'<text x="140" y="{height + 4}" class="lbl">0</text>'
                 f'<text x="{width - 60}" y="{height + 4}" class="lbl">{_e(_fmt_us(t1 - t0))}</text>')
    legend = " ".join(f'<span class="sw" style="background:{c}"></span>{e}' for e, c in ENGINE_COLOURS.items()
                      if e in set(ev["engine"]))
    note = (f"<p class='dim'>showing the {MAX_TIMELINE_EVENTS} longest of {len(ev)} events</p>"
            if len(ev) > MAX_TIMELINE_EVENTS else "")
    return (f'<svg width="{width}" height="{height + 10}" class="chart">{"".join(parts)}</svg>'
            f"<p>{legend}</p>{note}")


def _bars(df: pd.DataFrame | None, label: str, value: str, width: int = 800) -> str:
    if df is None or not len(df):
        return "<p>No data.</p>"
    top = float(df[value].max()) or 1.0
    rows = []
    for i, row in enumerate(df.itertuples(index=False)):
        v = float(getattr(row, value))
        w = max(v / top * (width - 380), 1)
        rows.append(f'<text x="0" y="{i * 22 + 15}" class="lbl">{_e(str(getattr(row, label))[:48])}</text>'
                    f'<rect x="320" y="{i * 22 + 3}" width="{w:.1f}" height="16" fill="#4e79a7"/>'
                    f'<text x="{325 + w:.1f}" y="{i * 22 + 15}" class="lbl">{_e(_fmt_us(v))}</text>')
    return f'<svg width="{width}" height="{len(df) * 22 + 6}" class="chart">{"".join(rows)}</svg>'


def _roofline(kernels: pd.DataFrame | None, summary: pd.DataFrame | None, size: int = 520) -> str:
    if kernels is None or summary is None or not len(kernels) or not len(summary):
        return "<p>No kernel table: roofline unavailable.</p>"
    k = kernels[(kernels["flops"] > 0) & (kernels["bytes"] > 0) & (kernels["total_us"] > 0)]
    if not len(k):
        return "<p>No kernel with both FLOPs and bytes.</p>"
    peak, bw = float(summary["peak_flops_bf16"].iat[0]), float(summary["hbm_bytes_per_s"].iat[0])
    by_dtype = k.groupby("dtype", observed=True)["peak_flops_per_s"].max()
    peaks = {"bf16 peak": peak, **{f"{d} peak": p for d, p in by_dtype.items() if p > 0 and p != peak}}
    xs = list(k["arithmetic_intensity"]) + [peak / bw]
    ys = list(k["achieved_flops_per_s"]) + list(peaks.values())
    x0, x1 = math.floor(math.log10(min(xs))) - 1, math.ceil(math.log10(max(xs))) + 1
    y0, y1 = math.floor(math.log10(min(ys))) - 1, math.ceil(math.log10(max(ys))) + 1
    m = 50

    def px(x: float) -> float:
        return m + (math.log10(x) - x0) / (x1 - x0) * (size - 2 * m)

    def py(y: float) -> float:
        return size - m - (math.log10(y) - y0) / (y1 - y0) * (size - 2 * m)
    parts = [f'<line x1="{m}" y1="{size - m}" x2="{size - m}" y2="{size - m}" stroke="#333"/>',
             f'<line x1="{m}" y1="{m}" x2="{m}" y2="{size - m}" stroke="#333"/>',
             f'<text x="{size / 2 - 80}" y="{size - 12}" class="lbl">arithmetic intensity (FLOP/B)</text>',
             f'<text x="4" y="{m - 20}" class="lbl">achieved FLOP/s</text>']
    for e in range(x0, x1 + 1):
        parts.append(f'<text x="{px(10 ** e) - 10:.1f}" y="{size - m + 16}" class="lbl">1e{e}</text>')
    for e in range(y0, y1 + 1):
        parts.append(f'<text x="6" y="{py(10 ** e) + 4:.1f}" class="lbl">1e{e}</text>')
    for name, p in peaks.items():  # roof: bandwidth slope up to the ridge, then flat
        ridge = p / bw
        lo = 10 ** x0
        parts.append(f'<polyline fill="none" stroke="#999" stroke-dasharray="4" points="{px(lo):.1f},'
                     f'{py(max(lo * bw, 10 ** y0)):.1f} {px(ridge):.1f},{py(p):.1f} {px(10 ** x1):.1f},{py(p):.1f}"/>'
                     f'<text x="{px(10 ** x1) - 90:.1f}" y="{py(p) - 4:.1f}" class="lbl">{_e(name)}</text>')
    biggest = float(k["total_us"].max())
    for row in k.itertuples(index=False):
        r = 3 + 9 * math.sqrt(row.total_us / biggest)
        tip = (f"{row.name} {row.shapes}: {row.count}x, {_fmt_us(row.total_us)}, {row.arithmetic_intensity:.2f} "
               f"FLOP/B, {row.achieved_flops_per_s / 1e12:.3f} TFLOP/s, {row.bound}-bound")
        parts.append(f'<circle cx="{px(row.arithmetic_intensity):.1f}" cy="{py(row.achieved_flops_per_s):.1f}" '
                     f'r="{r:.1f}" fill="{BOUND_COLOURS.get(row.bound, "#888")}" fill-opacity="0.7">'
                     f'<title>{_e(tip)}</title></circle>')
    legend = " ".join(f'<span class="sw" style="background:{c}"></span>{b}-bound' for b, c in BOUND_COLOURS.items())
    return (f'<svg width="{size}" height="{size}" class="chart">{"".join(parts)}</svg>'
            f"<p>{legend}; HBM {bw / 1e9:.0f} GB/s</p>")


def _html_table(df: pd.DataFrame | None, columns: list[tuple[str, str, str]]) -> str:
    """columns: (header, dataframe column, kind of cell), as in analysis.COLUMNS."""
    if df is None or not len(df):
        return "<p>No data.</p>"
    columns = [c for c in columns if c[1] in df.columns]
    head = "".join(f"<th>{_e(header)}</th>" for header, _, _ in columns)
    body = "".join("<tr>" + "".join(f"<td>{_e(format_cell(kind, row[col]))}</td>" for _, col, kind in columns)
                   + "</tr>" for _, row in df.iterrows())
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(analysis: Analysis, profile: Profile, title: str = "neuron profile") -> str:
    """The whole report as one HTML string."""
    o = analysis.overview
    findings = "".join(
        f"<div class='finding'><h3>{i}. {_e(f.title)} <span class='dim'>{_e(_fmt_us(f.time_us))}, "
        f"{f.share:.1%}</span></h3><p>{_e(f.detail)}</p>"
        + "".join(f"<p class='where'>at {_e(w)}</p>" for w in f.where)
        + f"<p class='fix'>Suggestion: {_e(f.suggestion)}</p></div>"
        for i, f in enumerate(analysis.findings, 1)) or "<p>No bottleneck found by the checks.</p>"
    problems = "".join(f"<p class='note'>note: {_e(p)}</p>" for p in analysis.problems)
    overview = (f"<p>target {_e(str(o.get('target', '?')))}, {o.get('devices', '?')} device(s); "
                f"{o.get('events', 0)} device events; modeled device time {_fmt_us(o.get('device_time_us', 0))}; "
                f"span {_fmt_us(o.get('span_us', 0))}; {o.get('flops', 0) / 1e9:.3f} GFLOP"
                + (f"; peak memory {_fmt_bytes(o['peak_memory_bytes'])}" if o.get("peak_memory_bytes", -1) >= 0
                   else "") + "</p>") if o else ""
    return f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>{_e(title)}</title><style>
body{{font-family:system-ui,sans-serif;margin:24px;max-width:1200px}} .dim{{color:#777;font-weight:normal}}
.finding{{border-left:4px solid #e15759;padding:2px 12px;margin:10px 0;background:#fdf6f6}}
.fix{{color:#256029}} .where{{font-family:monospace;font-size:90%;margin:2px 0}} .note{{color:#8a6d00}}
table{{border-collapse:collapse;font-size:90%}} td,th{{border:1px solid #ddd;padding:3px 8px;text-align:left}}
.lbl{{font-size:11px;font-family:monospace}} .sw{{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px}}
.chart{{background:#fafafa}}</style></head><body>
<h1>{_e(title)}</h1><p class="dim">All device times are modeled by torchneuron's performance model of the
target; host times are wall time of this machine.</p>{overview}{problems}
<h2>Findings</h2>{findings}
<h2>Device timeline</h2>{_timeline(profile.tables.get("events"))}
<h2>Device time per op</h2>{_bars(analysis.top_ops, "op", "device_us")}
<h2>Roofline</h2>{_roofline(profile.tables.get("kernels"), profile.tables.get("summary"))}
<h2>Top source lines</h2>{_html_table(analysis.top_sources, COLUMNS["top_sources"])}
<h2>Top modules</h2>{_html_table(analysis.top_modules, COLUMNS["top_modules"])}
<h2>Engine utilisation</h2>{_html_table(analysis.engines, COLUMNS["engines"])}
<h2>Compute- vs memory-bound</h2>{_html_table(analysis.bounds, COLUMNS["bounds"])}
</body></html>"""
