"""What every benchmark prints first: the host it ran on (results are ratios measured on it)."""
from __future__ import annotations

import os
import platform

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """CPU, core count, load, Python/torch versions, torch threads and the modeled target."""
    from torchneuron.hardware import get_target

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu_model()}, {os.cpu_count()} logical CPUs (load {load:.1f}), torch threads "
            f"{torch.get_num_threads()}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.system()} {platform.release()}; target {get_target().name}")
