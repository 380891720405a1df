"""A profiled serving run: vLLM's `LLM.start_profile()` / `stop_profile()` on the neuron worker writes
vLLM's (gzip'd) Chrome trace with the neuron device tracks and a Neuron Explorer profile, whose
device time per op covers the decode steps' attention and matmuls; `torchneuron explorer DIR` reads it."""
from __future__ import annotations

import glob
import gzip
import json
import os

import pytest
import torch

from tests.serving.engine import in_process_llm
from torchneuron.profiler import load_profile
from torchneuron.profiler.explorer_cli import main as explorer
from torchneuron.profiler.tables import profile_runs
from torchneuron.profiler.trace import DEVICE_PID_BASE


@pytest.mark.slow
def test_profiled_serving_run_shows_device_time_per_op(tiny_model, tmp_path, capsys):
    from vllm import SamplingParams

    model = tiny_model("llama", torch.float32)
    profile_dir = str(tmp_path / "profile")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # vLLM's defaults (gzip'd traces, the ops' table) but Python stacks, which make torch's profiler
    # stop ~10x slower with the device capture's Python frames in the trace
    config = {"profiler": "torch", "torch_profiler_dir": profile_dir, "torch_profiler_with_stack": False}
    with in_process_llm(model, dtype="float32", profiler_config=config) as (llm, _):
        llm.generate(["warm up"], greedy, use_tqdm=False)
        llm.start_profile()
        outputs = llm.generate(["Hello, how are you", "The quick brown fox"], greedy, use_tqdm=False)
        llm.stop_profile()
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)

    traces = glob.glob(os.path.join(profile_dir, "*.pt.trace.json.gz"))
    assert len(traces) == 1, os.listdir(profile_dir)
    with gzip.open(traces[0], "rt", encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    device_pids = {DEVICE_PID_BASE + i for i in range(torch.neuron.device_count())}
    assert any(e.get("pid") in device_pids and e.get("ph") == "X" for e in events)  # device tracks

    runs = profile_runs(profile_dir)
    assert len(runs) == 1 and runs[0].endswith(".neuron")
    kernels = load_profile(runs[0])["kernels"]
    per_op = kernels.groupby("name")["total_us"].sum()
    # prefill runs neuron_serving::paged_attention, decode steps the NKI decode-attention kernel
    attention = per_op.get("neuron_serving::paged_attention", 0.0) + per_op.get("nki_kernels::decode_attention", 0.0)
    matmul = per_op[[n for n in per_op.index if n.startswith(("aten::mm", "aten::addmm", "aten::linear"))]].sum()
    assert attention > 0 and matmul > 0, per_op
    # 8 tokens each: one prefill step and 7 decode steps, 2 layers each
    calls = kernels.groupby("name")["count"].sum()
    assert calls.get("neuron_serving::paged_attention", 0) >= 2, calls
    assert calls.get("nki_kernels::decode_attention", 0) >= 2 * 7, calls

    assert explorer([profile_dir]) == 0
    out = capsys.readouterr().out
    assert "paged_attention" in out
