"""torchneuron.profiler: torch.profiler integration, trace and Parquet export, the explorer.

    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        train_step()
    print(prof.key_averages().table(sort_by="self_device_time_total"))  # Self NEURON columns
    prof.export_chrome_trace("trace.json")       # host tracks + neuron device tracks
    torchneuron.profiler.export_profile(prof, "prof/")   # Parquet tables + schema + trace
    # then: torchneuron explorer prof/   (or prof/ --html report.html)

What is native and what is parallel:
- native: `torch.profiler.profile` itself records (patched start/stop, see integration.py);
  device time appears in FunctionEvent.device_time_total / self_device_time_total and in
  `key_averages()` (the table's "NEURON" columns); `export_chrome_trace` (and so
  `tensorboard_trace_handler`) writes host and device tracks; schedules, `on_trace_ready` and
  `acc_events` work unchanged.
- parallel: per-kernel details torch's FunctionEvent has no field for (engine, stream, modeled
  start, FLOPs, bytes, bound, fallback, source line, module path) live in the DeviceEvents of
  `device_events(prof)` and in the Parquet tables of `export_profile`.

Modules: capture.py (recording, the hot path), attribution.py (source lines, modules,
phases, after the fact), linking.py (device time into torch.profiler events), integration.py
(the patches), trace.py (Chrome trace), tables.py (Parquet + schema), overlap.py (interval
arithmetic), analysis.py (findings), report_text.py / report_html.py (explorer output),
explorer_cli.py (the `torchneuron explorer` command).

Environment: TORCHNEURON_PROFILER_MAX_EVENTS (default 1000000) caps the device events one
profiling cycle keeps; events past it are counted and reported as dropped.
"""
from __future__ import annotations

from typing import Any, Callable

from torchneuron.profiler.capture import DeviceCapture, DeviceEvent, active_capture
from torchneuron.profiler.integration import captures_of, install, installed, uninstall

__all__ = ["DeviceCapture", "DeviceEvent", "active_capture", "device_events", "export_profile", "install",
           "installed", "is_recording", "load_profile", "profile_dir_handler", "uninstall"]


def is_recording() -> bool:
    """True while a profile records device work (charging code may then attach details, e.g. an
    NKI kernel's instruction trace in `meta["instructions"]`)."""
    return active_capture() is not None


def device_events(prof: Any) -> list[DeviceEvent]:
    """Every device event of a finished torch.profiler.profile (all recorded cycles)."""
    if hasattr(prof, "events"):
        try:
            prof.events()  # links events to host ops
        except Exception:  # noqa: BLE001 - e.g. trace_only profiles have no events
            pass
    return [ev for capture in captures_of(prof) for ev in capture.events]


def export_profile(prof: Any, path: str, *, trace: bool = True) -> str:
    """Writes the processed profile of `prof` (a torch.profiler.profile or a DeviceCapture) to
    the directory `path`: Parquet tables, schema.json, manifest.json and trace.json."""
    from torchneuron.profiler.tables import write_profile

    return write_profile(prof, path, trace=trace)


def load_profile(path: str) -> Any:
    """Reads a profile directory back (tolerates missing or damaged tables); see tables.Profile."""
    from torchneuron.profiler.tables import read_profile

    return read_profile(path)


def profile_dir_handler(dir_name: str, worker_name: str | None = None) -> Callable[[Any], None]:
    """`on_trace_ready` handler writing each cycle's processed profile to
    `dir_name/<worker>_<step>/` (like torch.profiler.tensorboard_trace_handler)."""
    import os
    import socket

    def handler(prof: Any) -> None:
        worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"
        export_profile(prof, os.path.join(dir_name, f"{worker}_step{getattr(prof, 'step_num', 0)}"))
    return handler


install()
