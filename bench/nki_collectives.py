"""nki.collectives on the modeled NeuronCores: what each collective adds to a kernel's latency,
as % of the ring's bandwidth roofline, against a baseline measured in the same run.

Each case runs one kernel over n programs (ranks): copy this rank's input to an HBM buffer, run
the collective on it, copy the result out. The baseline is the same kernel with the collective
replaced by a local HBM copy of the same bytes. Columns: kernel latency; the collective's part
(latency - baseline); roofline % = the bytes each rank must send (ring: all-reduce 2(n-1)/n of
the buffer, the others (n-1)/n) at the per-rank ring bandwidth, over the collective's part (the
rest is the ring's per-step latency and the wait for the slowest rank).

    python bench/nki_collectives.py [--target trn2] [--ranks 2 4] [--kib 256 4096]
"""
from __future__ import annotations

import argparse

import numpy as np

import torchneuron.nki as nki
import torchneuron.nki.collectives as ncc
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.hardware.model import collective_link_bytes_per_s
from torchneuron.hardware.targets import TARGETS

COLS = 512  # fp32 elements a row


def _call(kind: str, n: int):
    group = ncc.ReplicaGroup([list(range(n))])
    return {
        "all_reduce": (lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=group, op=nl.add), 1, 2.0),
        "all_gather": (lambda s, d: ncc.all_gather(srcs=[s], dsts=[d], replica_group=group, collective_dim=0), n, 1.0),
        "reduce_scatter": (lambda s, d: ncc.reduce_scatter(srcs=[s], dsts=[d], replica_group=group,
                                                           collective_dim=0, op=nl.add), 1 / n, 1.0),
        "all_to_all": (lambda s, d: ncc.all_to_all(srcs=[s], dsts=[d], replica_group=group, collective_dim=0), 1, 1.0),
    }[kind]


def _latency_s(kind: str, n: int, rows: int, target: str, baseline: bool = False) -> float:
    """The kernel's modeled latency; `baseline`: the same kernel without the collective."""
    call, out_scale, _ = _call(kind, n)
    if baseline:
        call = lambda s, d: None  # noqa: E731
    out_rows = int(rows * out_scale)

    @nki.jit(platform_target=target)
    def kernel(x):
        r = nl.program_id(0)
        src = nl.ndarray((rows, COLS), dtype=x.dtype, buffer=nl.private_hbm)
        nisa.dma_copy(dst=src, src=x[r])
        dst = nl.ndarray((out_rows, COLS), dtype=x.dtype, buffer=nl.private_hbm)
        call(src, dst)
        out = nl.ndarray((n, out_rows, COLS), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[r], src=dst)
        return out

    k = kernel[nl.nc(n)]  # one rank per NeuronCore, with or without the collective
    k(np.ones((n, rows, COLS), dtype=np.float32))
    return k.last_stats.latency_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="trn2", choices=list(TARGETS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--kib", type=int, nargs="+", default=[256, 4096], help="each rank's buffer")
    args = ap.parse_args()
    target = TARGETS[args.target]
    print(f"target {args.target}; fp32 buffers of {COLS} columns; latencies in us")
    print(f"{'collective':<15}{'ranks':>6}{'KiB':>7}{'kernel':>10}{'baseline':>10}{'collective':>12}{'roofline %':>12}")
    for n in args.ranks:
        for kib in args.kib:
            rows = max(n, kib * 1024 // (4 * COLS) // n * n)
            for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                base = _latency_s(kind, n, rows, args.target, baseline=True)
                lat = _latency_s(kind, n, rows, args.target)
                _, out_scale, passes = _call(kind, n)
                buffer = rows * COLS * 4 * (n if kind == "all_gather" else 1)  # the ring model's nbytes
                bound = (passes if kind == "all_reduce" else 1.0) * (n - 1) / n * buffer \
                    / collective_link_bytes_per_s(target, n)
                part = lat - base
                print(f"{kind:<15}{n:>6}{rows * COLS * 4 // 1024:>7}{lat * 1e6:>10.1f}{base * 1e6:>10.1f}"
                      f"{part * 1e6:>12.1f}{100 * bound / part if part > 0 else float('nan'):>12.1f}")


if __name__ == "__main__":
    main()
