"""Models compiled for neuron match eager on neuron and on the CPU: inference and training
steps with AdamW (MLP, CNN with batch norm, tiny Llama and GPT-2 from transformers configs)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tests.models import GeluMLP, tiny_gpt2, tiny_llama

TOL = dict(atol=2e-5, rtol=2e-5)


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)  # a bias before batch norm has no gradient
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def train_steps(model, batches, loss_fn, compiled: bool, steps: int = 2):
    """Runs AdamW steps; returns the losses and the final parameters (on the CPU)."""
    device = next(model.parameters()).device
    forward = torch.compile(model, backend="neuron") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches[:steps]:
        loss = loss_fn(forward(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return torch.stack(losses), [p.detach().cpu() for p in model.parameters()]


def check_training(base, batches, loss_fn, tol=TOL):
    cpu_losses, cpu_params = train_steps(copy.deepcopy(base), batches, loss_fn, compiled=False)
    eager_losses, eager_params = train_steps(copy.deepcopy(base).to("neuron"), batches, loss_fn, compiled=False)
    losses, params = train_steps(copy.deepcopy(base).to("neuron"), batches, loss_fn, compiled=True)
    torch.testing.assert_close(losses, eager_losses, **tol)
    torch.testing.assert_close(losses, cpu_losses, **tol)
    for p, e, c in zip(params, eager_params, cpu_params):
        torch.testing.assert_close(p, e, **tol)
        torch.testing.assert_close(p, c, **tol)
    assert not torch.equal(params[0], base.state_dict()[next(iter(base.state_dict()))])  # it trained


def test_mlp_inference_and_training():
    torch.manual_seed(0)
    base = GeluMLP(hidden=32)
    x = torch.randn(8, 16)
    model = copy.deepcopy(base).to("neuron").eval()
    with torch.no_grad():
        out = torch.compile(model, backend="neuron")(x.to("neuron"))
    torch.testing.assert_close(out.cpu(), base(x), **TOL)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(2)]
    check_training(base, batches, F.cross_entropy)


def test_cnn_training_updates_batchnorm_buffers_and_matches():
    torch.manual_seed(0)
    base = CNN()
    batches = [(torch.randn(4, 3, 12, 12), torch.randint(0, 5, (4,))) for _ in range(2)]
    check_training(base, batches, F.cross_entropy, tol=dict(atol=1e-4, rtol=1e-4))
    eager, compiled = copy.deepcopy(base).to("neuron"), copy.deepcopy(base).to("neuron")
    x = batches[0][0].to("neuron")
    eager(x)
    torch.compile(compiled, backend="neuron")(x)
    torch.testing.assert_close(compiled.bn.running_mean, eager.bn.running_mean, **TOL)
    torch.testing.assert_close(compiled.bn.running_var, eager.bn.running_var, **TOL)
    assert int(compiled.bn.num_batches_tracked) == 1


def _to_neuron(model):
    moved = copy.deepcopy(model).to("neuron")
    moved.tie_weights()  # Module.to() re-creates parameters on a new device type: re-tie the embeddings
    return moved


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tiny_transformer_training_step(kind):
    torch.manual_seed(0)
    base = tiny_llama() if kind == "llama" else tiny_gpt2()
    ids = [torch.randint(0, 128, (2, 16)) for _ in range(2)]

    def run(model, compiled):
        forward = torch.compile(model, backend="neuron") if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for batch in ids:
            batch = batch.to(next(model.parameters()).device)
            loss = forward(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
        return torch.stack(losses), {n: p.detach().cpu() for n, p in model.named_parameters()}

    cpu_losses, cpu_params = run(copy.deepcopy(base), compiled=False)
    eager_losses, eager_params = run(_to_neuron(base), compiled=False)
    losses, params = run(_to_neuron(base), compiled=True)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(losses, eager_losses, **tol)
    torch.testing.assert_close(losses, cpu_losses, **tol)
    for name, value in params.items():
        torch.testing.assert_close(value, eager_params[name], **tol, msg=name)
        torch.testing.assert_close(value, cpu_params[name], **tol, msg=name)
