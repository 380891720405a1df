"""NKI simulator speed: a 2048x2048x2048 bf16 fully blocked matmul kernel, simulated with
values (every instruction executed on the host and scheduled), against torch.matmul of the
same size on the same host. Prints the machine, the wall times and the ratio against the host's
faster plain matmul, bf16 or fp32 (goal: within 5x): which one is faster depends on the CPU (AMX
hosts multiply bf16 faster than fp32; on an AMD EPYC host without AVX512-BF16 a bf16 2048^3 matmul
took 54.6 s, 480x the fp32 one), so a ratio against bf16 alone means nothing across hosts. Then the kernel's modeled latency, and the wall time of a timing-only run (typed
placeholders) of the tutorial-sized 8192x4096x8192 kernel.

    python bench/nki_sim.py [--size 2048] [--repeat 5]
"""
from __future__ import annotations

import argparse
import time

import torch

import torchneuron.nki as nki
import torchneuron.nki.language as nl
import torchneuron.nki.typing as nt
from torchneuron.kernels.matmul import matmul_fully_blocked

from machine import describe


def _best_interleaved(fns: list, repeat: int) -> list[float]:
    """Best wall time of each function, runs interleaved so that load from other processes
    on a shared host hits all of them alike."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = args.size
    print(f"machine: {describe()}")
    torch.manual_seed(0)
    a_t = torch.randn(n, n).bfloat16()
    b = torch.randn(n, n).bfloat16()
    a = a_t.T.contiguous()

    af, bf = a.float(), b.float()
    t_torch, t_fp32, t_sim = _best_interleaved(
        [lambda: torch.matmul(a, b), lambda: torch.matmul(af, bf), lambda: matmul_fully_blocked(a_t, b)],
        args.repeat)
    stats = matmul_fully_blocked.last_stats
    out = matmul_fully_blocked(a_t, b)
    err = (out.float() - torch.matmul(a.float(), b.float())).abs().max().item()
    print(f"torch.matmul {n}^3 bf16 (host):        {t_torch * 1e3:9.2f} ms")
    print(f"NKI simulation, fully blocked matmul:  {t_sim * 1e3:9.2f} ms  ({stats.instructions} instructions, "
          f"max |err| vs fp32 {err:.3g})")
    print(f"fp32 torch.matmul {n}^3 (host):        {t_fp32 * 1e3:9.2f} ms  (the simulator multiplies in "
          f"fp32: exact bf16 products, fp32 accumulation as in PSUM)")
    faster, t_base = min((("bf16", t_torch), ("fp32", t_fp32)), key=lambda kv: kv[1])
    print(f"ratio simulation / bf16 torch.matmul:  {t_sim / t_torch:9.2f}x")
    print(f"ratio simulation / fp32 torch.matmul:  {t_sim / t_fp32:9.2f}x")
    print(f"ratio simulation / host's faster ({faster}): {t_sim / t_base:6.2f}x  (goal <= 5x)")
    print(f"modeled latency on {stats.target}:               {stats.latency_us:9.1f} us  "
          f"(utilisation {', '.join(f'{k} {v:.0%}' for k, v in sorted(stats.utilisation.items()))})")

    bench = nki.benchmark(matmul_fully_blocked)
    t0 = time.perf_counter()
    bench(nt.tensor[[8192, 4096], nl.bfloat16], nt.tensor[[8192, 8192], nl.bfloat16])
    wall = time.perf_counter() - t0
    res = bench.benchmark_result
    print(f"timing-only 8192x4096x8192: {res.stats.instructions} instructions in {wall:.2f} s wall, "
          f"modeled p50 {res.nc_latency.get_latency_percentile(50):.0f} us")


if __name__ == "__main__":
    main()
