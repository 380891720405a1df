"""A neuron generator drives host ops too: code written for Neuron draws noise on the host with
the device's generator (diffusers' randn_tensor does), and gets the device stream's numbers."""
import torch


def test_host_factory_with_a_neuron_generator_draws_the_device_stream():
    g = torch.Generator("neuron").manual_seed(0)
    cpu = torch.Generator().manual_seed(0)
    for _ in range(2):  # the generator's state advances as the CPU generator's does
        x = torch.randn(3, 4, generator=g, device="cpu")
        assert x.device.type == "cpu"
        torch.testing.assert_close(x, torch.randn(3, 4, generator=cpu), rtol=0, atol=0)
    # the next device draw continues the same stream
    torch.testing.assert_close(torch.randn(5, generator=g, device="neuron").cpu(),
                               torch.randn(5, generator=cpu), rtol=0, atol=0)


def test_in_place_and_integer_host_ops_with_a_neuron_generator():
    g, cpu = torch.Generator("neuron").manual_seed(3), torch.Generator().manual_seed(3)
    x = torch.empty(6)
    assert x.normal_(generator=g) is x and x.device.type == "cpu"
    torch.testing.assert_close(x, torch.empty(6).normal_(generator=cpu), rtol=0, atol=0)
    perm = torch.randperm(10, generator=g)
    assert perm.device.type == "cpu"
    assert torch.equal(perm, torch.randperm(10, generator=cpu))
    scalar = torch.empty(()).uniform_(generator=g)  # 0-dim host tensors too
    assert scalar.device.type == "cpu" and scalar == torch.empty(()).uniform_(generator=cpu)
