"""torch.save / torch.load, safetensors, pinned memory and non_blocking copies."""
import io

import torch


def test_save_load_round_trip_keeps_views_and_device():
    base = torch.arange(12.0, device="neuron")
    view = base[2:6]
    buf = io.BytesIO()
    torch.save({"base": base, "view": view}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["base"].device.type == "neuron"
    assert loaded["view"].untyped_storage().data_ptr() == loaded["base"].untyped_storage().data_ptr()
    loaded["view"][0] = -1
    assert loaded["base"][2].item() == -1


def test_map_location_cpu_and_neuron():
    sd = torch.nn.Linear(3, 2).to("neuron").state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert on_cpu["weight"].device.type == "cpu"
    buf2 = io.BytesIO()
    torch.save(on_cpu, buf2)
    buf2.seek(0)
    back = torch.load(buf2, map_location="neuron")
    assert back["weight"].device.type == "neuron"
    assert torch.equal(back["weight"].cpu(), sd["weight"].cpu())


def test_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    t = {"w": torch.randn(3, 4, device="neuron")}
    path = tmp_path / "m.safetensors"
    save_file(t, str(path))  # neuron tensors are read on the host
    loaded = {k: v.to("neuron") for k, v in load_file(str(path)).items()}
    assert loaded["w"].device.type == "neuron"
    assert torch.equal(loaded["w"].cpu(), t["w"].cpu())


def test_pinned_memory_and_non_blocking():
    x = torch.randn(16).pin_memory()
    assert x.is_pinned()
    y = x.to("neuron", non_blocking=True)
    torch.neuron.synchronize()
    assert torch.equal(y.cpu(), x)
