"""Which aten ops the NeuronCore runs natively and which fall back to the host CPU.

Every op executes on the host in this software device, but the *policy* decides what the
modeled Trainium does: an op listed here (or any op on float64/complex data, which the hardware
lacks, but for the float64 elementwise arithmetic the engines emulate) is a CPU fallback: it is counted, warned about once, charged as a host round trip on the
device timeline, and refused in strict mode (TORCHNEURON_STRICT=1 or set_strict(True)).
The C++ fallback asks `fallback_policy` once per operator.
"""
from __future__ import annotations

import fnmatch
import warnings

import torch

from torchneuron.hardware.model import DATA_MOVEMENT_OPS as _MOVEMENT, FP64_EMULATED_OPS, FP64_SELECTION_OPS
from torchneuron.runtime import _C
from torchneuron.runtime.extension import runtime_ops

# The policy bits, defined once in C++ (csrc/neuron.h: OpPolicy):
HOST_ONLY = _C.OP_POLICY["HOST_ONLY"]          # no NeuronCore implementation: runs on the host CPU
IMPLICIT_RNG = _C.OP_POLICY["IMPLICIT_RNG"]    # the CPU kernel draws from the default generator without an argument
MIXED_DEVICES = _C.OP_POLICY["MIXED_DEVICES"]  # accepts CPU tensors beside neuron ones (as CUDA does for these ops)
DATA_MOVEMENT = _C.OP_POLICY["DATA_MOVEMENT"]  # moves bytes only: any dtype is native (no FP64 arithmetic involved)
# float64 (not complex) the engines handle: emulated elementwise arithmetic, selections (hardware.model)
FP64_EMULATED = _C.OP_POLICY["FP64_EMULATED"]

# Ops with no NeuronCore implementation in the real stack: dense linear-algebra factorisations,
# FFTs, sorting-based data-dependent output shapes (unique) and host-side sampling/statistics.
# nonzero/masked_select (so boolean-mask indexing and argwhere) are native: a compaction kernel
# (a prefix sum of the mask, then a scatter of the selected elements) whose output size the host
# reads back, as CUDA's nonzero syncs (hardware.model prices both).
HOST_ONLY_PATTERNS: tuple[str, ...] = (
    "aten::linalg_cholesky*", "aten::linalg_eig*", "aten::linalg_svd*", "aten::_linalg_svd*",
    "aten::linalg_qr*", "aten::linalg_lu*", "aten::linalg_solve*", "aten::_linalg_solve*",
    "aten::linalg_inv*", "aten::linalg_lstsq*", "aten::linalg_householder_product*", "aten::linalg_ldl*",
    "aten::_linalg_eigh*", "aten::_linalg_det*", "aten::_linalg_slogdet*", "aten::linalg_matrix_exp*",
    "aten::_linalg_eigvals*", "aten::linalg_pinv*", "aten::cholesky*", "aten::geqrf*", "aten::ormqr*",
    "aten::triangular_solve*", "aten::linalg_solve_triangular*", "aten::lu_unpack*", "aten::_lu_with_info*",
    "aten::_fft_*", "aten::fft_*", "aten::stft*", "aten::istft*",
    "aten::_unique*", "aten::unique_*",
    "aten::histogram*", "aten::_histogramdd*", "aten::multinomial*", "aten::kthvalue*",
    "aten::median*", "aten::nanmedian*", "aten::mode*", "aten::_cdist_backward*", "aten::searchsorted*",
    "aten::bucketize*", "aten::_cholesky_solve_helper*", "aten::cholesky_inverse*", "aten::polygamma*",
    "aten::special_*", "aten::_standard_gamma*", "aten::_sample_dirichlet*", "aten::poisson*",
    "aten::_segment_reduce*", "aten::_embedding_bag*", "aten::_ctc_loss*", "aten::unique_consecutive*",
)
IMPLICIT_RNG_OPS = frozenset({"aten::native_dropout", "aten::_fused_dropout", "aten::rrelu_with_noise_functional"})
MIXED_DEVICE_OPS = frozenset({
    "aten::index.Tensor", "aten::index.Tensor_out", "aten::index_put_", "aten::index_put",
    "aten::_index_put_impl_", "aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize",
    "aten::set_.source_Tensor", "aten::_has_compatible_shallow_copy_type", "aten::lift_fresh",
    "aten::_local_scalar_dense", "aten::equal",
})


DATA_MOVEMENT_OPS = frozenset(f"aten::{name}{suffix}" for name in _MOVEMENT for suffix in ("", "_"))


def fallback_policy(name: str) -> int:
    """Policy bits for one overload name such as 'aten::linalg_svd' or 'aten::add.Tensor'."""
    base = name.split(".")[0]
    policy = 0
    if any(fnmatch.fnmatchcase(base, p) for p in HOST_ONLY_PATTERNS):
        policy |= HOST_ONLY
    if base in IMPLICIT_RNG_OPS or name in IMPLICIT_RNG_OPS:
        policy |= IMPLICIT_RNG
    if name in MIXED_DEVICE_OPS or base in MIXED_DEVICE_OPS:
        policy |= MIXED_DEVICES
    if base in DATA_MOVEMENT_OPS:
        policy |= DATA_MOVEMENT
    if base.removeprefix("aten::").removesuffix("_") in FP64_EMULATED_OPS | FP64_SELECTION_OPS:
        policy |= FP64_EMULATED
    return policy


def runs_natively(name: str) -> bool:
    """True when the NeuronCore has an implementation of the op (for float types it supports)."""
    return not fallback_policy(name) & HOST_ONLY


class CPUFallbackWarning(UserWarning):
    """An op ran on the host CPU because the NeuronCore cannot run it."""


def on_fallback(name: str, reason: str) -> None:
    warnings.warn(
        f"{name} is not supported on the NeuronCore ({reason}); it runs on the host CPU. This happens once "
        "per op: see torchneuron.fallback_counts(); set TORCHNEURON_STRICT=1 to make it an error.",
        CPUFallbackWarning, stacklevel=2)


def fallback_counts() -> dict[str, int]:
    """How often each op fell back to the CPU since start (or the last reset)."""
    names, counts = runtime_ops().host_fallback_counts()
    return dict(zip(names, counts))


def reset_fallback_counts() -> None:
    runtime_ops().reset_host_fallback_counts()


def set_strict(on: bool = True) -> None:
    """In strict mode, an op that would fall back to the CPU raises NotImplementedError instead."""
    runtime_ops().set_strict(bool(on))


def is_strict() -> bool:
    return bool(runtime_ops().strict())


_registrations: list[torch.library.Library] = []


def install() -> None:
    """Registers the Python side of the policy with the C++ fallback."""
    lib = torch.library.Library("torchneuron", "IMPL")
    lib.impl("_fallback_policy", fallback_policy, "CompositeExplicitAutograd")
    lib.impl("_on_fallback", on_fallback, "CompositeExplicitAutograd")
    _registrations.append(lib)
    runtime_ops().reclassify_ops()
