"""Streams and events: ordering semantics and modeled timing."""
import torch


def test_streams_and_current_stream():
    default = torch.neuron.current_stream()
    assert default.stream_id == 0 and default == torch.neuron.default_stream()
    s = torch.neuron.Stream()
    assert s.stream_id != 0
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream() == s
        assert torch.accelerator.current_stream() == s
    assert torch.neuron.current_stream() == default
    generic = torch.Stream(device="neuron")
    assert generic.device.type == "neuron"


def test_event_timing_is_modeled_device_time():
    a = torch.randn(512, 512, device="neuron", dtype=torch.bfloat16)
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    for _ in range(4):
        a = a @ a.T / 512
    end.record()
    end.synchronize()
    one = start.elapsed_time(end)
    start.record()
    for _ in range(8):
        a = a @ a.T / 512
    end.record()
    assert one > 0
    assert 1.8 < start.elapsed_time(end) / one < 2.2  # twice the work, twice the modeled time
    assert isinstance(start, torch.neuron.Event) and start.query()


def test_wait_event_joins_streams():
    torch.neuron.synchronize()
    x = torch.randn(1024, 1024, device="neuron")
    side = torch.neuron.Stream()
    begin, done, after = (torch.neuron.Event(enable_timing=True) for _ in range(3))
    begin.record()
    with torch.neuron.stream(side):
        for _ in range(5):
            y = x @ x
        done.record()
    torch.neuron.current_stream().wait_event(done)
    after.record()
    # the default stream did nothing itself, yet its clock moved to the side stream's
    assert abs(begin.elapsed_time(after) - begin.elapsed_time(done)) < 1e-9
    assert begin.elapsed_time(after) > 0
    assert torch.equal(y.cpu(), (x @ x).cpu())


def test_wait_stream_and_record_stream():
    side = torch.neuron.Stream()
    x = torch.ones(4, device="neuron")
    side.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(side):
        y = x * 3
    y.record_stream(side)
    torch.neuron.current_stream().wait_stream(side)
    assert y.sum().item() == 12


def test_timing_requires_enable_timing():
    import pytest

    a, b = torch.neuron.Event(), torch.neuron.Event()
    a.record()
    b.record()
    with pytest.raises((RuntimeError, ValueError), match="enable_timing"):
        a.elapsed_time(b)
