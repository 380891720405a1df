"""NKI-lib kernels on the modeled NeuronCore: % of the target's roofline and the ratio to the
performance model's formula for the same work (the price eager ops had before the kernels
priced them), both measured in this run.

Timing-only simulations (typed placeholders): attention forward and backward at 8K x 128
bf16 (one head; forward also causal and at d = 64), decode attention at batch 32 x context 4K in vLLM's paged KV-cache layout
through a block table (Llama-8B-like heads: 32 query, 8 key/value, d 128, blocks of 128 and of
256 keys), the MoE blockwise grouped matmul (8 blocks of 512 tokens, 4096 x 2048 expert
weights), and the fp8 scaled matmul (row-wise scales, bf16 out) at 4096 x 4096 x 4096 beside
the bf16 `matmul_fully_blocked` kernel of the same size (--mnk).

Columns: modeled latency; Tensor-engine busy % (its instructions' time over the latency,
PE transposes included); useful % (the op's matmul FLOPs at the bf16 peak over the latency);
HBM % (the bytes the op must move at the core's HBM bandwidth over the latency); formula /
kernel (the formula's time over the kernel's). The fp8 row prints instead its % of the
target's FP8 roofline (the op's FLOPs at `peak_flops(float8_e4m3fn)`) and bf16 kernel / fp8
kernel, the speedup over the bf16 matmul kernel row above it.

    python bench/nki_kernels.py [--target trn2] [--seq 8192] [--batch 32 --ctx 4096] [--mnk 4096] [--rows attention]

`--rows` keeps the rows whose name contains one of the given words (e.g. `attention`, `bwd`,
`decode`, `MoE`, `matmul`).
"""
from __future__ import annotations

import argparse
import time

import torch

import torchneuron.nki.typing as nt
from torchneuron.hardware import model
from torchneuron.hardware.targets import TARGETS
from torchneuron.kernels import decode_attention as da
from torchneuron.kernels import flash_attention as fa
from torchneuron.kernels import fp8_matmul, matmul, moe

from machine import describe

BF16 = torch.bfloat16


def _row(name: str, stats, useful_flops: float, hbm_bytes: float, formula_s: float, target) -> None:
    if stats is None:
        return
    lat = stats.latency_s
    te = stats.engine_busy_s.get("tensor", 0.0) / lat
    useful = useful_flops / (target.peak_flops(BF16) * lat)
    hbm = hbm_bytes / (target.hbm_bytes_per_s * lat)
    print(f"{name:34s} {lat * 1e6:10.1f} us  TE busy {te:6.1%}  useful {useful:6.1%}  HBM {hbm:6.1%}  "
          f"formula/kernel {formula_s / lat:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="trn2", choices=sorted(TARGETS))
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--mnk", type=int, default=4096, help="M = K = N of the matmul rows")
    ap.add_argument("--rows", nargs="*", default=None, help="run only rows whose name contains one of these")
    a = ap.parse_args()

    def wanted(name: str) -> bool:
        return a.rows is None or any(w.lower() in name.lower() for w in a.rows)

    def run(name: str, kernel, args: tuple, kwargs: dict):
        """The kernel's timing-only stats, or None when the row is not wanted."""
        return kernel.run(args, kwargs, target=target)[1] if wanted(name) else None
    target = TARGETS[a.target]
    print(describe())
    print(f"target {target.name}; timing-only simulations")
    t0 = time.perf_counter()
    s, d = a.seq, 128
    q = nt.tensor[(1, s, d), BF16]
    sig = (BF16, (1, 1, s, d))
    model.register_kernel_pricer("attention", None)  # the formula, for the ratio
    f_fwd = model.op_cost("aten::_scaled_dot_product_flash_attention_for_cpu", [sig] * 3, [sig], target)
    f_bwd = model.op_cost("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [sig] * 5, [sig] * 3, target)
    from torchneuron.kernels import pricing
    pricing.install()
    name = f"attention fwd {s}x{d} bf16"
    _row(name, run(name, fa.attention_fwd[1], (q, q, q), {"scale": d ** -0.5}), fa.flops(1, s, s, d, False),
         4 * s * d * 2, f_fwd.duration_s, target)
    lse = nt.tensor[(1, s, 1), torch.float32]
    name = f"attention bwd {s}x{d} bf16"
    _row(name, run(name, fa.attention_bwd[1], (q, q, q, q, q, lse), {"scale": d ** -0.5}),
         fa.flops(1, s, s, d, False, backward=True), 8 * s * d * 2, f_bwd.duration_s, target)
    name = f"attention fwd {s}x{d} causal"
    _row(name, run(name, fa.attention_fwd[1], (q, q, q), {"scale": d ** -0.5, "causal": True}),
         fa.flops(1, s, s, d, True), 4 * s * d * 2, f_fwd.duration_s, target)
    d64, sig64 = 64, (BF16, (1, 1, s, 64))
    f64 = model.op_cost("aten::_scaled_dot_product_flash_attention_for_cpu", [sig64] * 3, [sig64], target)
    q64 = nt.tensor[(1, s, d64), BF16]
    name = f"attention fwd {s}x{d64} bf16"
    _row(name, run(name, fa.attention_fwd[1], (q64, q64, q64), {"scale": d64 ** -0.5}), fa.flops(1, s, s, d64, False),
         4 * s * d64 * 2, f64.duration_s, target)

    b, ctx, hq, hk = a.batch, a.ctx, 32, 8
    for bs in (128, 256):  # vLLM's block size: a (block, head) K^T slab of 32 KB, then 64 KB
        maxb = ctx // bs
        args = (nt.tensor[(b, 1, hq, d), BF16], nt.tensor[(b * maxb, hk, 2 * bs, d), BF16],  # vLLM's paged layout
                nt.tensor[(b, maxb), torch.int32], nt.tensor[(b, 1), torch.int32])
        name = f"decode attention {b}x{ctx} block {bs}"
        st = run(name, da.decode_attention[b], args, {"scale": d ** -0.5})
        formula = model.paged_attention_cost([1] * b, [ctx] * b, heads=hq, kv_heads=hk, head_size=d, dtype=BF16,
                                             block_size=bs, target=target)
        _row(name, st, 4.0 * b * hq * ctx * d, da.cache_bytes(b, ctx, hk, d),
             formula.duration_s, target)

    nb, kdim, n, e = 8, 4096, 2048, 8
    args = (nt.tensor[(nb * moe.BT, kdim), BF16], nt.tensor[(e, kdim, n), BF16], nt.tensor[(nb, 1), torch.int32])
    name = f"MoE grouped matmul {nb}x{moe.BT}x{kdim}x{n}"
    st = run(name, moe.grouped_matmul, args, {})
    mm = model.op_cost("aten::bmm", [(BF16, (nb, moe.BT, kdim)), (BF16, (nb, kdim, n))], [(BF16, (nb, moe.BT, n))],
                       target)
    _row(name, st, moe.grouped_flops(nb, kdim, n),
         (nb * moe.BT * (kdim + n) + nb * kdim * n) * 2, mm.duration_s, target)
    s3 = a.mnk
    fp8 = torch.float8_e4m3fn
    name = f"bf16 matmul {s3}^3 fully blocked"
    bf16_st = run(name, matmul.matmul_fully_blocked, (nt.tensor[(s3, s3), BF16], nt.tensor[(s3, s3), BF16]), {})
    mm = model.op_cost("aten::mm", [(BF16, (s3, s3)), (BF16, (s3, s3))], [(BF16, (s3, s3))], target)
    _row(name, bf16_st, fp8_matmul.flops(s3, s3, s3), 3 * s3 * s3 * 2, mm.duration_s, target)
    name = f"fp8 scaled matmul {s3}^3 row-wise"
    args = (nt.tensor[(s3, s3), fp8], nt.tensor[(s3, s3), fp8], nt.tensor[(s3, 1), torch.float32],
            nt.tensor[(1, s3), torch.float32])
    st = run(name, fp8_matmul.scaled_matmul, args, {})
    if st is not None and bf16_st is not None:
        lat = st.latency_s
        print(f"{name:34s} {lat * 1e6:10.1f} us  TE busy {st.engine_busy_s.get('tensor', 0.0) / lat:6.1%}  "
              f"FP8 roofline {fp8_matmul.flops(s3, s3, s3) / (target.peak_flops(fp8) * lat):6.1%}  "
              f"bf16 kernel/fp8 kernel {bf16_st.latency_s / lat:5.2f}x")
    print(f"(simulated in {time.perf_counter() - t0:.1f} s of host time)")


if __name__ == "__main__":
    main()
