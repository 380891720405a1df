"""How much of AWS's NKI kernel library runs unmodified on the software NeuronCore.

Usage: python bench/nkilib_parity.py /path/to/nki-library [-k NAME]

Point it at a checkout of aws-neuron/nki-library kept OUTSIDE this repository (nothing of it
is committed here). Each case imports one kernel and its PyTorch reference from the checkout
as they are, builds small inputs, runs the kernel through `nki.simulate_kernel` with numpy
arrays (the numpy-in / numpy-out contract) and compares every output with the reference.
Collective kernels run as several ranks (`nki.simulate_ranks`), each with its own inputs.
Prints one line per kernel (ran + matched / mismatch / the first error) and the counts.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch


@dataclass
class Case:
    name: str
    kernel: str              # "module:function" inside nkilib
    reference: str | Callable  # "module:function" (returns a tensor, a tuple or {"output_0": ...})
    inputs: Callable[[np.random.Generator], dict]   # kernel keyword arguments (numpy arrays)
    ref_inputs: Callable[[dict], dict] | None = None  # reference kwargs from the kernel's
    atol: float = 2e-2
    rtol: float = 2e-2
    grid: tuple = ()
    kernel_kwargs: dict = field(default_factory=dict)
    # ranks > 0: a collective kernel, run as that many ranks (`nki.simulate_ranks`); `inputs`
    # returns one kwargs dict per rank, `reference` takes that list and gives every rank's
    # expected outputs (nki-library has no torch reference for them: AWS's tests build the
    # golden from the ranks' inputs, as this does)
    ranks: int = 0
    check: Callable[[list, list], None] | None = None  # replaces the element-wise comparison


def _bf16(a: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return a.astype(ml_dtypes.bfloat16)


def _to_torch(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        if v.dtype.name == "bfloat16":
            return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(v)
    return v


def _as_list(out: Any) -> list:
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def _f32(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().numpy()
    return np.asarray(x, dtype=np.float32)


def _topk_check(got: list, want: list) -> None:
    """Router top-K: logits and affinities element-wise; the chosen experts may differ only
    where their logits tie in the kernel's bf16 (the hardware picks the first of equal values)."""
    np.testing.assert_allclose(_f32(got[0]), _f32(want[0]), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(_f32(got[2]), _f32(want[2]), atol=2e-2, rtol=2e-2)
    logits = _f32(got[0])
    gi, wi = _f32(got[1]).astype(np.int64), _f32(want[1]).astype(np.int64)
    np.testing.assert_array_equal(np.take_along_axis(logits, gi, 1), np.take_along_axis(logits, wi, 1))


def _load(spec: str | Callable):
    if callable(spec):
        return spec
    mod, fn = spec.split(":")
    return getattr(importlib.import_module("nkilib." + mod), fn)


def _everyone(n: int) -> Any:
    from nki.collectives import ReplicaGroup  # the import alias serves it from torchneuron.nki
    return ReplicaGroup([list(range(n))])


def _same_elements_in_order(got: list, want: list) -> None:
    """The fine-grained all-gather returns the gathered rows in a [ranks, ...] layout of its
    own: compare in memory order."""
    np.testing.assert_array_equal(np.asarray(got[0]).reshape(-1), np.asarray(want[0]).reshape(-1))


def _cases() -> list[Case]:
    r = np.float32

    def fg_inputs(force_hbm: bool) -> Callable:
        return lambda g: [{"lhs": g.standard_normal((128, 256)).astype(r), "tp_degree": 4, "num_groups": 1,
                           "force_hbm_cc": force_hbm} for _ in range(4)]

    def attn_bwd_inputs(g, causal):
        from nkilib.core.attention.attention_bwd_torch import compute_o_lse
        b, h, d, s = 1, 2, 64, 256
        q, k, v, dy = (g.standard_normal((b, h, d, s)).astype(r) for _ in range(4))
        o, lse, _ = compute_o_lse(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), causal,
                                  False, softmax_scale=d ** -0.5)
        return {"q_ref": q, "k_ref": k, "v_ref": v, "o_ref": o.float().numpy(), "dy_ref": dy,
                "lse_ref": lse.float().numpy(), "use_causal_mask": causal, "softmax_scale": d ** -0.5}

    def ce_inputs(g):
        return {"logits_hbm": g.standard_normal((64, 2048)).astype(r),
                "targets_hbm": g.integers(0, 2048, size=(64,)).astype(np.int32), "dtype": np.float32,
                "chunk_size": 1024}

    def ce_bwd_inputs(g):
        from nkilib.experimental.loss.cross_entropy_torch import cross_entropy_forward_torch_ref
        kw = ce_inputs(g)
        _, lse = cross_entropy_forward_torch_ref(torch.from_numpy(kw["logits_hbm"]),
                                                 torch.from_numpy(kw["targets_hbm"]).long())
        kw["lse_state_hbm"] = lse.float().numpy()
        return kw

    def attn_cte(causal, sw=None):
        # (the sliding-window path takes scale 1: queries scaled down keep logits as for 1/8)
        return lambda g: {"q": (g.standard_normal((2, 256, 64)) * (0.125 if sw else 1)).astype(r),
                          "k": g.standard_normal((2, 64, 256)).astype(r),
                          "v": g.standard_normal((2, 256, 64)).astype(r), "scale": 1.0 if sw else 0.125,
                          "causal_mask": causal, "sliding_window": sw}

    def attn_cte_ref(kw):
        t = {k: _to_torch(v) for k, v in kw.items()}
        t["sliding_window"] = t["sliding_window"] or 0
        return t

    def ce_ref(kw):
        return {"logits": torch.from_numpy(kw["logits_hbm"]), "targets": torch.from_numpy(kw["targets_hbm"]).long()}

    def ce_bwd_ref(kw):
        return dict(ce_ref(kw), reduction="mean")

    def router_inputs(g):
        from nkilib.core.utils.common_types import RouterActFnType
        T, H, E, k = 128, 256, 16, 4
        return {"x": _bf16(g.standard_normal((H, T))), "w": _bf16(g.standard_normal((H, E)) * 0.1),
                "w_bias": None, "router_logits": _bf16(np.zeros((T, E))),
                "expert_affinities": _bf16(np.zeros((T, E))), "expert_index": np.zeros((T, k), np.uint32),
                "act_fn": RouterActFnType.SOFTMAX, "k": k, "x_hbm_layout": 0, "x_sb_layout": 0}

    def norm_inputs(g, beta=False):
        kw = {"input": g.standard_normal((1, 4, 2048)).astype(np.float16),
              "gamma": g.standard_normal((1, 2048)).astype(np.float16),
              "output": np.zeros((128, 4, 16), np.float16)}
        if beta:
            kw["beta"] = g.standard_normal((1, 2048)).astype(np.float16)
        return kw

    return [
        Case("rmsnorm_tkg", "core.subkernels.rmsnorm_tkg:rmsnorm_tkg",
             "core.subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref_lnc1", norm_inputs),
        Case("layernorm_tkg", "core.subkernels.layernorm_tkg:layernorm_tkg",
             "core.subkernels.layernorm_torch:layernorm_tkg_torch_ref_lnc1", lambda g: norm_inputs(g, True)),
        Case("router_topk", "core.router_topk.router_topk:router_topk",
             "core.router_topk.router_topk_torch:router_topk_torch_ref", router_inputs, check=_topk_check),
        Case("dynamic_elementwise_add", "experimental.dynamic_shapes.dynamic_elementwise_add:dynamic_elementwise_add",
             "experimental.dynamic_shapes.dynamic_elementwise_add_torch:dynamic_elementwise_add_torch_ref",
             lambda g: {"input_a": _bf16(g.standard_normal((256, 512))), "input_b": _bf16(g.standard_normal((256, 512))),
                        "num_m_tiles": np.array([[2]], np.int32)},
             lambda kw: {"input_a": _to_torch(kw["input_a"]).float(), "input_b": _to_torch(kw["input_b"]).float()}),
        Case("attention_cte", "core.attention.attention_cte:attention_cte",
             "core.attention.attention_cte_torch:attention_cte_torch_ref", attn_cte(False), attn_cte_ref),
        Case("attention_cte causal", "core.attention.attention_cte:attention_cte",
             "core.attention.attention_cte_torch:attention_cte_torch_ref", attn_cte(True), attn_cte_ref),
        Case("attention_cte sliding", "core.attention.attention_cte:attention_cte",
             "core.attention.attention_cte_torch:attention_cte_torch_ref", attn_cte(True, 64), attn_cte_ref),
        Case("attention_bwd", "core.attention.attention_bwd:attention_bwd",
             "core.attention.attention_bwd_torch:attention_bwd_torch_ref", lambda g: attn_bwd_inputs(g, False)),
        Case("attention_bwd causal", "core.attention.attention_bwd:attention_bwd",
             "core.attention.attention_bwd_torch:attention_bwd_torch_ref", lambda g: attn_bwd_inputs(g, True)),
        Case("cascaded_max", "core.max.cascaded_max:cascaded_max", "core.max.cascaded_max_torch:cascaded_max_torch_ref",
             lambda g: {"input_tensor": g.standard_normal((2, 4, 1024)).astype(r)}),
        Case("rope", "core.embeddings.rope:RoPE", "core.embeddings.rope_torch:rope_torch_ref",
             lambda g: {"x_in": g.standard_normal((64, 1, 2, 128)).astype(r),
                        "cos": g.standard_normal((32, 1, 128)).astype(r),
                        "sin": g.standard_normal((32, 1, 128)).astype(r)}),
        Case("cross_entropy_forward", "experimental.loss.cross_entropy:cross_entropy_forward",
             "experimental.loss.cross_entropy_torch:cross_entropy_forward_torch_ref", ce_inputs, ce_ref),
        Case("cross_entropy_backward", "experimental.loss.cross_entropy:cross_entropy_backward",
             "experimental.loss.cross_entropy_torch:cross_entropy_backward_torch_ref", ce_bwd_inputs, ce_bwd_ref),
        Case("cumsum", "core.cumsum.cumsum:cumsum", "core.cumsum.cumsum_torch:cumsum_torch_ref",
             lambda g: {"x": g.standard_normal((130, 300)).astype(r)}, atol=1e-3, rtol=1e-3),
        Case("allgather_sb2sb 4 ranks", "experimental.collectives.sb2sb_allgather:allgather_sb2sb",
             lambda per_rank: np.concatenate([p["inp"] for p in per_rank], 1),
             lambda g: [{"inp": g.standard_normal((128, 64)).astype(r), "replica_groups": _everyone(4),
                         "tp_degree": 4} for _ in range(4)], ranks=4, atol=0, rtol=0),
        Case("fine_grained_allgather sbuf", "experimental.collectives.fg_allgather:fine_grained_allgather",
             lambda per_rank: np.concatenate([p["lhs"] for p in per_rank]), fg_inputs(False), ranks=4,
             check=_same_elements_in_order, atol=0, rtol=0),
        Case("fine_grained_allgather hbm", "experimental.collectives.fg_allgather:fine_grained_allgather",
             lambda per_rank: np.concatenate([p["lhs"] for p in per_rank]), fg_inputs(True), ranks=4,
             check=_same_elements_in_order, atol=0, rtol=0),
    ]


def _check_ranks(case: Case, outs: list, want: list) -> None:
    for rank, out in enumerate(outs):
        got = _as_list(out)
        if case.check:
            case.check(got, want)
            continue
        for a, b in zip(got, want):
            np.testing.assert_allclose(_f32(a), _f32(b), atol=case.atol, rtol=case.rtol,
                                       err_msg=f"rank {rank}")


def run(root: str, only: str | None = None) -> tuple[int, int]:
    import torchneuron.nki as nki
    nki.install_import_alias()
    sys.path.insert(0, f"{root}/src/nkilib_src")
    sys.path.insert(0, root)  # references import test utilities
    passed = total = 0
    for case in _cases():
        if only and only not in case.name:
            continue
        total += 1
        t0 = time.perf_counter()
        try:
            kernel = _load(case.kernel)
            ref = _load(case.reference)
            g = np.random.default_rng(0)
            kw = case.inputs(g)
            if case.ranks:
                _check_ranks(case, nki.simulate_ranks(kernel, kw), _as_list(ref(kw)))
                passed += 1
                print(f"{case.name:28s} {time.perf_counter() - t0:6.1f}s  matched on every rank", flush=True)
                continue
            k = kernel[case.grid] if case.grid else kernel
            out = nki.simulate_kernel(k, **kw, **case.kernel_kwargs)
            rkw = case.ref_inputs(kw) if case.ref_inputs else {k: _to_torch(v) for k, v in kw.items()}
            want = _as_list(ref(**rkw))
            got = _as_list(out)
            for i, a in enumerate(got):
                if not isinstance(a, np.ndarray):
                    raise AssertionError(f"output {i} is {type(a).__name__}, not a numpy array")
            if case.check:
                case.check(got, want)
            for i, (a, b) in enumerate(zip(got, want)):
                if not case.check:
                    np.testing.assert_allclose(_f32(a), _f32(b), atol=case.atol, rtol=case.rtol)
            status = "matched"
            passed += 1
        except AssertionError as e:
            status = "MISMATCH " + str(e).strip().splitlines()[0][:160]
        except Exception as e:  # noqa: BLE001 - report the first failure per kernel
            tb = traceback.extract_tb(e.__traceback__)[-1]
            status = f"ERROR {type(e).__name__}: {str(e)[:200]} ({tb.filename.split('/')[-1]}:{tb.lineno})"
        print(f"{case.name:28s} {time.perf_counter() - t0:6.1f}s  {status}", flush=True)
    print(f"{passed} of {total} kernels ran unmodified and matched their references")
    return passed, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="checkout of aws-neuron/nki-library (outside this repository)")
    ap.add_argument("-k", default=None, help="only cases whose name contains this")
    a = ap.parse_args()
    run(a.root, a.k)


if __name__ == "__main__":
    main()
