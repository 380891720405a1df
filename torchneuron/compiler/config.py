"""Settings of the neuron compiler, read from the environment (torchneuron/settings.py) at each use.

| variable | effect |
|---|---|
| TORCHNEURON_COMPILE_FALLBACK | `eager`: a graph that fails to compile runs eagerly (with a warning); default `raise` |
| TORCHNEURON_COMPILE_DUMP_DIR | directory receiving each compiled graph's artifacts (graphs, plans, code, cost) |
| TORCHNEURON_COMPILE_CACHE_DIR | directory of the on-disk cache of compiled graphs (default: Inductor's cache dir) |
| TORCHNEURON_STRICT | `1`: an op that would fall back to the CPU is an error, also inside graphs |
"""
from __future__ import annotations

from torchneuron import settings

VERSION = "12"  # bump when a change to the pipeline must invalidate cached graphs


def fallback_to_eager() -> bool:
    return settings.current().compile_fallback == "eager"


def dump_dir() -> str | None:
    return settings.current().compile_dump_dir


def cache_dir() -> str | None:
    return settings.current().compile_cache_dir
