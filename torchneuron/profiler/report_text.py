"""The explorer's terminal report: an Analysis rendered with rich.

Owns layout only: overview, findings (each with evidence and a suggestion), then the
rankings (ops, source lines, modules), engine utilisation and the bound split.
"""
from __future__ import annotations

from typing import Any

import pandas as pd
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from torchneuron.profiler.analysis import Analysis, _fmt_bytes, _fmt_us


def _table(title: str, df: pd.DataFrame | None, columns: list[tuple[str, str, Any]]) -> Table | None:
    """columns: (header, dataframe column, formatter)."""
    if df is None or not len(df):
        return None
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for header, col, _ in columns:
        table.add_column(header, justify="left" if col in ("op", "source", "module", "engine", "bound", "top_op")
                         else "right", overflow="fold")
    for _, row in df.iterrows():
        table.add_row(*[fmt(row[col]) if col in row else "" for _, col, fmt in columns])
    return table


def _pct(x: float) -> str:
    return f"{x:.1%}"


def render(analysis: Analysis, console: Console | None = None, path: str = "") -> None:
    """Prints the report of `analysis` (of the profile at `path`)."""
    console = console or Console()
    o = analysis.overview
    if o:
        console.print(Panel.fit(
            f"[bold]{path}[/bold]  target {o.get('target', '?')}, {o.get('devices', '?')} device(s), "
            f"{o.get('cycles', 1)} cycle(s)\n"
            f"{o.get('events', 0)} device events, modeled device time {_fmt_us(o.get('device_time_us', 0.0))}, "
            f"span {_fmt_us(o.get('span_us', 0.0))}, {o.get('flops', 0.0) / 1e9:.3f} GFLOP"
            + (f", peak memory {_fmt_bytes(o['peak_memory_bytes'])}" if o.get("peak_memory_bytes", -1) >= 0 else ""),
            title="neuron profile (modeled device time)"))
    for problem in analysis.problems:
        console.print(f"[yellow]note:[/yellow] {problem}", highlight=False, soft_wrap=True)
    if analysis.findings:
        console.rule("Findings (most device time first)")
        for i, f in enumerate(analysis.findings, 1):
            console.print(f"[bold red]{i}. {f.title}[/bold red]  [dim]{_fmt_us(f.time_us)}, {f.share:.1%}[/dim]")
            console.print(f"   {f.detail}", highlight=False)
            for w in f.where:
                console.print(f"   [cyan]at[/cyan] {w}", highlight=False)
            console.print(f"   [green]suggestion:[/green] {f.suggestion}", highlight=False)
    elif analysis.top_ops is not None:
        console.print("[green]No bottleneck found by the checks.[/green]")
    us, n, s = _fmt_us, (lambda x: str(int(x))), str
    for table in (
        _table("Top ops by device time", analysis.top_ops,
               [("op", "op", s), ("calls", "count", n), ("device time", "device_us", us), ("share", "share", _pct),
                ("engine", "engine", s), ("bound", "bound", s), ("fallbacks", "fallbacks", n)]),
        _table("Top source lines by device time", analysis.top_sources,
               [("source", "source", s), ("events", "count", n), ("device time", "device_us", us),
                ("share", "share", _pct), ("top op", "top_op", s)]),
        _table("Top modules by device time", analysis.top_modules,
               [("module", "module", s), ("events", "count", n), ("device time", "device_us", us),
                ("forward", "forward_us", us), ("backward", "backward_us", us), ("share", "share", _pct)]),
        _table("Engine utilisation (busy / span)", analysis.engines,
               [("engine", "engine", s), ("kernels", "kernels", n), ("busy", "busy_us", us),
                ("utilisation", "utilisation", _pct)]),
        _table("Compute- vs memory-bound", analysis.bounds,
               [("bound", "bound", s), ("kernels", "kernels", n), ("device time", "device_us", us),
                ("share", "share", _pct)]),
    ):
        if table is not None:
            console.print()
            console.print(table)
