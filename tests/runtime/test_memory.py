"""The caching allocator: statistics, capacity, out-of-memory errors."""
import gc

import pytest
import torch

import torchneuron


@pytest.fixture
def quiet_collector():
    """Exact byte counts: no garbage collection may free another test's tensors mid-measurement."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_allocation_statistics_track_tensors(quiet_collector):
    torch.neuron.empty_cache()
    base = torch.neuron.memory_allocated()
    x = torch.empty(1024, 1024, device="neuron")  # 4 MiB
    assert torch.neuron.memory_allocated() - base == 4 * 2**20
    assert torch.accelerator.memory_allocated("neuron") == torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    y = x * 2  # a CPU kernel's result adopted as device memory is counted too
    assert torch.neuron.max_memory_allocated() >= base + 8 * 2**20
    del x, y
    assert torch.neuron.memory_allocated() == base
    stats = torch.neuron.memory_stats()
    assert stats["allocation.all.allocated"] >= 2


def test_cache_and_empty_cache():
    torch.neuron.empty_cache()
    x = torch.empty(256, 1024, device="neuron")
    del x
    reserved = torch.neuron.memory_reserved()
    assert reserved >= 2**20  # the freed block stays cached
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() <= reserved - 2**20
    assert "Allocated memory" in torch.neuron.memory_summary()


def test_out_of_memory_is_clear_and_recoverable():
    keep = torch.arange(10.0, device="neuron")
    old = torch.neuron.mem_get_info()[1]
    torchneuron.set_memory_capacity(64 * 2**20)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 256.00 MiB.*TORCHNEURON_MEMORY_CAPACITY"):
            torch.empty(64, 2**20, device="neuron")
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(40, 2**20, device="neuron") * 2  # the result of a CPU kernel exceeds it too
        assert torch.equal(keep.cpu(), torch.arange(10.0))  # nothing lost
        assert (keep + 1).sum().item() == 55
    finally:
        torchneuron.set_memory_capacity(old)


def test_per_process_memory_fraction_limits_what_the_process_may_reserve():
    """torch.cuda's per-process limit: past fraction * capacity an allocation raises, naming the
    fraction; below it allocations succeed; the device's capacity (mem_get_info) is unchanged."""
    old = torch.neuron.mem_get_info()[1]
    torchneuron.set_memory_capacity(64 * 2**20)
    try:
        assert torch.neuron.get_per_process_memory_fraction() == 1.0
        torch.neuron.set_per_process_memory_fraction(0.25)
        assert torch.neuron.get_per_process_memory_fraction() == 0.25
        small = torch.empty(8, 2**20, dtype=torch.uint8, device="neuron")  # 8 MiB of the 16 MiB allowed
        with pytest.raises(torch.OutOfMemoryError, match="memory fraction set to 0.25"):
            torch.empty(12, 2**20, dtype=torch.uint8, device="neuron")
        assert torch.neuron.mem_get_info()[1] == 64 * 2**20
        torch.neuron.set_per_process_memory_fraction(1.0)
        big = torch.empty(40, 2**20, dtype=torch.uint8, device="neuron")  # fits the whole capacity again
        assert big.numel() + small.numel() == 48 * 2**20
        with pytest.raises(RuntimeError, match="Allowed range: 0~1"):
            torch.neuron.set_per_process_memory_fraction(1.5)
        with pytest.raises(TypeError, match="must be a float"):
            torch.neuron.set_per_process_memory_fraction("half")
    finally:
        torch.neuron.set_per_process_memory_fraction(1.0)
        torchneuron.set_memory_capacity(old)


def test_storage_and_resize():
    s = torch.UntypedStorage(16, device="neuron")
    assert s.device.type == "neuron" and s.nbytes() == 16
    t = torch.zeros(2, device="neuron")
    t.resize_(100)
    t[50] = 3.0
    assert t.shape == (100,) and t[50].item() == 3.0


def test_reading_a_freed_storage_is_a_clear_error():
    x = torch.ones(4, device="neuron")
    x.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="storage was freed or resized"):
        x + 1
    assert (torch.ones(2, device="neuron") * 2).tolist() == [2.0, 2.0]


def test_reset_accumulated_and_peak_stats():
    x = torch.empty(1024, device="neuron")
    torch.neuron.reset_peak_memory_stats()
    peak = torch.neuron.max_memory_allocated()
    del x
    assert torch.neuron.max_memory_allocated() == peak  # the peak outlives the tensor
    torch.neuron.reset_accumulated_memory_stats()
    stats = torch.neuron.memory_stats()
    assert stats["allocation.all.allocated"] == 0 and stats["allocated_bytes.all.freed"] == 0
    y = torch.empty(1024, device="neuron")
    assert torch.neuron.memory_stats()["allocation.all.allocated"] == 1
    del y


def test_the_most_recently_freed_block_is_reused_first():
    # Like a host malloc: the block freed last is the one most likely still in the CPU caches.
    a = torch.empty(4096, device="neuron")
    b = torch.empty(4096, device="neuron")
    pointers = (a.data_ptr(), b.data_ptr())
    del a, b  # b is freed last
    c = torch.empty(4096, device="neuron")
    assert c.data_ptr() == pointers[1]


def test_fast_empty_strided_entry_point():
    from torchneuron.runtime._C import empty_strided

    # The cumulative allocation count, not memory_allocated(): a tensor that the garbage collector
    # frees during the call (another test's cycle) can make the byte count net out unchanged.
    allocations_before = torch.neuron.memory_stats()["allocation.all.allocated"]
    x = empty_strided((8, 4), (1, 8), torch.bfloat16)
    assert x.device == torch.device("neuron", torch.neuron.current_device())
    assert (x.shape, x.stride(), x.dtype) == ((8, 4), (1, 8), torch.bfloat16)
    assert torch.neuron.memory_stats()["allocation.all.allocated"] == allocations_before + 1
    with torch.neuron.device(1):
        assert empty_strided((2,), (1,), torch.float32).device == torch.device("neuron", 1)
    with pytest.raises(TypeError, match="tuple of ints"):
        empty_strided([2], (1,), torch.float32)
    with pytest.raises(ValueError, match="differ in length"):
        empty_strided((2, 2), (1,), torch.float32)
