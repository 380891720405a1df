"""Settings of the neuron compiler, read from the environment (torchneuron/settings.py) at each use.

| variable | effect |
|---|---|
| TORCHNEURON_COMPILE_FALLBACK | `eager`: a graph that fails to compile runs eagerly (with a warning); default `raise` |
| TORCHNEURON_COMPILE_DUMP_DIR | directory receiving each compiled graph's artifacts (graphs, plans, code, cost) |
| TORCHNEURON_COMPILE_CACHE_DIR | directory of the on-disk cache of compiled graphs (default: Inductor's cache dir) |
| TORCHNEURON_STRICT | `1`: an op that would fall back to the CPU is an error, also inside graphs |
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from torchneuron import settings

VERSION = "12"  # bump when a change to the pipeline must invalidate cached graphs


@lru_cache(maxsize=1)
def source_hash() -> str:
    """A digest of every Python source file of the torchneuron package: part of the on-disk
    cache key, so a graph compiled by other code (an upgrade, a local edit to a pass or to the
    op policy) is compiled again instead of reused, as Inductor keys its cache on its own code."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def fallback_to_eager() -> bool:
    return settings.current().compile_fallback == "eager"


def dump_dir() -> str | None:
    return settings.current().compile_dump_dir


def cache_dir() -> str | None:
    return settings.current().compile_cache_dir
