"""Hardware rules are enforced with errors that name the rule and the kernel's line, and a
failing kernel leaves the caller's tensors untouched."""
import inspect

import pytest
import torch

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.hardware.targets import TARGETS


def _line_of(fn, text):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, l in enumerate(src) if text in l)


def _raises(kernel, exc, rule, marker, *args):
    with pytest.raises(exc) as info:
        kernel(*args)
    err = info.value
    assert err.rule == rule
    assert f"{__file__}:{_line_of(kernel.fn, marker)}" in str(err), str(err)
    return err


@nki.jit
def _too_many_partitions(a):
    return nl.ndarray((256, 4), dtype=nl.float32)  # MARK-P


def test_partition_dimension_over_128():
    err = _raises(_too_many_partitions, nki.PartitionDimError, "partition-dim", "MARK-P", torch.zeros(1))
    assert "256" in str(err) and "128" in str(err)


@nki.jit
def _sbuf_overflow(a):
    t = nl.ndarray((128, 200_000), dtype=nl.float32)  # MARK-S
    return t


def test_sbuf_capacity_per_partition_of_target():
    err = _raises(_sbuf_overflow, nki.CapacityError, "sbuf-capacity", "MARK-S", torch.zeros(1))
    assert str(TARGETS["trn2"].sbuf_usable_bytes_per_partition) in str(err)


@nki.jit
def _sbuf_live_overflow(a):
    keep = [nl.ndarray((128, 20_000), dtype=nl.float32) for _ in range(3)]  # 240 KB live
    nisa.memset(keep[2], 0.0)  # MARK-L
    return a


def test_sbuf_capacity_counts_live_tiles():
    _raises(_sbuf_live_overflow, nki.CapacityError, "sbuf-capacity", "MARK-L", torch.zeros(1))


def test_capacity_follows_the_target():
    small = nki.jit(_sbuf_live_overflow.fn, platform_target="trn3")  # 245 KB usable there
    small(torch.zeros(1))


def _live_psum_tiles(n):
    @nki.jit
    def kernel(a):
        tiles = [nl.zeros((128, 512), nl.float32, buffer=nl.psum) for _ in range(n)]
        nisa.memset(tiles[0], 1.0)
        return a
    return kernel


def test_psum_over_eight_banks_spills_to_sbuf():
    """A ninth live PSUM bank is spilled to SBUF (as the compiler's allocator does) and costs
    a copy out and back, instead of failing."""
    fits, spills = _live_psum_tiles(8), _live_psum_tiles(9)
    fits(torch.zeros(1))
    spills(torch.zeros(1))
    assert fits.last_stats.psum_spill_bytes == 0
    assert spills.last_stats.psum_spill_bytes == 2048
    assert spills.last_stats.latency_s > fits.last_stats.latency_s


@nki.jit
def _psum_tile_over_a_bank(a):
    t = nl.zeros((128, 1024), nl.float32, buffer=nl.psum)  # MARK-PS
    return a


def test_psum_tile_must_fit_a_bank():
    _raises(_psum_tile_over_a_bank, nki.CapacityError, "psum-capacity", "MARK-PS", torch.zeros(1))


@nki.jit
def _matmul_moving_too_wide(a, b):
    return nisa.nc_matmul(nl.load(a), nl.load(b))  # MARK-M


def test_matmul_shape_limits():
    _raises(_matmul_moving_too_wide, nki.ShapeError, "matmul-shape", "MARK-M",
            torch.zeros(128, 128), torch.zeros(128, 1024))
    _raises(_matmul_moving_too_wide, nki.ShapeError, "matmul-shape", "MARK-M",
            torch.zeros(128, 256), torch.zeros(128, 512))


@nki.jit
def _matmul_from_psum(a, b):
    p = nl.zeros((128, 128), nl.float32, buffer=nl.psum)
    return nisa.nc_matmul(p, nl.load(b))  # MARK-E


@nki.jit
def _matmul_into_sbuf(a, b):
    out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
    nisa.nc_matmul(out, nl.load(a), nl.load(b))  # MARK-D
    return a


def test_engine_buffer_rules():
    x = torch.zeros(128, 128)
    _raises(_matmul_from_psum, nki.EngineRuleError, "engine-buffer", "MARK-E", x, x)
    _raises(_matmul_into_sbuf, nki.EngineRuleError, "engine-buffer", "MARK-D", x, x)


def test_dtype_the_engine_cannot_take():
    x = torch.zeros(128, 128, dtype=torch.int32)
    _raises(_matmul_moving_too_wide, nki.DTypeError, "dtype", "MARK-M", x, x)
    with pytest.raises(nki.DTypeError):
        _matmul_moving_too_wide(torch.zeros(128, 4, dtype=torch.float64), torch.zeros(128, 4))


@nki.jit
def _out_of_bounds(a):
    return nl.load(a[0:128, 100:200])  # MARK-O


def test_out_of_bounds_access():
    err = _raises(_out_of_bounds, nki.OutOfBoundsError, "out-of-bounds", "MARK-O", torch.zeros(128, 150))
    assert "[100, 199]" in str(err)


@nki.jit
def _raises_midway(a, out):
    nl.store(out, value=nl.load(a))     # writes the caller's tensor...
    raise ValueError("boom")            # MARK-R


def test_kernel_raising_midway_commits_nothing():
    a, out = torch.ones(8, 8), torch.zeros(8, 8)
    err = _raises(_raises_midway, nki.KernelError, "kernel-raised", "MARK-R", a, out)
    assert isinstance(err.__cause__, ValueError)
    assert torch.equal(out, torch.zeros(8, 8))


@nki.jit
def _in_place(a, out):
    nl.store(out, value=nl.load(a) * 2.0)


def test_successful_kernel_commits_outputs():
    a, out = torch.ones(8, 8), torch.zeros(8, 8)
    _in_place(a, out)
    assert torch.equal(out, torch.full((8, 8), 2.0))


def test_no_partial_writes_after_rule_violation():
    @nki.jit
    def k(a, out):
        nl.store(out, value=nl.load(a))
        nl.load(a[64:192, :])
    a, out = torch.ones(128, 4), torch.zeros(128, 4)
    with pytest.raises(nki.OutOfBoundsError):
        k(a, out)
    assert torch.equal(out, torch.zeros(128, 4))


def test_language_call_outside_kernel():
    with pytest.raises(nki.NKIError):
        nl.zeros((128, 4), nl.float32)
