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

from torchneuron.profiler.analysis import COLUMNS, Analysis, _fmt_bytes, _fmt_us, format_cell


def _table(title: str, df: pd.DataFrame | None, columns: list[tuple[str, str, str]]) -> Table | None:
    """columns: (header, dataframe column, kind of cell), as in analysis.COLUMNS."""
    if df is None or not len(df):
        return None
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for header, _, kind in columns:
        table.add_column(header, justify="left" if kind == "text" else "right", overflow="fold")
    for _, row in df.iterrows():
        table.add_row(*[format_cell(kind, row[col]) if col in row else "" for _, col, kind in columns])
    return table


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
    titles = {"top_ops": "Top ops by device time", "top_sources": "Top source lines by device time",
              "top_modules": "Top modules by device time", "engines": "Engine utilisation (busy / span)",
              "bounds": "Compute- vs memory-bound"}
    for name, title in titles.items():
        table = _table(title, getattr(analysis, name), COLUMNS[name])
        if table is not None:
            console.print()
            console.print(table)
