"""The work log's record layout and the enums both languages use come from C++ (_C), once."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchneuron.ops import policy
from torchneuron.runtime import _C, worklog
from torchneuron.runtime.extension import runtime_ops


def test_record_dtype_is_the_cpp_struct():
    assert worklog.RECORD.itemsize == int(runtime_ops().worklog_record_size())
    assert worklog.RECORD.names[:3] == ("kind", "op_id", "device")
    assert worklog.RECORD["sigs"].shape == (worklog.MAX_SIGS,)


def test_records_decode_with_it():
    worklog.take()  # start from an empty log
    a = torch.ones(3, 5, device="neuron")
    (a * 2).sum()
    records = worklog.take()
    names = [worklog.op_name(int(r["op_id"])) for r in records if r["kind"] == worklog.OP]
    assert "aten::mul.Tensor" in names
    mul = records[names.index("aten::mul.Tensor")]
    assert worklog.signature(mul["sigs"][0]) == (torch.float32, (3, 5))


def test_enums_are_distinct_and_flags_are_bits():
    kinds = [worklog.OP, worklog.COPY, worklog.EVENT_RECORD, worklog.EVENT_WAIT, worklog.SYNC_DEVICE,
             worklog.SYNC_STREAM, worklog.SYNC_EVENT]
    assert sorted(kinds) == list(range(7))
    for bits in (_C.WORK_FLAGS.values(), _C.OP_POLICY.values()):
        bits = list(bits)
        assert all(b > 0 and b & (b - 1) == 0 for b in bits) and len(set(bits)) == len(bits)
    assert policy.fallback_policy("aten::linalg_svd") & policy.HOST_ONLY
    assert set(_C.QUEUE_KINDS) >= {"SYNC", "FUNCTIONAL", "INPLACE", "ALLOCATE", "VIEW", "OUT", "RANDOM_BIT"}
    assert np.dtype(_C.WORK_RECORD_DTYPE) == worklog.RECORD



def test_an_error_noting_a_records_context_reaches_the_caller_and_leaves_the_device_usable():
    import pytest

    def broken(code):
        raise KeyError("classify failed")
    a = torch.ones(4, device="neuron")
    _C.contexts_start({}, broken, torch.nn.Module)
    try:
        with pytest.raises(KeyError, match="classify failed"):
            a.mul(3)
        with pytest.raises(RuntimeError, match="already being recorded"):
            _C.contexts_start({}, broken, torch.nn.Module)
    finally:
        _C.contexts_take()
    assert torch.equal((a + 1).cpu(), torch.full((4,), 2.0))  # no hook left behind
    assert _C.context_count() == 0


def _two_stream_run() -> tuple[int, float, float, dict[str, float]]:
    """(records pending after 40 repeated ops, ms of stream A's work, ms until stream B's work
    after it waited for A, engine busy seconds) of the same program, priced once beforehand."""
    from torchneuron.hardware import timeline as device_timeline
    from torchneuron.hardware import worklog as hw_worklog

    x, y = torch.randn(256, device="neuron"), torch.randn(32, 32, device="neuron")
    side = torch.neuron.Stream()
    x.add_(1), y @ y
    hw_worklog.drain()  # both signatures priced (and taught to the runtime)
    timeline = device_timeline.get_timeline(0)
    busy_before = timeline.engine_busy_s()
    start, middle, end = (torch.neuron.Event(enable_timing=True) for _ in range(3))
    start.record()
    for _ in range(20):
        x.add_(1)
        y @ y
    pending = _C.worklog_pending()
    middle.record()
    with torch.neuron.stream(side):
        side.wait_event(middle)
        for _ in range(5):
            y @ y
        end.record(side)
    busy = {k: v - busy_before.get(k, 0.0) for k, v in timeline.engine_busy_s().items()}
    return pending, start.elapsed_time(middle), middle.elapsed_time(end), busy


def test_records_of_known_price_fold_per_stream_and_time_as_when_watched():
    # nobody watching: the 40 repeated ops of known price are one pending FOLDED record (plus the
    # event before them); a listener sees every record, and the clocks, events across streams and
    # engine busy times come out the same
    from torchneuron.hardware import timeline as device_timeline

    folded = _two_stream_run()
    entries = []
    device_timeline.add_listener(entries.append)
    try:
        watched = _two_stream_run()
    finally:
        device_timeline.remove_listener(entries.append)
    assert folded[0] == 2 and watched[0] == 41
    assert folded[1] == pytest.approx(watched[1], rel=1e-9) and folded[2] == pytest.approx(watched[2], rel=1e-9)
    assert folded[1] > 0 and folded[2] > 0
    assert folded[3].keys() == watched[3].keys()
    assert all(folded[3][k] == pytest.approx(watched[3][k], rel=1e-9) for k in watched[3])


def test_a_new_target_prices_again_what_was_folded_before():
    # a price taught for one target is not used on another: the same program times differently
    from torchneuron.hardware import worklog as hw_worklog
    from torchneuron.hardware.targets import get_target, set_target

    y = torch.randn(64, 64, device="neuron")
    before = get_target().name
    times = []
    try:
        for target in ("trn1", "trn2", "trn1"):
            set_target(target)
            y @ y
            hw_worklog.drain()
            a, b = (torch.neuron.Event(enable_timing=True) for _ in range(2))
            a.record()
            for _ in range(10):
                y @ y
            b.record()
            assert _C.worklog_pending() == 3  # the events and the folded products
            times.append(a.elapsed_time(b))
    finally:
        set_target(before)
    assert times[0] != pytest.approx(times[1], rel=1e-3) and times[0] == pytest.approx(times[2], rel=1e-9)
