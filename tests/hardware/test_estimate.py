"""estimate(): a region's modeled device time, FLOPs, bytes, MFU and per-op table."""
import pytest
import torch

from torchneuron.hardware import estimate, get_target, set_target
from torchneuron.hardware.model import Cost, op_cost
from torchneuron.hardware.targets import TARGETS
from torchneuron.hardware.timeline import DeviceTimeline


def test_estimate_summarises_the_work_enqueued_inside_the_region():
    timeline = DeviceTimeline(21)
    timeline.enqueue(0, Cost(5.0, "tensor", 1e12, 1e6, "compute"), "before")  # not counted
    timeline.synchronize()  # streams first used later start at 5.0
    matmul = Cost(2e-3, "tensor", 100e9, 30e6, "compute")
    add = Cost(1e-3, "vector", 1e6, 12e6, "memory")
    with estimate() as est:
        timeline.enqueue(0, matmul, "aten::mm")
        timeline.enqueue(1, add, "aten::add.Tensor")   # parallel stream, overlaps the mm
        timeline.enqueue(0, add, "aten::add.Tensor")
    timeline.enqueue(0, matmul, "after")                # not counted
    assert est.entries == 3 and est.devices == 1
    assert est.device_time_s == pytest.approx(3e-3)    # span 5.000 .. 5.003
    assert est.flops == pytest.approx(100e9 + 2e6)
    assert est.bytes == pytest.approx(54e6)
    assert est.engine_time_s == pytest.approx({"tensor": 2e-3, "vector": 2e-3})
    achieved = (100e9 + 2e6) / 3e-3
    assert est.achieved_flops == pytest.approx(achieved)
    assert est.mfu == pytest.approx(achieved / get_target().peak_flops(torch.bfloat16))
    assert est.mfu_against(torch.float32) == pytest.approx(achieved / get_target().peak_flops(torch.float32))
    rows = est.per_op
    assert [(r.name, r.count, r.engine) for r in rows] == [("aten::add.Tensor", 2, "vector"), ("aten::mm", 1, "tensor")]
    assert rows[0].time_s == pytest.approx(2e-3) and rows[1].flops == 100e9
    text = str(est)
    assert "aten::mm" in text and "aten::add.Tensor" in text and "MFU" in text


def test_estimate_with_a_target_switches_and_restores_it():
    set_target("trn2")
    with estimate("trn3") as est:
        assert get_target() is TARGETS["trn3"]
        cost = op_cost("aten::mm", [(torch.bfloat16, (4096, 4096))] * 2, [(torch.bfloat16, (4096, 4096))])
        DeviceTimeline(22).enqueue(0, cost, "aten::mm")
    assert get_target() is TARGETS["trn2"]
    assert est.target is TARGETS["trn3"]
    assert 0.5 < est.mfu <= 1.0  # a big bf16 matmul runs near the trn3 peak
    with pytest.raises(ValueError, match="trn1, trn2, trn3"):
        with estimate("trn7"):
            pass
    assert get_target() is TARGETS["trn2"]


def test_empty_estimate():
    with estimate() as est:
        pass
    assert est.device_time_s == 0 and est.flops == 0 and est.mfu == 0 and est.per_op == []
    assert "0 items" in str(est)
