"""Modeled Trainium time per pipeline component, and the device model's view of the denoiser."""
import pytest
import torch

pytest.importorskip("diffusers")

from torchneuron.examples.tiny_diffusion import build_pipeline  # noqa: E402
from torchneuron.hardware import estimate  # noqa: E402
from torchneuron.serving.diffusion.cost import component_costs  # noqa: E402


def test_component_costs_of_one_step():
    pipe = build_pipeline("unet").to("neuron")
    report = component_costs(pipe, images=2, height=32, width=32, guidance_scale=5.0)
    assert set(report.components) == {"text encoder", "denoiser", "vae decode"}
    denoiser = report.components["denoiser"]
    assert denoiser.calls == 1 and denoiser.device_time_s > 0 and denoiser.flops > 0
    assert 0 < denoiser.mfu < 1
    assert report.components["text encoder"].calls == 2  # CFG: prompts and negatives encoded apart
    one, many = report.per_image_s(1), report.per_image_s(50)
    assert many - one == pytest.approx(49 * denoiser.device_time_s / 2)  # the denoiser runs once a step
    assert "denoiser" in str(report)


def test_denoiser_attention_is_the_fused_kernel_and_convs_are_matmuls():
    pipe = build_pipeline("unet").to("neuron")
    x = torch.randn(2, 4, 16, 16).to("neuron")
    text = torch.randn(2, 8, 32).to("neuron")
    with torch.no_grad(), estimate("trn2") as report:
        pipe.unet(x, torch.tensor([10, 10]).to("neuron"), encoder_hidden_states=text)
    rows = {row.name: row for row in report.per_op}
    attention = [name for name in rows if "scaled_dot_product" in name]
    assert attention and all("math" not in name for name in attention), sorted(rows)
    assert all(rows[name].engine == "tensor" for name in attention)
    convs = [row for name, row in rows.items() if "convolution" in name]
    assert convs and all(row.engine == "tensor" and row.flops > 0 for row in convs)
    norms = [row for name, row in rows.items() if "group_norm" in name]
    assert norms and all(row.engine in ("vector", "scalar") for row in norms)
