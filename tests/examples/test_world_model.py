"""The Dreamer-style world model example (torchneuron/examples/world_model.py) trains on neuron as on
the CPU: the same losses, parameters and gradients; its imagination rollouts agree too."""
import pytest
import torch

from torchneuron.examples.world_model import WorldModel, episodes, train
from torchneuron.hardware import estimate

TOL = dict(rtol=1e-4, atol=1e-5)


def test_world_model_trains_as_on_cpu():
    cpu_model, cpu = train("cpu", steps=3, length=6)
    with estimate("trn2") as modeled:
        model, got = train("neuron", steps=3, length=6)
    for mine, reference in zip(got, cpu):
        for field in ("reconstruction", "reward", "kl", "actor"):
            assert getattr(mine, field) == pytest.approx(getattr(reference, field), rel=1e-4, abs=1e-6)
    assert got[-1].reconstruction < got[0].reconstruction  # it learns the frames
    assert all(step.kl > model.free_nats for step in got)  # the KL term is above the free nats: it trains too
    for (name, p), q in zip(model.named_parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), **TOL, msg=name)
        torch.testing.assert_close(p.grad.cpu(), q.grad, **TOL, msg=name)
    assert modeled.device_time_s > 0 and modeled.flops > 0


def test_imagination_rollout_matches_cpu():
    torch.manual_seed(0)
    model = WorldModel()
    frames, actions, rewards = episodes(2, 6, torch.Generator().manual_seed(3))
    results = []
    for device in ("cpu", "neuron"):
        moved = model.to(device)
        torch.manual_seed(5)
        with torch.no_grad():
            _, h, z = moved.observe(frames.to(device), actions.to(device), rewards.to(device))
            features, imagined = moved.imagine(h[:, -1], z[:, -1], horizon=7)
        results.append((features.cpu(), imagined.cpu()))
    assert results[0][0].shape == (2, 7, 40)
    for mine, reference in zip(results[1], results[0]):
        torch.testing.assert_close(mine, reference, **TOL)
