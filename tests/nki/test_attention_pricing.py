"""Attention ops are charged their NKI flash-attention kernels' simulated latency
(torchneuron.kernels.pricing): the performance model's attention pricer, the extension of
short timing-only runs to long problems, the formula where the kernel takes no such shape, and
an eager SDPA on `neuron` whose timeline entry carries the kernel's time while its result still
matches CPU."""
import pytest
import torch
import torch.nn.functional as F

from torchneuron.hardware import model
from torchneuron.hardware import timeline as device_timeline
from torchneuron.hardware.targets import TARGETS, get_target
from torchneuron.kernels import pricing

TRN2 = TARGETS["trn2"]
SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu"


def test_sdpa_forward_and_backward_cost_the_kernels_latency():
    q = (torch.bfloat16, (1, 2, 256, 64))
    fwd = model.op_cost(SDPA, [q, q, q], [q], TRN2)
    bwd = model.op_cost(SDPA + "_backward", [q, q, q, q, q], [q, q, q], TRN2)
    assert fwd.duration_s == pricing.kernel_seconds(TRN2, False, 2, 256, 256, 64, torch.bfloat16)
    assert bwd.duration_s == pricing.kernel_seconds(TRN2, True, 2, 256, 256, 64, torch.bfloat16)
    assert fwd.engine == "tensor" and fwd.flops > 0


def test_long_problems_extend_short_runs_within_a_few_percent():
    """Fitted from 1024- and 2048-query runs and a two-head run; checked against simulating
    the whole problem."""
    est = pricing.kernel_seconds(TRN2, False, 2, 2560, 512, 64, torch.bfloat16)
    full = pricing._run(TRN2, False, 2, 2560, 512, 64, torch.bfloat16)
    assert est == pytest.approx(full, rel=0.05)


def test_shapes_the_kernel_does_not_take_keep_the_formula():
    q = (torch.bfloat16, (1, 2, 256, 256))  # head dim over 128
    assert pricing.attention_seconds(TRN2, "_scaled_dot_product_flash_attention_for_cpu", [q, q, q], [q]) is None
    model.register_kernel_pricer("attention", None)
    try:
        formula = model.op_cost(SDPA, [q, q, q], [q], TRN2)
    finally:
        pricing.install()
    assert model.op_cost(SDPA, [q, q, q], [q], TRN2).duration_s == formula.duration_s


def test_eager_sdpa_on_neuron_is_charged_the_kernel_time_and_matches_cpu():
    q = torch.randn(1, 2, 256, 64)
    entries = []
    device_timeline.add_listener(entries.append)
    try:
        out = F.scaled_dot_product_attention(*(q.to("neuron"),) * 3, is_causal=True)
        torch.neuron.synchronize()
        device_timeline.flush_pending()
    finally:
        device_timeline.remove_listener(entries.append)
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    want = pricing.kernel_seconds(get_target(), False, 2, 256, 256, 64, torch.float32) + model.launch_cost()
    attn = [e for e in entries if "attention" in e.name]
    assert attn, [e.name for e in entries]
    assert any(e.cost.duration_s == pytest.approx(want) for e in attn), [(e.name, e.cost) for e in attn]
