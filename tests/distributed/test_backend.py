"""The backend in this process (a one-rank group): registration, device choice, local errors."""
import pytest
import torch
import torch.distributed as dist

from torchneuron.distributed import NeuronProcessGroup, free_port, local_device

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_neuron_is_the_default_backend_of_the_neuron_device():
    assert dist.get_default_backend_for_device("neuron") == "neuron"
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # untouched


def test_local_device_shares_cores_round_robin(monkeypatch):
    count = torch.neuron.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(count + 1))
    assert local_device() == torch.device("neuron", 1 % count)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert local_device() == torch.device("neuron", 0)


def test_group_is_the_neuron_process_group(one_rank_group):
    assert isinstance(one_rank_group, NeuronProcessGroup)
    assert one_rank_group.name() == "neuron"
    t = torch.arange(3.0, device="neuron")
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.cpu().tolist() == [0.0, 1.0, 2.0]
    cpu = torch.ones(2)  # CPU tensors are accepted (object collectives use them)
    dist.all_reduce(cpu)
    assert cpu.tolist() == [1.0, 1.0]


def test_init_with_a_device_id():
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("neuron", 0))
    try:
        objects = [None]
        dist.all_gather_object(objects, {"a": 1})
        assert objects == [{"a": 1}]
        assert dist.distributed_c10d._get_object_coll_device() == "cpu"
    finally:
        dist.destroy_process_group()


def test_tensor_on_a_wrong_device_is_a_clear_error(one_rank_group):
    with pytest.raises(ValueError, match="got a tensor on meta.*move it with .to\\('neuron'\\)"):
        dist.all_reduce(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match="mixes neuron and CPU tensors"):
        dist.all_gather_into_tensor(torch.empty(2), torch.ones(2, device="neuron"))


def test_neuron_tensor_in_a_gloo_group_is_a_clear_error(one_rank_group):
    gloo = dist.new_group(backend="gloo")
    with pytest.raises(RuntimeError, match="create the group with backend 'neuron'"):
        dist.all_reduce(torch.ones(2, device="neuron"), group=gloo)


def test_unsupported_reduction_is_a_clear_error(one_rank_group):
    with pytest.raises(TypeError, match="cannot reduce torch.uint64"):
        dist.all_reduce(torch.ones(2, dtype=torch.uint64, device="neuron"))


def test_init_without_master_addr_is_a_clear_error(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        dist.init_process_group("neuron", rank=0, world_size=1)
    assert not dist.is_initialized()
