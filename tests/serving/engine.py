"""One vLLM engine in the test process (vLLM's in-process mode), started once per test module, and
the cleanup of vLLM run in a process of its own (`kill_session`)."""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import tempfile
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def in_process_llm(model: str, **kwargs: Any) -> Iterator[tuple[Any, str]]:
    """An `LLM` whose engine runs in this process (no engine/worker processes to spawn: starts in
    half the time), and the directory its modeled per-request timings are written to."""
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "TORCHNEURON_SERVING_TIMING_DIR")}
    timing_dir = tempfile.mkdtemp(prefix="neuron-timing-")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TORCHNEURON_SERVING_TIMING_DIR"] = timing_dir
    defaults = dict(max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.02, seed=0, disable_log_stats=False)
    llm = None
    try:
        llm = LLM(model, **{**defaults, **kwargs})
        yield llm, timing_dir
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        torch.accelerator.empty_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def metric(llm: Any, name: str) -> float:
    """A counter or gauge from the engine's stats (vLLM's own metric names)."""
    for m in llm.get_metrics():
        if m.name == name:
            return float(getattr(m, "value", 0) or 0)
    raise KeyError(f"no metric {name!r}; have {[m.name for m in llm.get_metrics()]}")


def kill_session(proc: subprocess.Popen) -> None:
    """Kills what is left of the session `proc` leads (started with start_new_session=True): the
    engine-core and worker processes vLLM starts must not outlive the test."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
