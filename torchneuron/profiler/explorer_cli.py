"""Explore a neuron profile: bottleneck analysis in the terminal, or --html for a report file.

    torchneuron explorer PROFILE_DIR [--top N] [--html REPORT.html]

PROFILE_DIR is a directory written by `torchneuron.profiler.export_profile(prof, DIR)`, or the
directory given to the `profile_dir_handler(DIR)` on_trace_ready handler: then the newest of the
cycles it wrote (DIR/<host>_<pid>_step<N>/) is analysed and the others are listed. This module owns the command's arguments and
exit codes: 0 analysed (possibly with notes on damaged parts), 2 nothing readable.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile_dir", metavar="PROFILE_DIR", help="directory written by export_profile")
    parser.add_argument("--top", type=int, default=10, help="rows in each ranking (default 10)")
    parser.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report to FILE")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from torchneuron.profiler.analysis import analyse
    from torchneuron.profiler.report_text import render
    from torchneuron.profiler.tables import ProfileError, profile_runs, read_profile

    console = Console()
    path = args.profile_dir
    runs = profile_runs(path)
    if runs:
        path = runs[-1]
        console.print(f"{args.profile_dir} holds {len(runs)} profiles (one per profiling cycle); analysing the "
                      f"newest, {os.path.basename(path)}", highlight=False, soft_wrap=True)
        for run in runs[:-1]:
            console.print(f"  also: {run}", highlight=False, soft_wrap=True)
    try:
        profile = read_profile(path)
    except ProfileError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        return 2
    analysis = analyse(profile, top=args.top)
    render(analysis, console, path=path)
    if args.html:
        from torchneuron.profiler.report_html import render_html

        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_html(analysis, profile, title=f"neuron profile: {path}"))
        console.print(f"\nHTML report written to {args.html}")
    return 0


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `explorer` to a parent command's subparsers."""
    parser = subparsers.add_parser("explorer", help=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron explorer", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
