"""One fine-tuning step of a UNet and of a DiT (noise-prediction loss, AdamW) on neuron equals CPU:
loss, gradients and updated weights bit for bit in fp32."""
import copy

import pytest
import torch

pytest.importorskip("diffusers")

from torchneuron.examples.tiny_diffusion import build_pipeline  # noqa: E402


def fine_tune_step(denoiser: torch.nn.Module, scheduler, device: str, text_dim: int, is_unet: bool) -> tuple:
    """DDPM training: noise the latents at random timesteps, predict the noise, MSE, AdamW."""
    model = copy.deepcopy(denoiser).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 16, 16, generator=gen)
    noise = torch.randn(latents.shape, generator=gen)
    timesteps = torch.randint(0, 1000, (2,), generator=gen)
    text = torch.randn(2, 8, text_dim, generator=gen)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    noisy, timesteps, text, noise = (t.to(device) for t in (noisy, timesteps, text, noise))
    if is_unet:
        pred = model(noisy, timesteps, encoder_hidden_states=text).sample
    else:
        pred = model(noisy, encoder_hidden_states=text, timestep=timesteps,
                     added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
        pred = pred.chunk(2, dim=1)[0]  # learned sigma: the first half is the noise prediction
    loss = torch.nn.functional.mse_loss(pred, noise)
    loss.backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return loss.item(), grads, params


@pytest.mark.parametrize("kind", ["unet", "dit"])
def test_fine_tune_step_matches_cpu(kind):
    pipe = build_pipeline(kind)
    is_unet = kind == "unet"
    denoiser = pipe.unet if is_unet else pipe.transformer
    text_dim = 32
    ref_loss, ref_grads, ref_params = fine_tune_step(denoiser, pipe.scheduler, "cpu", text_dim, is_unet)
    loss, grads, params = fine_tune_step(denoiser, pipe.scheduler, "neuron", text_dim, is_unet)
    assert loss == ref_loss
    assert sum(g.abs().sum() for g in grads.values()) > 0
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=0, atol=0, msg=name)
    moved = [n for n in ref_params if not torch.equal(ref_params[n], dict(denoiser.named_parameters())[n].detach())]
    assert len(moved) > len(ref_params) // 2  # the step updated the weights
