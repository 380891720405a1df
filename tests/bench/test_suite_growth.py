"""bench/suite.py's growth table runs: rows for every mode and scale, ratios to the x1 row (no timing assertions)."""
from __future__ import annotations

import math
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def suite():
    sys.path.insert(0, BENCH)
    try:
        import suite as module
        yield module
    finally:
        sys.path.remove(BENCH)


def test_growth_configs_scale_one_dimension_each(suite):
    configs = suite.growth_configs(32, 16, (1, 2, 4, 8))
    assert [(c.dim, c.scale) for c in configs] == [("base", 1), ("width", 2), ("width", 4), ("width", 8),
                                                  ("seq", 2), ("seq", 4), ("seq", 8)]
    assert all(c.seq == 16 for c in configs if c.dim == "width")
    assert [c.hidden for c in configs if c.dim == "width"] == [64, 128, 256]
    assert all(c.hidden == 32 for c in configs if c.dim == "seq")
    assert [c.seq for c in configs if c.dim == "seq"] == [32, 64, 128]


@pytest.mark.slow  # compiles three tiny Llamas (torch.compile and adaptive eager's programs)
@pytest.mark.timeout(1800)
def test_growth_rows_for_every_mode_and_scale(suite, capsys):
    rows = suite.growth(hidden=16, seq=8, scales=(1, 2), warmup=2, rounds=1, steps=1)
    expected = {(dim, scale, mode) for dim, scale in (("base", 1), ("width", 2), ("seq", 2))
                for mode in suite.GROWTH_MODES}
    assert {(r["dim"], r["scale"], r["mode"]) for r in rows} == expected
    for r in rows:
        assert r["host"] > 0 and math.isfinite(r["host_x"])
        if r["mode"] == "cpu eager":
            assert r["device"] is None and r["device_x"] is None
        else:
            assert r["device"] > 0 and math.isfinite(r["device_x"])
        if r["dim"] == "base":
            assert r["host_x"] == 1.0 and r["device_x"] in (None, 1.0)
    # twice the width means more modeled device work for every neuron mode
    width = {r["mode"]: r for r in rows if r["dim"] == "width"}
    assert all(width[m]["device_x"] > 1.0 for m in suite.GROWTH_MODES if m != "cpu eager")
    suite.print_growth(rows)
    out = capsys.readouterr().out
    assert "width x2" in out and "seq x2" in out and "trn2 neuron compiled" in out
