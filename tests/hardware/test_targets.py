"""Targets: published figures, dtype support, selection by name and environment."""
import pytest
import torch

from torchneuron.hardware import targets
from torchneuron.hardware.targets import TARGETS, UnsupportedDtypeError, get_target, set_target


def test_unknown_target_names_the_supported_ones():
    with pytest.raises(ValueError, match="trn1, trn2, trn3"):
        set_target("trn9")


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "trn2"),
    ({"TORCHNEURON_TARGET": "trn1"}, "trn1"),
    ({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"}, "trn3"),
    ({"TORCHNEURON_TARGET": "trn1", "NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"}, "trn1"),
])
def test_default_target_comes_from_the_environment(monkeypatch, env, expected):
    for name in ("TORCHNEURON_TARGET", "NEURON_PLATFORM_TARGET_OVERRIDE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    targets._reset_for_tests()
    assert get_target().name == expected


def test_set_target_is_case_insensitive_and_notifies_listeners_on_change():
    set_target("trn2")
    seen = []
    callback = targets.on_target_change(seen.append)
    try:
        set_target("TRN3")
        set_target("trn3")  # unchanged: no second notification
        assert [t.name for t in seen] == ["trn3"]
        assert get_target() is TARGETS["trn3"]
    finally:
        targets.remove_target_listener(callback)
    set_target("trn1")
    assert [t.name for t in seen] == ["trn3"]


def test_trn1_fp8_is_cfp8_only():
    trn1 = TARGETS["trn1"]
    assert trn1.supports(torch.float8_e4m3fn)
    assert not trn1.supports(torch.float8_e5m2)
    with pytest.raises(UnsupportedDtypeError, match="fp8_e4m3") as info:
        trn1.peak_flops(torch.float8_e5m2)
    assert isinstance(info.value, TypeError)
    assert "cFP8" in str(info.value)
    assert TARGETS["trn2"].peak_flops(torch.float8_e5m2) == 158e12


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.complex128])
def test_no_target_has_float64_or_complex(name, dtype):
    target = TARGETS[name]
    assert not target.supports(dtype)
    with pytest.raises(UnsupportedDtypeError, match="bfloat16"):
        target.check_dtype(dtype)
    with pytest.raises(UnsupportedDtypeError, match="supported: fp32"):
        target.peak_flops(dtype)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_published_bf16_peak_is_the_array_at_the_tensor_clock(name):
    # 128 x 128 multiply-adds a cycle: the per-core figure must agree with the clock.
    target = TARGETS[name]
    derived = 128 * 128 * 2 * target.clock_hz("tensor")
    assert target.peak_flops(torch.bfloat16) == pytest.approx(derived, rel=0.01)
    assert target.peak_flops("tf32") == target.peak_flops(torch.bfloat16)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_per_core_figures_are_the_chip_shared_by_its_cores(name):
    target = TARGETS[name]
    assert target.hbm_bytes * target.cores_per_chip == target.hbm_chip_bytes
    assert target.hbm_bytes_per_s * target.cores_per_chip == pytest.approx(target.hbm_chip_bytes_per_s)
    assert target.neuronlink_bytes_per_s * target.cores_per_chip == pytest.approx(
        target.neuronlink_chip_bytes_per_s)
    assert target.psum_bytes == 128 * 16 * 1024 == target.psum_banks * target.psum_bank_bytes * 128


def test_generations_differ_where_the_specs_say():
    trn1, trn2, trn3 = (TARGETS[n] for n in ("trn1", "trn2", "trn3"))
    assert (trn1.cores_per_chip, trn2.cores_per_chip, trn3.cores_per_chip) == (2, 8, 8)
    assert trn3.peak_flops(torch.float8_e4m3fn) > trn2.peak_flops(torch.float8_e4m3fn)
    assert trn2.peak_flops(torch.bfloat16) / trn2.peak_flops(torch.float32) == pytest.approx(79 / 20)
    assert trn1.sbuf_usable_bytes_per_partition == 180_224
    assert trn2.sbuf_usable_bytes_per_partition == 212_984
    assert not trn1.native_int64 and trn2.native_int64
    # PCIe Gen5 doubles Gen4.
    assert trn2.host_link_bytes_per_s == pytest.approx(2 * trn1.host_link_bytes_per_s)
    assert trn2.dma_bytes_per_s == pytest.approx(16 * 27.2e9)
