"""The instruction stream and its schedule: dependencies, engine parallelism, benchmark and
profile APIs, typed placeholders, target selection."""
import json
import time

import numpy as np
import pytest

import torch
import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
import torchneuron.nki.typing as nt
from torchneuron.hardware.instructions import instruction_timing
from torchneuron.hardware.targets import TARGETS
from torchneuron.nki.scheduler import Scheduler, Timeline


def test_timeline_fills_gaps_without_overlap():
    tl = Timeline()
    assert tl.place(10.0, 5.0) == 10.0
    assert tl.place(0.0, 4.0) == 0.0          # fits before
    assert tl.place(0.0, 8.0) == 15.0         # does not fit in [4, 10)
    assert tl.place(4.0, 6.0) == 4.0          # exactly fills the gap
    assert tl.starts == [0.0] and tl.ends == [23.0]


def test_scheduler_dependencies():
    s = Scheduler()
    a = s.issue("dma", "dma", 1.0, 2.0, [], [(1, ((0, 9),))])            # write buf 1
    b = s.issue("op", "vector", 1.0, 1.0, [(1, ((0, 4),))], [(2, None)])  # RAW on buf 1
    c = s.issue("op", "scalar", 1.0, 1.0, [(3, None)], [(4, None)])       # independent
    d = s.issue("dma", "dma", 1.0, 1.0, [], [(1, ((5, 9),))])             # WAW with a, not b's read
    assert (a, b, c) == (2.0, 3.0, 1.0)
    assert d == 3.0  # queue busy until 1, waits for a's completion at 2
    e = s.issue("dma", "dma", 1.0, 1.0, [], [(1, ((0, 1),))])             # WAR with b's read
    assert e >= b + 1.0


@nki.jit
def _independent(a):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a)
    e = nl.exp(x)                  # Scalar engine
    v = nl.add(x, x)               # Vector engine, independent of e
    nl.store(out, value=nl.add(e, v))
    return out


def test_engines_run_in_parallel_and_latency_is_modeled():
    _, st = _independent.run((torch.randn(128, 512),), {}, trace=True, target=TARGETS["trn2"])
    tgt = TARGETS["trn2"]
    act = instruction_timing("activation", partitions=128, free_elems=512, dtype=torch.float32, target=tgt)
    vec = instruction_timing("tensor_tensor", partitions=128, free_elems=512, dtype=torch.float32, target=tgt)
    exp_rec = next(r for r in st.trace if r.engine == "scalar")
    add_rec = next(r for r in st.trace if r.engine == "vector")
    assert exp_rec.start < add_rec.end and add_rec.start < exp_rec.end   # overlap on two engines
    assert st.latency_s == pytest.approx(max(r.end for r in st.trace))
    assert st.engine_busy_s["scalar"] == pytest.approx(act.busy_s)
    assert st.engine_busy_s["vector"] == pytest.approx(2 * vec.busy_s)
    assert 0 < st.utilisation["vector"] <= 1


@nki.jit
def _chain(a):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a)
    for _ in nl.sequential_range(4):
        x = nl.exp(x)
    nl.store(out, value=x)
    return out


def test_dependent_chain_is_serial():
    _chain(torch.zeros(128, 512))
    st = _chain.last_stats
    act = instruction_timing("activation", partitions=128, free_elems=512, dtype=torch.float32)
    assert st.latency_s > 4 * act.latency_s


def test_benchmark_reads_like_aws_samples():
    bench = nki.benchmark(warmup=2, iters=5)(_independent)
    bench(torch.randn(128, 512))
    res = bench.benchmark_result.nc_latency
    assert res.get_latency_percentile(50) == pytest.approx(_independent.last_stats.latency_us)
    assert res.get_latency_percentile(99) >= res.get_latency_percentile(1) > 0


def test_placeholders_run_timing_only():
    bench = nki.benchmark(_independent)
    out = bench(nt.tensor[[128, 512], nl.float32])
    assert isinstance(out, nt.TensorType) and out.shape == (128, 512) and out.dtype == nl.float32
    assert bench.benchmark_result.stats.instructions == _independent.last_stats.instructions


@nki.jit
def _many(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(a.shape[0] // 128):
        for j in nl.affine_range(a.shape[1] // 512):
            t = nl.load(a[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512])
            nl.store(out[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512], value=nl.exp(t))
    return out


def test_30k_instruction_kernel_times_in_seconds():
    bench = nki.benchmark(_many)
    t0 = time.perf_counter()
    bench(nt.tensor[[128 * 100, 512 * 100], nl.bfloat16])
    wall = time.perf_counter() - t0
    assert bench.benchmark_result.stats.instructions == 30_000
    assert wall < 10.0


def test_target_selection(monkeypatch):
    lat = {}
    for name in ("trn1", "trn2", "trn3"):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)
        monkeypatch.delenv("TORCHNEURON_TARGET", raising=False)
        _independent(torch.randn(128, 512))
        assert _independent.last_stats.target == name
        lat[name] = _independent.last_stats.latency_s
    assert len(set(lat.values())) == 3


def test_profile_writes_trace(tmp_path):
    prof = nki.profile(working_directory=str(tmp_path), save_trace_name="k.ntff")(_independent)
    prof(np.random.rand(128, 512).astype(np.float32))
    trace = json.loads((tmp_path / "k.json").read_text())["traceEvents"]
    assert {e["tid"] for e in trace} >= {"dma", "scalar", "vector"}
    assert any("test_simulator.py" in e["args"]["where"] for e in trace)
    summary = json.loads((tmp_path / "k_summary.json").read_text())
    assert summary["instructions"] == len(trace)


def _stream_kernel(rng):
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        for i in rng(a.shape[0] // 128):
            t = nl.load(a[i * 128:(i + 1) * 128, :])
            nl.store(out[i * 128:(i + 1) * 128, :], value=nl.exp(nl.exp(t)))
        return out
    return k


def test_sequential_range_keeps_iterations_in_order():
    lat = {}
    for rng in (nl.affine_range, nl.sequential_range):
        bench = nki.benchmark(_stream_kernel(rng))
        bench(nt.tensor[[1024, 2048], nl.float32])
        lat[rng.__name__] = bench.benchmark_result.nc_latency.get_latency_percentile(50)
    assert lat["affine_range"] < lat["sequential_range"]


@nki.jit
def _per_program(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    i = nl.program_id(0)
    nl.store(out[i * 128:(i + 1) * 128, :], value=nl.exp(nl.load(a[i * 128:(i + 1) * 128, :])))
    return out


def test_spmd_over_neuron_cores():
    a = torch.randn(512, 1024)
    one = _per_program[4](a)
    t_one = _per_program.last_stats.latency_s
    two = _per_program[nl.nc(4)](a)
    t_four = _per_program.last_stats.latency_s
    assert torch.allclose(one, a.exp()) and torch.allclose(two, a.exp())
    assert t_four < t_one  # instances spread over 4 cores run concurrently


def test_simulate_kernel_and_baremetal_forms():
    a = np.random.rand(128, 64).astype(np.float32)
    out = nki.simulate_kernel(_per_program[1], a)
    assert isinstance(out, np.ndarray) and np.allclose(out, np.exp(a), rtol=1e-6)
    assert np.allclose(nki.baremetal(_per_program.fn)(a), np.exp(a), rtol=1e-6)
    assert np.allclose(nki.simulate(_per_program)(a), np.exp(a), rtol=1e-6)


def test_access_index_grid_mode_matches_brute_force():
    import random
    from torchneuron.nki.scheduler import BoxIndex, _overlap
    rnd = random.Random(0)
    idx, entries = BoxIndex(), []
    for i in range(200):
        r, c = rnd.randrange(0, 16) * 128, rnd.randrange(0, 8) * 512
        box = ((r, r + 127), (c, c + 511 + (512 if i % 7 == 0 else 0)))
        end = rnd.random()
        idx.add(box, end)
        entries.append((box, end))
    assert idx.flat is None  # switched to the grid
    for _ in range(50):
        r = rnd.randrange(0, 2048)
        q = ((r, r + rnd.randrange(0, 300)), (rnd.randrange(0, 3000), 4095))
        want = max([e for b, e in entries if _overlap(q, b)], default=0.0)
        assert idx.latest(q, 0.0) == want
    assert idx.latest(None, 0.0) == max(e for _, e in entries)
