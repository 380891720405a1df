"""A world model in the Dreamer style, trained on the neuron device.

This module owns the example: a small latent dynamics model learnt from pixels of a synthetic
environment, then used to imagine. Its parts:

- `Encoder`: a convolutional net from a 16x16 frame to an embedding;
- `RSSM`: the recurrent state-space model, a deterministic GRU state `h` and a stochastic
  Gaussian state `z` with a prior p(z | h) and a posterior q(z | h, embedding);
- `Decoder`: transposed convolutions from (h, z) back to the frame, and a reward head;
- `imagine`: a rollout of the prior from posterior states under a small actor, whose imagined
  rewards train the actor (gradients flow through the learnt dynamics, as in Dreamer v1).

The environment is a dot moving on a 16x16 board by the actions taken; the reward is its
negative distance to the centre. Episodes are drawn on the host from a seeded generator, the
latent samples from the device's generator (the same numbers as the CPU's for the same seed),
so a run on neuron gives the CPU's losses.

    python -m torchneuron.examples.world_model --steps 20
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["WorldModel", "episodes", "main", "train"]

SIZE, ACTIONS = 16, 2


def episodes(batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Frames (batch, length, 1, 16, 16), actions (batch, length, 2) and rewards (batch, length) of the dot world."""
    position = torch.rand(batch, 2, generator=generator) * (SIZE - 1)
    actions = torch.rand(batch, length, ACTIONS, generator=generator) * 2 - 1
    grid = torch.arange(SIZE, dtype=torch.float32)
    frames, rewards = [], []
    for t in range(length):
        position = (position + actions[:, t]).clamp(0, SIZE - 1)
        dy = (grid.view(1, SIZE, 1) - position[:, 0].view(-1, 1, 1)) ** 2
        dx = (grid.view(1, 1, SIZE) - position[:, 1].view(-1, 1, 1)) ** 2
        frames.append(torch.exp(-(dx + dy) / 2.0).unsqueeze(1))
        rewards.append(-(position - (SIZE - 1) / 2).norm(dim=-1) / SIZE)
    return torch.stack(frames, 1), actions, torch.stack(rewards, 1)


class Encoder(nn.Module):
    def __init__(self, embed: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 4, stride=2, padding=1), nn.Conv2d(8, 16, 4, stride=2, padding=1)
        self.out = nn.Linear(16 * 4 * 4, embed)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = F.elu(self.conv2(F.elu(self.conv1(frames))))
        return self.out(x.flatten(1))


class Decoder(nn.Module):
    def __init__(self, state: int) -> None:
        super().__init__()
        self.inp = nn.Linear(state, 16 * 4 * 4)
        self.deconv1 = nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1)
        self.deconv2 = nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1)
        self.reward = nn.Sequential(nn.Linear(state, 32), nn.ELU(), nn.Linear(32, 1))

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.elu(self.inp(features)).view(-1, 16, 4, 4)
        return self.deconv2(F.elu(self.deconv1(x))), self.reward(features).squeeze(-1)


class RSSM(nn.Module):
    """h' = GRU(h, [z, a]); prior z' ~ N(f(h')); posterior z' ~ N(g(h', embedding))."""

    def __init__(self, deter: int, stoch: int, embed: int) -> None:
        super().__init__()
        self.deter, self.stoch = deter, stoch
        self.inp = nn.Linear(stoch + ACTIONS, deter)
        self.cell = nn.GRUCell(deter, deter)
        self.prior = nn.Sequential(nn.Linear(deter, deter), nn.ELU(), nn.Linear(deter, 2 * stoch))
        self.posterior = nn.Sequential(nn.Linear(deter + embed, deter), nn.ELU(), nn.Linear(deter, 2 * stoch))

    @staticmethod
    def _gaussian(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, raw = stats.chunk(2, dim=-1)
        std = F.softplus(raw) + 0.1
        return mean, std, mean + std * torch.randn_like(std)  # a reparameterised sample

    def step(self, h: torch.Tensor, z: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.cell(F.elu(self.inp(torch.cat([z, action], -1))), h)

    def prior_sample(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._gaussian(self.prior(h))

    def posterior_sample(self, h: torch.Tensor, embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._gaussian(self.posterior(torch.cat([h, embedding], -1)))


def _kl(mean_q: torch.Tensor, std_q: torch.Tensor, mean_p: torch.Tensor, std_p: torch.Tensor) -> torch.Tensor:
    """KL(q || p) of diagonal Gaussians, summed over the latent dimensions."""
    return (torch.log(std_p / std_q) + (std_q ** 2 + (mean_q - mean_p) ** 2) / (2 * std_p ** 2) - 0.5).sum(-1)


@dataclass
class Losses:
    reconstruction: torch.Tensor
    reward: torch.Tensor
    kl: torch.Tensor
    actor: torch.Tensor

    @property
    def model(self) -> torch.Tensor:
        return self.reconstruction + self.reward + self.kl


class WorldModel(nn.Module):
    """Encoder, RSSM, decoder and an actor for imagination."""

    def __init__(self, deter: int = 32, stoch: int = 8, embed: int = 32, free_nats: float = 0.1) -> None:
        super().__init__()
        self.encoder, self.rssm, self.decoder = Encoder(embed), RSSM(deter, stoch, embed), Decoder(deter + stoch)
        self.actor = nn.Sequential(nn.Linear(deter + stoch, 32), nn.ELU(), nn.Linear(32, ACTIONS), nn.Tanh())
        self.free_nats = free_nats

    def observe(self, frames: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor
                ) -> tuple[Losses, torch.Tensor, torch.Tensor]:
        """Filters a batch of episodes through the RSSM; the losses and the posterior states (h, z) of every step."""
        batch, length = frames.shape[:2]
        embeddings = self.encoder(frames.flatten(0, 1)).view(batch, length, -1)
        h = frames.new_zeros(batch, self.rssm.deter)
        z = frames.new_zeros(batch, self.rssm.stoch)
        hs, zs, kls = [], [], []
        for t in range(length):
            h = self.rssm.step(h, z, actions[:, t])
            mean_p, std_p, _ = self.rssm.prior_sample(h)
            mean_q, std_q, z = self.rssm.posterior_sample(h, embeddings[:, t])
            kls.append(_kl(mean_q, std_q, mean_p, std_p))
            hs.append(h)
            zs.append(z)
        h, z = torch.stack(hs, 1), torch.stack(zs, 1)
        frames_hat, rewards_hat = self.decoder(torch.cat([h, z], -1).flatten(0, 1))
        kl = torch.stack(kls, 1).mean().clamp(min=self.free_nats)  # free nats: no pressure below them
        losses = Losses(F.mse_loss(frames_hat, frames.flatten(0, 1), reduction="sum") / (batch * length),
                        F.mse_loss(rewards_hat, rewards.flatten()), kl, frames.new_zeros(()))
        return losses, h, z

    def imagine(self, h: torch.Tensor, z: torch.Tensor, horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rolls the prior `horizon` steps from states (h, z) under the actor: imagined features and rewards."""
        features, rewards = [], []
        for _ in range(horizon):
            action = self.actor(torch.cat([h, z], -1))
            h = self.rssm.step(h, z, action)
            _, _, z = self.rssm.prior_sample(h)
            feature = torch.cat([h, z], -1)
            features.append(feature)
            rewards.append(self.decoder.reward(feature).squeeze(-1))
        return torch.stack(features, 1), torch.stack(rewards, 1)


@dataclass
class Step:
    """One training step's losses (host floats)."""

    reconstruction: float
    reward: float
    kl: float
    actor: float


def train(device: str | torch.device, steps: int = 4, batch: int = 4, length: int = 8, horizon: int = 5,
          seed: int = 0) -> tuple[WorldModel, list[Step]]:
    """Trains a world model (Adam on the model's losses) and its actor (on imagined rewards) on `device`."""
    torch.manual_seed(seed)
    model = WorldModel().to(device)
    torch.manual_seed(seed)  # the latent samples: the device's generator from the seed, as the CPU's after the init
    actor_params = list(model.actor.parameters())
    model_params = [p for n, p in model.named_parameters() if not n.startswith("actor.")]
    model_opt, actor_opt = torch.optim.Adam(model_params, lr=3e-3), torch.optim.Adam(actor_params, lr=1e-3)
    data = torch.Generator().manual_seed(seed + 1)
    history = []
    for _ in range(steps):
        frames, actions, rewards = (t.to(device) for t in episodes(batch, length, data))
        losses, h, z = model.observe(frames, actions, rewards)
        model_opt.zero_grad(set_to_none=True)
        losses.model.backward()
        model_opt.step()
        # imagination from the posterior states (detached: the actor's loss trains the actor only)
        _, imagined = model.imagine(h.flatten(0, 1).detach(), z.flatten(0, 1).detach(), horizon)
        losses.actor = -imagined.mean()
        actor_opt.zero_grad(set_to_none=True)
        losses.actor.backward()
        actor_opt.step()
        history.append(Step(*(v.item() for v in (losses.reconstruction, losses.reward, losses.kl, losses.actor))))
    return model, history


def main(steps: int = 20) -> int:
    from torchneuron.hardware import estimate

    with estimate("trn2") as modeled:
        _, history = train("neuron", steps=steps)
    first, last = history[0], history[-1]
    print(f"world model on neuron, {steps} steps: reconstruction {first.reconstruction:.3f} -> {last.reconstruction:.3f}, "
          f"reward {first.reward:.4f} -> {last.reward:.4f}, imagined return {-first.actor:.4f} -> {-last.actor:.4f}")
    print(f"modeled trn2 device time {modeled.device_time_s / steps * 1e3:.3f} ms/step, MFU {modeled.mfu * 100:.4f}%")
    return 0 if last.reconstruction < first.reconstruction else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="train a Dreamer-style world model on the neuron device")
    parser.add_argument("--steps", type=int, default=20)
    raise SystemExit(main(parser.parse_args().steps))
