"""Every environment variable torchneuron reads, parsed and validated in one place.

`current()` is the process's settings: a frozen `Settings` parsed from `os.environ` and validated
as a whole the first time (so a bad value fails `import torchneuron` with the variable's name and
what it accepts), parsed again only when one of its variables changes. Values the C++ runtime
needs are handed to it when the library loads (runtime/extension.py); C++ reads no environment.

Switches follow one rule: 1/true/yes/on turn them on, 0/false/no/off turn them off, unset or
empty keeps the default; anything else is an error.

Adding a variable is one field of `Settings`: `name: type = variable("TORCHNEURON_NAME", default,
"meaning")`. The README's table and `torchneuron info` are generated from these fields
(`python -m torchneuron.settings` prints the README's table).
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Mapping

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
MAX_DEVICES = 64  # the C++ runtime's limit (runtime/csrc/device.h, kMaxDevices)

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_switch(text: str) -> bool:
    """'1'/'true'/'yes'/'on' -> True, '0'/'false'/'no'/'off' -> False (any case); else ValueError."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"expected a switch: one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}")


def parse_size(text: str) -> int:
    """'8GiB' -> 8589934592; '512MB' -> 512000000; '1024' -> 1024."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"Cannot read the size {text!r}: use bytes or a number with a unit like 8GiB, 512MB.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _count(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace("_", "").replace(",", ""))
        except ValueError:
            raise ValueError("expected a whole number") from None
        if value < low or (high is not None and value > high):
            raise ValueError(f"expected a number from {low}" + (f" to {high}" if high is not None else " up"))
        return value
    return parse


def _word(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.strip().lower()
        if word not in choices:
            raise ValueError(f"expected one of: {', '.join(choices)}")
        return word
    return parse


def _switch_or(*words: str) -> Callable[[str], str]:
    """A switch (-> 'on'/'off') or one of `words`."""
    def parse(text: str) -> str:
        word = text.strip().lower()
        if word in words:
            return word
        try:
            return "on" if parse_switch(word) else "off"
        except ValueError:
            raise ValueError(f"expected one of: {', '.join(words)}, a switch (1/0)") from None
    return parse


def _text(text: str) -> str:
    return text


_PARSERS: dict[Any, Callable[[str], Any]] = {"bool": parse_switch, "int": _count(0), "str": _text}


def variable(name: str, default: Any, meaning: str, parse: Callable[[str], Any] | None = None) -> Any:
    """A Settings field read from environment variable `name` (unset or empty: `default`).
    `parse` turns its text into the value (by default from the field's type: bool is a switch)."""
    return dataclasses.field(default=default, metadata={"env": name, "meaning": meaning, "parse": parse})


@dataclasses.dataclass(frozen=True)
class Settings:
    """The environment's settings, one field per variable (README: "Environment variables")."""

    target: str | None = variable(
        "TORCHNEURON_TARGET", None, "`trn1`, `trn2` (default) or `trn3`: the Trainium generation modeled")
    device_count: int = variable(
        "TORCHNEURON_DEVICE_COUNT", 2, "number of logical neuron devices in a process (default 2)",
        _count(1, MAX_DEVICES))
    memory_capacity: int | None = variable(
        "TORCHNEURON_MEMORY_CAPACITY", None,
        "modeled HBM per device, e.g. `8GiB` (default: the target's HBM per logical core)", parse_size)
    strict: bool = variable(
        "TORCHNEURON_STRICT", False, "`1`: an op that would fall back to the CPU raises `NotImplementedError`")
    timeline: bool = variable(
        "TORCHNEURON_TIMELINE", True, "`0`: record no device work (no modeled timing, slightly less overhead)")
    autograd_threads: bool = variable(
        "TORCHNEURON_AUTOGRAD_THREADS", False,
        "`1`: keep autograd's device worker threads for backward passes on neuron too (off by default for neuron only; they cost 100-200 µs a step here)")
    eager_mode: str | None = variable(
        "TORCHNEURON_EAGER_MODE", None,
        "`adaptive`: queue eager ops and dispatch fused runs (same as `torchneuron.set_eager_mode(\"adaptive\")`)",
        _word("eager", "adaptive"))
    adaptive_no_plan_cache: bool = variable(
        "TORCHNEURON_ADAPTIVE_NO_PLAN_CACHE", False,
        "`1`: adaptive eager hands every flushed queue to its Python side instead of replaying cached plans "
        "(debugging)")
    compile_fallback: str = variable(
        "TORCHNEURON_COMPILE_FALLBACK", "raise",
        "`eager`: a graph that fails to compile runs eagerly with a warning (default `raise`)", _word("raise", "eager"))
    compile_dump_dir: str | None = variable(
        "TORCHNEURON_COMPILE_DUMP_DIR", None,
        "directory receiving each compiled graph's artifacts (FX graphs, partition plan, code, modeled cost); "
        "graphs then bypass the compiled-graph caches")
    compile_cache_dir: str | None = variable(
        "TORCHNEURON_COMPILE_CACHE_DIR", None,
        "directory of the on-disk cache of compiled graphs (default: Inductor's cache dir)")
    compile_tiered: bool = variable(
        "TORCHNEURON_COMPILE_TIERED", False,
        "`1` (experimental): a compiled graph's first calls run the graph with ATen kernels, charged as planned, "
        "until its C++ kernels finish building in the background (results can differ from the C++ kernels' in "
        "the last bits; default: the first call waits for the build)")
    compile_rope_ce_kernels: str = variable(
        "TORCHNEURON_COMPILE_ROPE_CE_KERNELS", "price",
        "where torch.compile substitutes NKI-lib's RoPE, (fused linear +) cross-entropy, SwiGLU MLP and RMSNorm + "
        "projection kernels: `price` (default) at each site where the kernel's modeled time, forward and backward, "
        "beats the plan of the generic ops (compiler/site_price.py); `1` wherever the kernel takes the operands; `0` "
        "never", _switch_or("price"))
    nki_alias: bool = variable(
        "TORCHNEURON_NKI_ALIAS", False,
        "`1`: `neuronxcc.nki` and `nki` import this package's NKI (for unmodified AWS kernels)")
    nki_simulator: bool = variable(
        "NKI_SIMULATOR", False,
        "`1`: NKI-lib's torch ops compute with their NKI kernel simulated on the data (AWS's CPU-simulator "
        "switch); by default they compute with a host path of matching numerics and charge the kernel's "
        "simulated latency")
    dist_checks: bool = variable(
        "TORCHNEURON_DIST_CHECKS", True,
        "`0`: skip the per-collective cross-rank shape check (one small all-gather each)")
    dist_overlap: bool = variable(
        "TORCHNEURON_DIST_OVERLAP", True,
        "`0`: charge collectives on the issuing stream (no modeled compute/communication overlap)")
    profiler_max_events: int = variable(
        "TORCHNEURON_PROFILER_MAX_EVENTS", 1_000_000,
        "most device events one profile keeps (default 1,000,000; the rest are counted)")
    serving_timing_dir: str | None = variable(
        "TORCHNEURON_SERVING_TIMING_DIR", None,
        "directory where vLLM's neuron worker writes each request's modeled time (`torchneuron serve` sets it; "
        "set it for offline `LLM` runs to keep them)")
    platform_target_override: str | None = variable(
        "NEURON_PLATFORM_TARGET_OVERRIDE", None,
        "NKI's own target override, honoured when `TORCHNEURON_TARGET` is unset")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Parses every variable of `environ` (default os.environ); raises ValueError naming each bad
        one, what it accepts and how to fix it."""
        environ = os.environ if environ is None else environ
        values, problems = {}, []
        for field in dataclasses.fields(cls):
            text = environ.get(field.metadata["env"], "")
            if not text.strip():
                continue
            try:
                values[field.name] = _parser(field)(text)
            except ValueError as error:
                problems.append(f"{field.metadata['env']}={text!r}: {error}")
        if problems:
            raise ValueError("Invalid torchneuron environment variable(s): " + "; ".join(problems)
                             + ". Fix or unset them (README: Environment variables).")
        return cls(**values)


def _parser(field: dataclasses.Field) -> Callable[[str], Any]:
    parse = field.metadata["parse"]
    if parse is not None:
        return parse
    kind = str(field.type).split("|")[0].strip()
    return _PARSERS[kind]


def variables() -> list[dataclasses.Field]:
    """The fields of Settings, in table order (each has metadata env, meaning)."""
    return list(dataclasses.fields(Settings))


NAMES: tuple[str, ...] = tuple(f.metadata["env"] for f in variables())
_cache: tuple[tuple[str | None, ...], Settings] | None = None


def current() -> Settings:
    """The settings of the current environment (parsed again only after one of its variables changed)."""
    global _cache
    raw = tuple(os.environ.get(name) for name in NAMES)
    cached = _cache
    if cached is None or cached[0] != raw:
        cached = _cache = (raw, Settings.from_environ())
    return cached[1]


def markdown_table() -> str:
    """The README's table of environment variables."""
    lines = ["| variable | meaning |", "|---|---|"]
    lines += [f"| `{f.metadata['env']}` | {f.metadata['meaning']} |" for f in variables()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
