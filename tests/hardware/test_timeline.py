"""The device timeline: stream clocks, events, joins, engine busy time, listeners."""
import pytest

from torchneuron.hardware import timeline as tl
from torchneuron.hardware.model import Cost
from torchneuron.hardware.timeline import DeviceTimeline, TimelineEntry


def work(seconds, engine="vector", flops=0.0, nbytes=0.0):
    return Cost(seconds, engine, flops, nbytes, "compute")


def test_streams_run_independently_and_events_join_them():
    timeline = DeviceTimeline(7)
    assert timeline.enqueue(0, work(1.0), "a") == (0.0, 1.0)
    assert timeline.enqueue(1, work(0.5), "b") == (0.0, 0.5)
    event = timeline.record_event(0)
    assert event == 1.0
    assert timeline.wait_until(1, event) == 1.0
    assert timeline.enqueue(1, work(0.25), "c") == (1.0, 1.25)
    # waiting for a time already passed changes nothing
    assert timeline.wait_until(1, 0.1) == 1.25
    assert timeline.now(0) == 1.0 and timeline.now(1) == 1.25


def test_wait_stream_and_synchronize():
    timeline = DeviceTimeline(7)
    timeline.enqueue(0, work(2.0), "long")
    timeline.enqueue(1, work(0.5), "short")
    assert timeline.wait_stream(1, 0) == 2.0
    timeline.enqueue(2, work(3.0), "longest")
    assert timeline.synchronize() == 3.0
    assert timeline.streams() == {0: 3.0, 1: 3.0, 2: 3.0}
    # a stream first used after the synchronize starts there, not at zero
    assert timeline.enqueue(5, work(1.0), "late") == (3.0, 4.0)
    assert sorted(timeline.stream_ids()) == [0, 1, 2, 5]


def test_engine_busy_time_and_reset():
    timeline = DeviceTimeline(7)
    timeline.enqueue(0, work(1.0, "tensor"), "mm")
    timeline.enqueue(1, work(0.5, "tensor"), "mm")
    timeline.enqueue(0, work(0.25, "dma"), "copy")
    assert timeline.engine_busy_s() == {"tensor": 1.5, "dma": 0.25}
    assert timeline.entries == 3
    timeline.reset()
    assert timeline.engine_busy_s() == {} and timeline.streams() == {} and timeline.now(0) == 0.0


def test_listeners_see_every_entry_until_removed():
    timeline = DeviceTimeline(11)
    seen: list[TimelineEntry] = []
    tl.add_listener(seen.append)
    try:
        timeline.enqueue(3, work(1.0, "tensor", flops=10.0), "aten::mm", {"seq": 1})
        timeline.enqueue(3, work(0.5), "aten::add.Tensor")
    finally:
        tl.remove_listener(seen.append)
    timeline.enqueue(3, work(0.5), "after")
    mine = [e for e in seen if e.device == 11]
    assert [(e.stream, e.name, e.start_s, e.end_s) for e in mine] == [
        (3, "aten::mm", 0.0, 1.0), (3, "aten::add.Tensor", 1.0, 1.5)]
    assert mine[0].cost.flops == 10.0 and mine[0].meta == {"seq": 1} and mine[1].duration_s == 0.5
    tl.remove_listener(seen.append)  # removing twice is harmless


def test_registry_returns_one_timeline_per_device():
    assert tl.get_timeline(5) is tl.get_timeline(5)
    assert tl.get_timeline(5) is not tl.get_timeline(6)
    assert {5, 6} <= {t.device for t in tl.all_timelines()}
    with pytest.raises(ValueError):
        tl.get_timeline(-1)


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_recording_switch(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv("TORCHNEURON_TIMELINE", raising=False)
    else:
        monkeypatch.setenv("TORCHNEURON_TIMELINE", value)
    assert tl.recording_enabled() is enabled


def test_a_batch_listener_gets_a_drain_as_the_entries_a_plain_listener_sees():
    """A drain too big for the per-record path (work on two streams, split by an event) reaches a
    listener that takes batches as one EntryBatch: the same entries, clocks and metadata a plain
    listener gets one by one, in the records' order; the stream clocks are those enqueue gives."""
    import torch

    from torchneuron.hardware import worklog

    x = torch.ones(8, device="neuron")
    side = torch.neuron.Stream()
    worklog.drain()
    plain: list[TimelineEntry] = []
    batches: list[tl.EntryBatch] = []

    def batch_fn(entry):  # a second listener, whose drains arrive as batches
        raise AssertionError("work-log entries must arrive as a batch")

    tl.add_listener(plain.append)
    tl.add_listener(batch_fn, batches=batches.append)
    try:
        for i in range(150):
            x.add_(1)
            if i == 70:
                with torch.neuron.stream(side):
                    x.mul_(2).sub_(1)
                torch.neuron.current_stream().wait_stream(side)
        worklog.drain()
    finally:
        tl.remove_listener(plain.append)
        tl.remove_listener(batch_fn)
    assert len(batches) == 1 and len(batches[0]) == len(plain) == 152
    batch = batches[0]
    assert [(e.device, e.stream, e.name, e.start_s, e.end_s, e.cost, e.meta) for e in plain] == [
        (e.device, e.stream, e.name, e.start_s, e.end_s, e.cost, e.meta) for e in batch.entries()]
    assert batch.record == sorted(batch.record) and batch.meta[0] == {"fallback": False, "kind": "op"}
    main_stream = [e for e in plain if e.stream == plain[0].stream]
    for before, after in zip(main_stream, main_stream[1:]):  # back to back, or after the wait
        assert after.start_s >= before.end_s
    assert sum(e.name == "aten::mul_.Tensor" or e.name.startswith("aten::mul") for e in plain) == 1
    assert tl.get_timeline(x.device.index).now(plain[-1].stream) == plain[-1].end_s
