"""Hardware targets: the published figures of trn1, trn2 and trn3, and the current target.

This module owns the *specs* of each Trainium generation as one frozen `Target` per chip
generation, the process-wide choice of target (`get_target` / `set_target`, environment
variables `TORCHNEURON_TARGET` and `NEURON_PLATFORM_TARGET_OVERRIDE`), listeners notified
when the target changes, and the data-type support of each target.

Every figure comes from AWS's public Neuron documentation as collected in
shared/hardware.md (pages: about-neuron/arch/neuron-hardware/trainium*.rst,
neuron-core-v2/v3/v4.rst, nki/guides/architecture/*.rst, nki/about/nki-dma-overview,
about-neuron/arch/neuron-features/data-types.rst). Where the performance model needs a
figure AWS does not publish (instruction overheads, latencies), the field says so and states
the assumption behind its value. Nothing here is fitted to a benchmark result.

Modelling conventions, stated once:
- A *logical device* is one physical NeuronCore (logical-core size 1). Chip-wide figures
  (HBM capacity and bandwidth, DMA, NeuronLink) are divided evenly by `cores_per_chip`:
  we assume all cores of a chip are busy and share the chip's resources equally.
- Where two AWS pages disagree, the lower (conservative) figure is used and both are cited.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from torchneuron import settings
__all__ = [
    "Target",
    "TARGETS",
    "UnsupportedDtypeError",
    "get_target",
    "set_target",
    "on_target_change",
    "remove_target_listener",
    "dtype_key",
]

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
GB = 1e9
TB = 1e12
TFLOPS = 1e12
GHZ = 1e9


class UnsupportedDtypeError(TypeError):
    """A dtype the chosen target has no hardware type (or Tensor-engine rate) for."""


# Map torch dtypes to the short keys used by Target's per-dtype fields. "tf32" has no torch
# dtype of its own (it is a float32 matmul mode); pass the string "tf32" to peak_flops.
_FLOAT_KEYS: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}
_STRING_KEYS = {
    "fp32": "fp32", "float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16",
    "tf32": "tf32", "tfloat32": "tf32",
    "fp8_e4m3": "fp8_e4m3", "float8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
}
# Integer and boolean types the engines handle (hardware.md "Data types in hardware", plus
# the 8/16-bit integer types NKI accepts). bool is stored as uint8.
_INTEGER_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16,
    torch.int32, torch.uint32, torch.int64,
)


def dtype_key(dtype: torch.dtype | str) -> str | None:
    """Short key ("bf16", "fp32", "tf32", ...) of a floating dtype, or None for others."""
    if isinstance(dtype, str):
        return _STRING_KEYS.get(dtype.lower().removeprefix("torch."))
    return _FLOAT_KEYS.get(dtype)


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Target:
    """One Trainium generation, seen from one logical device (one NeuronCore).

    Rates are per NeuronCore unless the field name says `_chip`. Clocks are in GHz,
    bandwidths in bytes/s, peak rates in FLOP/s, sizes in bytes, times in seconds.
    """

    name: str                      # "trn1" | "trn2" | "trn3"
    core_type: str                 # "NeuronCore-v2" | "-v3" | "-v4"
    cores_per_chip: int

    # Engine clocks, GHz (hardware.md, "Per NeuronCore").
    tensor_clock_ghz: float
    vector_clock_ghz: float
    scalar_clock_ghz: float
    gpsimd_clock_ghz: float

    # Tensor-engine dense peak per core, FLOP/s; 0.0 = the dtype is not supported.
    fp32_flops: float
    bf16_flops: float
    fp16_flops: float
    tf32_flops: float
    fp8_e4m3_flops: float
    fp8_e5m2_flops: float
    fp8_note: str                  # what "fp8" means on this generation

    # Vector / Scalar engine published FP32 rates per core (reporting only; the time model
    # uses one element per partition lane per cycle, see instructions.py).
    vector_flops: float
    scalar_flops: float
    gpsimd_cores: int              # 8 x 512-bit cores per NeuronCore

    # On-chip memory.
    sbuf_bytes_per_partition: int
    sbuf_usable_bytes_per_partition: int

    # HBM, per logical core (= chip figure / cores_per_chip).
    hbm_bytes: int
    hbm_bytes_per_s: float
    hbm_chip_bytes: int
    hbm_chip_bytes_per_s: float

    # DMA, per core.
    dma_engines: int               # queues paired with one NeuronCore
    dma_engine_bytes_per_s: float  # one queue's theoretical rate

    # Interconnect.
    neuronlink_chip_bytes_per_s: float
    host_link: str                 # description of the PCIe link assumed
    host_link_bytes_per_s: float

    # Data types.
    native_int64: bool             # int64 computed natively (else emulated with int32 pairs)
    fp8_double_row: bool           # FP8 matmul contracts 256 rows a pass ("double row")

    # ---- constants AWS does not publish: assumptions, stated where they are set ----------
    instruction_fixed_cycles: int = 64
    matmul_issue_cycles: int = 16
    dma_fixed_latency_s: float = 1.0e-6
    dma_descriptor_overhead_s: float = 25e-9
    hbm_burst_bytes: int = 64
    host_link_latency_s: float = 1.0e-6
    link_step_latency_s: float = 1.5e-6

    # Fixed-size structures common to all generations (hardware.md "Tiles and instructions").
    partitions: int = 128
    psum_bytes_per_partition: int = 16 * KIB
    psum_banks: int = 8
    psum_bank_bytes: int = 2 * KIB
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512
    psum_fmax: int = 512
    bn_stats_fmax: int = 512

    def __hash__(self) -> int:  # targets are keyed by name; names are unique
        return hash(self.name)

    # ---- derived quantities --------------------------------------------------------------
    @property
    def sbuf_bytes(self) -> int:
        return self.sbuf_bytes_per_partition * self.partitions

    @property
    def sbuf_usable_bytes(self) -> int:
        return self.sbuf_usable_bytes_per_partition * self.partitions

    @property
    def psum_bytes(self) -> int:
        return self.psum_bytes_per_partition * self.partitions

    @property
    def dma_bytes_per_s(self) -> float:
        """All DMA queues of one core together."""
        return self.dma_engines * self.dma_engine_bytes_per_s

    @property
    def neuronlink_bytes_per_s(self) -> float:
        """NeuronLink bandwidth one logical core gets when every core of the chip takes part
        in the collective (the chip figure shared evenly)."""
        return self.neuronlink_chip_bytes_per_s / self.cores_per_chip

    @property
    def kernel_launch_s(self) -> float:
        """Device-side cost of one eager kernel dispatch.

        Assumption: the host rings a doorbell over PCIe (one host-link latency), the Sync
        engine fetches the kernel's instruction stream from HBM with one DMA (one DMA fixed
        latency), and completion is signalled back over PCIe (one more host-link latency).
        Host-side Python/C++ dispatch time is host wall time and is not included.
        """
        return 2 * self.host_link_latency_s + self.dma_fixed_latency_s

    def clock_hz(self, engine: str) -> float:
        """Clock of a compute engine ("tensor", "vector", "scalar", "gpsimd") in Hz."""
        ghz = {
            "tensor": self.tensor_clock_ghz,
            "vector": self.vector_clock_ghz,
            "scalar": self.scalar_clock_ghz,
            "gpsimd": self.gpsimd_clock_ghz,
        }.get(engine)
        if ghz is None:
            raise ValueError(f"{engine!r} has no clock; engines with clocks: tensor, vector, scalar, gpsimd")
        return ghz * GHZ

    # ---- data types ------------------------------------------------------------------------
    def matmul_dtypes(self) -> tuple[str, ...]:
        """Names of the dtypes the Tensor engine multiplies on this target."""
        return tuple(key for key in ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
                     if getattr(self, f"{key}_flops") > 0)

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        """Dense Tensor-engine peak of one core for `dtype`, FLOP/s.

        `dtype` is a torch dtype, or one of the strings "tf32", "bf16", "fp32", ... Raises
        UnsupportedDtypeError listing the supported dtypes when the target has no rate.
        """
        key = dtype_key(dtype)
        rate = getattr(self, f"{key}_flops") if key else 0.0
        if rate <= 0:
            raise UnsupportedDtypeError(
                f"{self.name} ({self.core_type}) has no Tensor-engine rate for "
                f"{_dtype_name(dtype)}; supported: {', '.join(self.matmul_dtypes())}"
                + (f" ({self.fp8_note})" if key and key.startswith("fp8") else "")
            )
        return rate

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether `dtype` is a hardware data type on this target (storage and compute).

        float64 and complex types are not hardware types anywhere; FP8 support depends on
        the generation (trn1: e4m3 as cFP8 only). int64 is supported everywhere; on trn1 it
        is emulated (see `native_int64`).
        """
        key = _FLOAT_KEYS.get(dtype)
        if key is not None:
            return getattr(self, f"{key}_flops") > 0
        return dtype in _INTEGER_DTYPES

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        floats = tuple(d for d, key in _FLOAT_KEYS.items() if getattr(self, f"{key}_flops") > 0)
        return floats + _INTEGER_DTYPES

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise UnsupportedDtypeError (naming the supported dtypes) if `dtype` is unsupported."""
        if not self.supports(dtype):
            names = ", ".join(_dtype_name(d) for d in self.supported_dtypes())
            hint = " (no hardware type: float64 and complex run on the host CPU)" if (
                dtype.is_complex or dtype == torch.float64) else ""
            raise UnsupportedDtypeError(
                f"{_dtype_name(dtype)} is not supported on {self.name}{hint}; supported: {names}")


# ----------------------------------------------------------------------------------------------
# The three generations. Per-core Tensor-engine rates are the NeuronCore pages' figures; they
# agree with the 128x128 array doing one multiply-add per PE per cycle at the Tensor clock
# (128*128*2*2.8 GHz = 91.8 TFLOPS on v2, *2.4 GHz = 78.6 TFLOPS on v3/v4) - tests check this.
# ----------------------------------------------------------------------------------------------

# Host link assumption: one x16 PCIe link per chip, a single transfer gets all of it.
# Effective rate = lanes * GT/s * 128/130 (encoding) * 256/(256+24) (256-B TLP payloads with
# ~24 B of header/framing/DLLP overhead) / 8 bits.
def _pcie_x16_bytes_per_s(gigatransfers: float) -> float:
    return 16 * gigatransfers * 1e9 * (128 / 130) * (256 / (256 + 24)) / 8


TRN1 = Target(
    name="trn1",
    core_type="NeuronCore-v2",
    cores_per_chip=2,
    tensor_clock_ghz=2.8, vector_clock_ghz=1.12, scalar_clock_ghz=1.4, gpsimd_clock_ghz=1.4,
    # neuron-core-v2: 92 TFLOPS BF16/FP16/TF32/cFP8, 23 FP32 per core (chip: 190 / 47.5).
    fp32_flops=23 * TFLOPS, bf16_flops=92 * TFLOPS, fp16_flops=92 * TFLOPS,
    tf32_flops=92 * TFLOPS, fp8_e4m3_flops=92 * TFLOPS, fp8_e5m2_flops=0.0,
    fp8_note="trn1 FP8 is cFP8: float8_e4m3fn only, float8_e5m2 unsupported",
    # Vector/Scalar: published only for v3 (1.0 / 1.2 TFLOPS); scaled by clock, assuming the
    # same per-cycle width on v2.
    vector_flops=1.0 * TFLOPS * 1.12 / 0.96, scalar_flops=1.2 * TFLOPS * 1.4 / 1.2,
    gpsimd_cores=8,
    sbuf_bytes_per_partition=192 * KIB, sbuf_usable_bytes_per_partition=180_224,
    # trainium.rst: 32 GiB HBM, 820 GiB/s (NKI architecture guide: 820 GB/s; the lower
    # figure, GB/s, is used). Per core = chip / 2.
    hbm_bytes=32 * GIB // 2, hbm_bytes_per_s=820 * GB / 2,
    hbm_chip_bytes=32 * GIB, hbm_chip_bytes_per_s=820 * GB,
    # nki-dma-overview: 16 DMA engines per NeuronCore (v2-v4), 27.2 GB/s each on v2/v3
    # (16 x 27.2 = 435 GB/s; trainium.rst chip figure 1 TB/s / 2 cores = 500 GB/s).
    dma_engines=16, dma_engine_bytes_per_s=27.2 * GB,
    neuronlink_chip_bytes_per_s=384 * GB,          # NeuronLink-v2, 384 GB/s per chip
    host_link="PCIe Gen4 x16 (assumed)", host_link_bytes_per_s=_pcie_x16_bytes_per_s(16),
    native_int64=False,                            # hardware.md: int64 native on trn2/trn3 only
    fp8_double_row=False,
)

TRN2 = Target(
    name="trn2",
    core_type="NeuronCore-v3",
    cores_per_chip=8,
    tensor_clock_ghz=2.4, vector_clock_ghz=0.96, scalar_clock_ghz=1.2, gpsimd_clock_ghz=1.2,
    # neuron-core-v3: 79 BF16, 158 FP8, 20 FP32 per core. FP16/TF32 at the BF16 rate (chip
    # page: 667 TFLOPS "BF16 / FP16 / TF32").
    fp32_flops=20 * TFLOPS, bf16_flops=79 * TFLOPS, fp16_flops=79 * TFLOPS,
    tf32_flops=79 * TFLOPS, fp8_e4m3_flops=158 * TFLOPS, fp8_e5m2_flops=158 * TFLOPS,
    fp8_note="trn2 FP8: float8_e4m3fn and float8_e5m2, double-row mode (K = 256)",
    vector_flops=1.0 * TFLOPS, scalar_flops=1.2 * TFLOPS,   # neuron-core-v3
    gpsimd_cores=8,
    sbuf_bytes_per_partition=224 * KIB, sbuf_usable_bytes_per_partition=212_984,
    # trainium2.rst: 96 GiB, 2.9 TB/s (NKI guide: 3 TB/s; lower figure used). Per core / 8.
    hbm_bytes=96 * GIB // 8, hbm_bytes_per_s=2.9 * TB / 8,
    hbm_chip_bytes=96 * GIB, hbm_chip_bytes_per_s=2.9 * TB,
    # nki-dma-overview: 16 engines x 27.2 GB/s = 435 GB/s (chip: 3.5 TB/s / 8 = 437 GB/s).
    dma_engines=16, dma_engine_bytes_per_s=27.2 * GB,
    neuronlink_chip_bytes_per_s=1.28 * TB,         # NeuronLink-v3
    host_link="PCIe Gen5 x16 (assumed)", host_link_bytes_per_s=_pcie_x16_bytes_per_s(32),
    native_int64=True,
    fp8_double_row=True,                           # hardware.md: NeuronCore-v3 FP8 K = 256
)

TRN3 = Target(
    name="trn3",
    core_type="NeuronCore-v4",
    cores_per_chip=8,
    tensor_clock_ghz=2.4, vector_clock_ghz=1.2, scalar_clock_ghz=1.2, gpsimd_clock_ghz=1.2,
    # neuron-core-v4: 79 BF16, 315 MXFP8/MXFP4, 20 FP32 per core. FP8 is MX (block-scaled)
    # FP8; both torch fp8 element types are accepted as its element format.
    fp32_flops=20 * TFLOPS, bf16_flops=79 * TFLOPS, fp16_flops=79 * TFLOPS,
    tf32_flops=79 * TFLOPS, fp8_e4m3_flops=315 * TFLOPS, fp8_e5m2_flops=315 * TFLOPS,
    fp8_note="trn3 FP8 is MXFP8 (e4m3 or e5m2 elements with block scales)",
    # v4 Vector/Scalar rates unpublished: v3 figures scaled by clock (same width assumed).
    vector_flops=1.0 * TFLOPS * 1.2 / 0.96, scalar_flops=1.2 * TFLOPS,
    gpsimd_cores=8,
    sbuf_bytes_per_partition=256 * KIB, sbuf_usable_bytes_per_partition=245_752,
    # trainium3: 144 GiB, 4.9 TB/s (NKI guide: 4.7 TB/s; lower figure used). Per core / 8.
    hbm_bytes=144 * GIB // 8, hbm_bytes_per_s=4.7 * TB / 8,
    hbm_chip_bytes=144 * GIB, hbm_chip_bytes_per_s=4.7 * TB,
    # nki-dma-overview: 16 engines x 38.4 GB/s on v4 = 614 GB/s (chip 4.9 TB/s / 8 = 612).
    dma_engines=16, dma_engine_bytes_per_s=38.4 * GB,
    neuronlink_chip_bytes_per_s=2.56 * TB,         # NeuronLink-v4
    host_link="PCIe Gen5 x16 (assumed)", host_link_bytes_per_s=_pcie_x16_bytes_per_s(32),
    native_int64=True,
    # Double row is documented for v3 only; assumed kept on v4 (the 4x MXFP8 rate is then
    # two rows a cycle at twice the column rate).
    fp8_double_row=True,
)

# Assumptions behind the unpublished defaults above (shared by all generations):
# - instruction_fixed_cycles = 64: a compute instruction's issue, semaphore check and SBUF
#   read-pipeline fill before the first element, in engine cycles.
# - matmul_issue_cycles = 16: bubble between back-to-back matmul passes; the next
#   stationary tile loads into the array while the current moving tile streams (double
#   buffered), so only the issue bubble is exposed.
# - dma_fixed_latency_s = 1 us: trigger -> descriptor fetch -> first HBM read -> write ->
#   completion semaphore; two HBM round trips (~0.4 us each through the chip fabric) plus
#   trigger and semaphore updates.
# - dma_descriptor_overhead_s = 25 ns: per descriptor (one contiguous run) a queue spends
#   on fetching the 32-64 B descriptor and generating addresses, pipelined. With 27.2 GB/s
#   queues a 4 KiB run is then ~86% efficient, 512 B ~43%: consistent with the NKI DMA
#   bandwidth guide's advice that runs of >= 4 KiB are needed to saturate HBM.
# - hbm_burst_bytes = 64: the HBM access granularity; a shorter run still moves 64 B.
# - host_link_latency_s = 1 us: one PCIe round trip (doorbell/completion) to the host.
# - link_step_latency_s = 1.5 us: one ring step of a collective: a DMA fixed latency plus
#   ~0.5 us link traversal and the cross-chip semaphore handshake.

TARGETS: dict[str, Target] = {t.name: t for t in (TRN1, TRN2, TRN3)}
DEFAULT_TARGET = "trn2"

_lock = threading.Lock()
_current: Target | None = None
_listeners: list[Callable[[Target], None]] = []


def _lookup(name: str) -> Target:
    target = TARGETS.get(name.strip().lower()) if isinstance(name, str) else None
    if target is None:
        raise ValueError(
            f"unknown Neuron target {name!r}; supported targets: {', '.join(TARGETS)}")
    return target


def _target_from_environment() -> Target:
    config = settings.current()
    name = config.target or config.platform_target_override or DEFAULT_TARGET
    return _lookup(name)


def get_target() -> Target:
    """The current target: set_target's choice, else $TORCHNEURON_TARGET, else
    $NEURON_PLATFORM_TARGET_OVERRIDE, else trn2."""
    current = _current
    if current is not None:
        return current
    return _initialise_from_environment()


def _initialise_from_environment() -> Target:
    global _current
    with _lock:
        if _current is None:
            _current = _target_from_environment()
        return _current


def set_target(name: str) -> Target:
    """Make `name` ("trn1", "trn2", "trn3") the current target; notify listeners on change.

    Raises ValueError listing the supported names for an unknown name.
    """
    global _current
    target = _lookup(name)
    with _lock:
        previous, _current = _current, target
        listeners = tuple(_listeners)
    if previous is not target:
        for callback in listeners:
            callback(target)
    return target


def on_target_change(callback: Callable[[Target], None]) -> Callable[[Target], None]:
    """Call `callback(new_target)` whenever set_target changes the target. Returns the
    callback, so it can be used as a decorator."""
    with _lock:
        _listeners.append(callback)
    return callback


def remove_target_listener(callback: Callable[[Target], None]) -> None:
    with _lock:
        if callback in _listeners:
            _listeners.remove(callback)


def _reset_for_tests() -> None:
    """Forget the current target so the next get_target reads the environment again."""
    global _current
    with _lock:
        _current = None
