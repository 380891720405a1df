"""Artifacts of each compiled graph, written when TORCHNEURON_COMPILE_DUMP_DIR is set.

One directory per graph, `<dump dir>/<graph name>/`, with:

| file | content |
|---|---|
| dynamo_graph.txt | the graph Dynamo captured (after NKI kernel substitution) |
| aten_before_passes.txt / aten_after_passes.txt | the post-autograd ATen graph around the FX passes |
| passes.json | rewrites made by each FX pass |
| partition.json | placement of every op (device, host fallback, cpu) and why ops fall back |
| kernels.json | the kernel plan: each kernel's ops, HBM reads and writes |
| cost.json | modeled cost per kernel on the current target, total, and the eager baseline |
| generated_code.py | Inductor's generated host code (with the embedded plan) |

While dumping, graphs bypass the compiled-graph caches (cache.py): a graph served from a cache
is never planned, so it would leave no plan, cost or code behind.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from torchneuron.compiler import config


def graph_dir(name: str) -> str | None:
    """The artifact directory of graph `name` (created), or None when dumping is off."""
    root = config.dump_dir()
    if root is None:
        return None
    path = os.path.join(root, re.sub(r"[^A-Za-z0-9_.-]+", "_", name))
    os.makedirs(path, exist_ok=True)
    return path


def write(name: str, filename: str, content: Any) -> None:
    """Writes one artifact of graph `name` (text as is, anything else as JSON)."""
    path = graph_dir(name)
    if path is None:
        return
    with open(os.path.join(path, filename), "w") as f:
        if isinstance(content, str):
            f.write(content)
        else:
            json.dump(content, f, indent=1, default=str)
