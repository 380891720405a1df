"""Devices, torch.neuron and torch.accelerator on the neuron device."""
import pytest
import torch


def test_accelerator_is_neuron():
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == torch.neuron.device_count() == 2


def test_tensor_and_module_methods():
    x = torch.arange(6.0).neuron()
    assert x.is_neuron and x.device == torch.device("neuron", 0)
    m = torch.nn.Linear(3, 2).neuron()
    assert m.weight.device.type == "neuron"
    assert torch.equal(x.cpu(), torch.arange(6.0))


def test_set_device_and_guard():
    assert torch.neuron.current_device() == 0
    with torch.neuron.device(1):
        assert torch.neuron.current_device() == 1
        assert torch.empty(2, device="neuron").device.index == 1
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device("neuron:1")
    try:
        assert torch.accelerator.current_device_index() == 1
    finally:
        torch.neuron.set_device(0)


def test_copies_between_devices():
    x = torch.randn(4, 5, device="neuron:0")
    y = x.to("neuron:1")
    assert y.device.index == 1 and torch.equal(y.cpu(), x.cpu())
    z = y * 2
    assert z.device.index == 1


def test_invalid_device_index_is_a_clear_error():
    # RuntimeError, as CUDA raises for an ordinal past its devices (not IndexError, not a new type)
    with pytest.raises(RuntimeError, match="Invalid device index neuron:7: device index is out of range"):
        torch.empty(2, device="neuron:7")
    for call in (lambda: torch.neuron.set_device(9), lambda: torch.neuron.get_device_properties(9),
                 lambda: torch.accelerator.set_device_index(9), lambda: torch.ones(2).to("neuron:5")):
        with pytest.raises(RuntimeError, match="out of range") as info:
            call()
        assert not isinstance(info.value, IndexError)
    assert torch.ones(2, device="neuron").sum().item() == 2  # still usable


def test_mixing_devices_names_both():
    a = torch.ones(3, device="neuron")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*neuron:0 and cpu"):
        a + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.mm(torch.ones(2, 2, device="neuron"), torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="neuron:0 and neuron:1"):
        a + torch.ones(3, device="neuron:1")
    assert (a + torch.tensor(2.0)).sum().item() == 9  # CPU scalars are allowed, as on CUDA


def test_properties_report_target():
    props = torch.neuron.get_device_properties(0)
    assert props.target in ("trn1", "trn2", "trn3")
    assert props.core_type.startswith("NeuronCore-v")
    assert props.total_memory > 0
    assert "NeuronCore" in torch.neuron.get_device_name()


def test_torch_neuronx_alias():
    import torch_neuronx

    assert torch_neuronx.get_target().name in ("trn1", "trn2", "trn3")


def test_host_view_is_a_zero_copy_ordinary_cpu_tensor():
    from torchneuron.runtime import host_view

    x = torch.zeros(2, 3, device="neuron")
    h = host_view(x[:, 1:])
    assert h.device.type == "cpu" and not h.is_inference() and h.shape == (2, 2)
    h.add_(5)  # in place, outside inference mode
    assert x.cpu().tolist() == [[0, 5, 5], [0, 5, 5]]


def test_module_to_keeps_parameter_identity_and_ties():
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight  # tied, as in GPT-2
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    weight = emb.weight
    model.to("neuron")
    assert model["emb"].weight is weight and model["head"].weight is weight  # as on CUDA
    assert weight.device.type == "neuron"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_with_a_composite_kernel_run_the_cpu_kernel(dtype):
    """native_layer_norm, native_group_norm and addr have CPU kernels and CompositeExplicitAutograd
    ones; the composite would win over the device's fallback and round differently. The device
    gives the CPU kernel's bits, statistics' dtype included (but for half-precision layer norm)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=g, dtype=dtype) for shape in ((8, 8, 6), (8,), (8,)))
    m = torch.randn(8, 6, generator=g, dtype=dtype)
    calls = {
        "group_norm": lambda x, w, b, m: torch.native_group_norm(x, w, b, 8, 8, 6, 2, 1e-5),
        "addr": lambda x, w, b, m: (torch.addr(m, w, b[:6], beta=0.5, alpha=2.0),),
    }
    for name, call in calls.items():
        want = call(x, w, b, m)
        got = call(*(t.to("neuron") for t in (x, w, b, m)))
        for expected, actual in zip(want, got):
            assert actual.device.type == "neuron" and actual.dtype == expected.dtype, name
            torch.testing.assert_close(actual.cpu(), expected, atol=0, rtol=0, msg=name)
    if dtype == torch.float32:  # (half-precision layer norm: the next test)
        want = torch.native_layer_norm(x, [6], w[:6], b[:6], 1e-5)
        got = torch.native_layer_norm(x.to("neuron"), [6], w[:6].to("neuron"), b[:6].to("neuron"), 1e-5)
        for expected, actual in zip(want, got):
            torch.testing.assert_close(actual.cpu(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_layer_norm_keeps_float32_statistics(dtype):
    """As on CUDA, and as the meta kernel says: layer norm of half-precision data returns float32
    mean and rstd (the CPU kernel keeps them in the data's dtype). The values are the CPU kernel's:
    the statistics hold its (rounded) values, and output and gradients equal the CPU's."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=g) for shape in ((64, 48), (48,), (48,)))
    grad = torch.randn(64, 48, generator=g).to(dtype)
    x, w, b = (t.to(dtype) for t in (x, w, b))
    out, mean, rstd = torch.native_layer_norm(x.to("neuron"), [48], w.to("neuron"), b.to("neuron"), 1e-5)
    meta = torch.native_layer_norm(x.to("meta"), [48], w.to("meta"), b.to("meta"), 1e-5)
    assert [t.dtype for t in (out, mean, rstd)] == [t.dtype for t in meta] == [dtype, torch.float32, torch.float32]
    want = torch.native_layer_norm(x, [48], w, b, 1e-5)
    torch.testing.assert_close(out.cpu(), want[0], atol=0, rtol=0)
    torch.testing.assert_close(mean.cpu(), want[1].float(), atol=0, rtol=0)
    torch.testing.assert_close(rstd.cpu(), want[2].float(), atol=0, rtol=0)

    def grads(device):
        leaves = [t.detach().to(device).requires_grad_() for t in (x, w, b)]
        torch.nn.functional.layer_norm(leaves[0], [48], leaves[1], leaves[2]).backward(grad.to(device))
        return [t.grad.cpu() for t in leaves]

    for c, n in zip(grads("cpu"), grads("neuron")):
        torch.testing.assert_close(n, c, atol=0, rtol=0)


def test_half_precision_batch_norm_keeps_float32_statistics_and_updates_its_running_ones():
    """As on CUDA and as the meta kernel says: batch norm of bfloat16 data saves float32 mean and
    invstd; the running statistics, bfloat16 like the module, are updated in place."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=g).bfloat16()
    cpu, dev = torch.nn.BatchNorm1d(3).bfloat16(), torch.nn.BatchNorm1d(3).bfloat16().to("neuron")
    args = (cpu.weight.detach(), cpu.bias.detach(), cpu.running_mean.clone(), cpu.running_var.clone())
    out = torch.ops.aten.native_batch_norm(x.to("neuron"), *(t.to("neuron") for t in args), True, 0.1, 1e-5)
    meta = torch.ops.aten.native_batch_norm(x.to("meta"), *(t.to("meta") for t in args), True, 0.1, 1e-5)
    assert [t.dtype for t in out] == [t.dtype for t in meta] == [torch.bfloat16, torch.float32, torch.float32]
    want = torch.ops.aten.native_batch_norm(x, *(t.clone() for t in args), True, 0.1, 1e-5)  # the CPU's values
    torch.testing.assert_close(out[0].cpu(), want[0], atol=0, rtol=0)
    torch.testing.assert_close(out[1].cpu(), want[1].float(), atol=0, rtol=0)

    x_cpu, x_dev = x.clone().requires_grad_(), x.to("neuron").requires_grad_()
    cpu(x_cpu).square().sum().backward()
    dev(x_dev).square().sum().backward()
    for name in ("running_mean", "running_var"):  # updated, within one bfloat16 rounding of the CPU's
        assert not torch.equal(getattr(dev, name).cpu(), getattr(torch.nn.BatchNorm1d(3).bfloat16(), name))
        torch.testing.assert_close(getattr(dev, name).cpu(), getattr(cpu, name), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(x_dev.grad.cpu(), x_cpu.grad, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eval_mode_batch_norm_saves_the_running_statistics_it_used(dtype):
    """As on CUDA and as the meta kernel says (the CPU kernel saves empty tensors): the running mean
    and 1 / sqrt(running var + eps), in the compute dtype."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=g).to(dtype)
    mean, var = torch.rand(3, generator=g).to(dtype), (torch.rand(3, generator=g) + 0.5).to(dtype)
    for op in (lambda *a: torch.ops.aten.native_batch_norm(*a, False, 0.1, 1e-5),
               lambda *a: torch.ops.aten._native_batch_norm_legit_no_training(*a, 0.1, 1e-5)):
        out, saved_mean, saved_invstd = op(*(t.to("neuron") for t in (x, mean, mean, mean, var)))
        meta = op(*(t.to("meta") for t in (x, mean, mean, mean, var)))
        assert [(t.shape, t.dtype) for t in (out, saved_mean, saved_invstd)] == [(t.shape, t.dtype) for t in meta]
        torch.testing.assert_close(saved_mean.cpu(), mean.float(), atol=0, rtol=0)
        torch.testing.assert_close(saved_invstd.cpu(), 1 / torch.sqrt(var.float() + 1e-5), atol=0, rtol=0)
        torch.testing.assert_close(out.cpu(), op(x, mean, mean, mean, var)[0], atol=0, rtol=0)
