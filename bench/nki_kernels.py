"""NKI-lib kernels on the modeled NeuronCore: % of the target's roofline and the ratio to the
performance model's formula for the same work (the price eager ops had before the kernels
priced them), both measured in this run.

Timing-only simulations (typed placeholders): attention forward and backward at 8K x 128
bf16 (one head; forward also causal and at d = 64), decode attention at batch 32 x context 4K in vLLM's paged KV-cache layout
through a block table (Llama-8B-like heads: 32 query, 8 key/value, d 128, blocks of 128 and of
256 keys), the MoE blockwise grouped matmul (8 blocks of 512 tokens, 4096 x 2048 expert
weights), the fp8 scaled matmul (row-wise scales, bf16 out) at 4096 x 4096 x 4096 beside
the bf16 `matmul_fully_blocked` kernel of the same size (--mnk), RoPE at 32 heads x 4096 x 128, cross-entropy at 4096 tokens x hidden 2048 x vocabulary
32000 (fused with the lm_head, bf16; and over given fp32 logits), RMSNorm fused with the QKV
projection at 4096 tokens x 4096 -> 6144 and Llama's SwiGLU MLP at 4096 x 4096 -> 14336 (--mlp
tokens hidden intermediate; bf16, forward and backward), each against the eager ops they replace.

Then a tiny Llama training step compiled for neuron with the RoPE / cross-entropy substitutions
on and off (TORCHNEURON_COMPILE_ROPE_CE_KERNELS): modeled trn2 step time and host time, ratios.

Columns: modeled latency; Tensor-engine busy % (its instructions' time over the latency,
PE transposes included); useful % (the op's matmul FLOPs at the bf16 peak over the latency);
HBM % (the bytes the op must move at the core's HBM bandwidth over the latency); formula /
kernel (the formula's time over the kernel's). The fp8 row prints instead its % of the
target's FP8 roofline (the op's FLOPs at `peak_flops(float8_e4m3fn)`) and bf16 kernel / fp8
kernel, the speedup over the bf16 matmul kernel row above it.

    python bench/nki_kernels.py [--target trn2] [--seq 8192] [--batch 32 --ctx 4096] [--mnk 4096] [--rows attention]
                                [--qkv 4096 4096 6144] [--mlp 4096 4096 14336] [--llama-steps 5]

`--rows` keeps the rows whose name contains one of the given words (e.g. `attention`, `bwd`,
`decode`, `MoE`, `matmul`, `RMSNorm`, `SwiGLU`); `--llama-steps 0` skips the tiny Llama.
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
from torchneuron.kernels import cross_entropy as ce
from torchneuron.kernels import norm_mlp as nm
from torchneuron.kernels import rope as rp

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
    ap.add_argument("--qkv", type=int, nargs=3, default=(4096, 4096, 6144), help="RMSNorm + linear: T D N")
    ap.add_argument("--mlp", type=int, nargs=3, default=(4096, 4096, 14336), help="SwiGLU: T D F")
    ap.add_argument("--llama-steps", type=int, default=5, help="timed steps of the tiny Llama, per setting")
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
    if wanted("RoPE CE"):
        _rope_ce_rows(target)
    _norm_mlp_rows(target, run, *a.qkv, *a.mlp)
    print(f"(simulated in {time.perf_counter() - t0:.1f} s of host time)")
    if a.llama_steps > 0:
        _tiny_llama_step(a.llama_steps)


def _eager_seconds(ops: list[tuple[str, list, list]], target) -> float:
    """What the eager ops a kernel replaces cost by the performance model, launches included."""
    return sum(model.op_cost(op, ins, outs, target).duration_s + model.launch_cost(target) for op, ins, outs in ops)


def _rope_ce_rows(target) -> None:
    n, s, d = 32, 4096, 128
    x, table = (BF16, (1, n, s, d)), (BF16, (1, 1, s, d))
    half = (BF16, (1, n, s, d // 2))
    args = (nt.tensor[(n, s, d), BF16], nt.tensor[(1, s, d), BF16], nt.tensor[(1, s, d), BF16])
    _, st = rp.rope.run(args, {}, target=target)
    eager = _eager_seconds([("aten::mul.Tensor", [x, table], [x]), ("aten::neg", [half], [half]),
                            ("aten::cat", [half, half], [x]), ("aten::mul.Tensor", [x, table], [x]),
                            ("aten::add.Tensor", [x, x], [x])], target)
    _row(f"RoPE {n}x{s}x{d} bf16", st, 0.0, rp.hbm_bytes(n, s, d, 1, 2), eager, target)
    t, hid, v = 4096, 2048, 32000
    h, w, logits = (BF16, (t, hid)), (BF16, (v, hid)), (torch.float32, (t, v))
    labels, per_token = (torch.int64, (t,)), (torch.float32, ())
    ce_fwd = [("aten::_log_softmax", [logits], [logits]), ("aten::nll_loss_forward", [logits, labels], [per_token])]
    ce_bwd = [("aten::nll_loss_backward", [per_token, logits, labels], [logits]),
              ("aten::_log_softmax_backward_data", [logits, logits], [logits])]
    head = [("aten::mm", [h, (BF16, (hid, v))], [(BF16, (t, v))]), ("aten::_to_copy", [(BF16, (t, v))], [logits])]
    head_bwd = [("aten::mm", [logits, w], [h]), ("aten::mm", [(torch.float32, (v, t)), h], [w])]
    ce_args = (nt.tensor[(t, hid), BF16], nt.tensor[(v, hid), BF16], nt.tensor[(t, 1), torch.int32])
    grad_args = (nt.tensor[(t, 1), torch.float32],) * 2
    _, st = ce.linear_ce_fwd.run(ce_args, {}, target=target)
    _row(f"linear CE fwd {t}x{hid}x{v} bf16", st, ce.flops(t, hid, v), ce.hbm_bytes(t, hid, v, 2),
         _eager_seconds(head + ce_fwd, target), target)
    _, st = ce.linear_ce_bwd.run(ce_args + grad_args, {}, target=target)
    _row(f"linear CE bwd {t}x{hid}x{v} bf16", st, ce.flops(t, hid, v, backward=True),
         ce.hbm_bytes(t, hid, v, 2, backward=True), _eager_seconds(ce_bwd + head_bwd, target), target)
    logit_args = (nt.tensor[(t, v), torch.float32], nt.tensor[(t, 1), torch.int32])
    _, st = ce.ce_fwd.run(logit_args, {}, target=target)
    _row(f"CE fwd over {t}x{v} fp32 logits", st, 0.0, t * v * 4, _eager_seconds(ce_fwd, target), target)
    _, st = ce.ce_bwd.run(logit_args + grad_args, {}, target=target)
    _row(f"CE bwd over {t}x{v} fp32 logits", st, 0.0, 2 * t * v * 4, _eager_seconds(ce_bwd, target), target)


def _norm_mlp_rows(target, run, t: int, d: int, n: int, mt: int, md: int, f: int) -> None:
    """RMSNorm + QKV projection [t, d] -> [t, n] and the SwiGLU MLP [mt, md] -> F = f -> [mt, md], bf16,
    against the eager ops of transformers' LlamaRMSNorm + nn.Linear and LlamaMLP."""
    x, x32, col32, w = (BF16, (t, d)), (torch.float32, (t, d)), (torch.float32, (t, 1)), (BF16, (n, d))
    y, wn = (BF16, (t, n)), (BF16, (d,))
    norm = [("aten::_to_copy", [x], [x32]), ("aten::pow.Tensor_Scalar", [x32], [x32]),
            ("aten::mean.dim", [x32], [col32]), ("aten::add.Scalar", [col32], [col32]),
            ("aten::rsqrt", [col32], [col32]), ("aten::mul.Tensor", [x32, col32], [x32]),
            ("aten::_to_copy", [x32], [x]), ("aten::mul.Tensor", [wn, x], [x])]
    args = (nt.tensor[(t, d), BF16], nt.tensor[(1, d), BF16], nt.tensor[(n, d), BF16])
    name = f"RMSNorm+QKV fwd {t}x{d}->{n} bf16"
    _row(name, run(name, nm.rmsnorm_linear_fwd, args, {}), nm.rmsnorm_linear_flops(t, d, n),
         nm.rmsnorm_linear_bytes(t, d, n, 2), _eager_seconds(norm + [("aten::mm", [x, (BF16, (d, n))], [y])], target),
         target)
    norm_bwd = [("aten::mul.Tensor", [x, x], [x]), ("aten::sum.dim_IntList", [x], [wn]),
                ("aten::mul.Tensor", [x, wn], [x]), ("aten::_to_copy", [x], [x32]),
                ("aten::mul.Tensor", [x32, col32], [x32]), ("aten::mul.Tensor", [x32, x32], [x32]),
                ("aten::sum.dim_IntList", [x32], [col32]), ("aten::mul.Tensor", [x32, col32], [x32]),
                ("aten::add.Tensor", [x32, x32], [x32]), ("aten::_to_copy", [x32], [x])]
    mm_bwd = [("aten::mm", [y, w], [x]), ("aten::mm", [(BF16, (n, t)), x], [w])]
    name = f"RMSNorm+QKV bwd {t}x{d}->{n} bf16"
    _row(name, run(name, nm.rmsnorm_linear_bwd, args + (nt.tensor[(t, 1), torch.float32], nt.tensor[(t, n), BF16]), {}),
         nm.rmsnorm_linear_flops(t, d, n, backward=True), nm.rmsnorm_linear_bytes(t, d, n, 2, backward=True),
         _eager_seconds(mm_bwd + norm_bwd, target), target)
    xm, h, wd = (BF16, (mt, md)), (BF16, (mt, f)), (BF16, (md, f))
    mlp = [("aten::mm", [xm, (BF16, (md, f))], [h])] * 2 + [("aten::silu", [h], [h]), ("aten::mul.Tensor", [h, h], [h]),
                                                           ("aten::mm", [h, (BF16, (f, md))], [xm])]
    args = (nt.tensor[(mt, md), BF16], nt.tensor[(f, md), BF16], nt.tensor[(f, md), BF16], nt.tensor[(md, f), BF16])
    name = f"SwiGLU fwd {mt}x{md}->{f} bf16"
    _row(name, run(name, nm.swiglu_fwd, args, {}), nm.swiglu_flops(mt, md, f), nm.swiglu_bytes(mt, md, f, 2),
         _eager_seconds(mlp, target), target)
    # eager backward: gate and up saved, not recomputed; dh, dg, du elementwise, five matmuls
    mlp_bwd = [("aten::mm", [xm, wd], [h]), ("aten::mm", [(BF16, (md, mt)), h], [wd]),
               ("aten::mul.Tensor", [h, h], [h]), ("aten::mul.Tensor", [h, h], [h]),
               ("aten::silu_backward", [h, h], [h])] + [("aten::mm", [h, (BF16, (f, md))], [xm]),
                                                        ("aten::mm", [(BF16, (f, mt)), xm], [(BF16, (f, md))])] * 2 \
        + [("aten::add.Tensor", [xm, xm], [xm])]
    name = f"SwiGLU bwd {mt}x{md}->{f} bf16"
    _row(name, run(name, nm.swiglu_bwd, args + (nt.tensor[(mt, md), BF16],), {}),
         nm.swiglu_flops(mt, md, f, backward=True), nm.swiglu_bytes(mt, md, f, 2, backward=True),
         _eager_seconds(mlp_bwd, target), target)


def _tiny_llama_step(steps: int) -> None:
    """A compiled tiny Llama training step (4 x 128 tokens: the kernels' tiles) with the RoPE /
    cross-entropy substitutions on and off: modeled trn2 device time and host time per step."""
    import copy
    import os
    import statistics

    import transformers

    from torchneuron.hardware import estimate

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=8192,
                                      max_position_embeddings=256)
    base = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (4, 128)).to("neuron")

    def compiled(enabled: bool):
        os.environ["TORCHNEURON_COMPILE_ROPE_CE_KERNELS"] = "1" if enabled else "0"
        torch._dynamo.reset()
        model = copy.deepcopy(base).to("neuron")
        model.tie_weights()
        forward = torch.compile(model, backend="neuron")

        def step() -> torch.Tensor:
            loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss
        for _ in range(2):  # compilation, then a warm step
            step().item()
        with estimate("trn2") as est:
            step().item()
        return step, est.device_time_s

    (step_on, device_on), (step_off, device_off) = compiled(True), compiled(False)
    os.environ.pop("TORCHNEURON_COMPILE_ROPE_CE_KERNELS")
    host = {True: [], False: []}
    for _ in range(steps):  # interleaved rounds
        for enabled, step in ((True, step_on), (False, step_off)):
            start = time.perf_counter()
            step().item()
            host[enabled].append(time.perf_counter() - start)
    on, off = statistics.median(host[True]), statistics.median(host[False])
    print("tiny Llama training step compiled (hidden 256, 2 layers, vocab 8192, 4 x 128 tokens), trn2:")
    print(f"  modeled device step: substitutions on {device_on * 1e6:8.1f} us, off {device_off * 1e6:8.1f} us, "
          f"off / on {device_off / device_on:5.2f}x")
    print(f"  host time per step:  on {on * 1e3:8.1f} ms, off {off * 1e3:8.1f} ms, on / off {on / off:5.2f}x "
          f"(goal <= 1.05x; medians of {steps})")


if __name__ == "__main__":
    main()
