"""plan(): the report of a real (tiny and full-size) configuration, modes, errors, and the CLI."""
import json

import pytest

from torchneuron.cli import main
from torchneuron.planner import plan

from tests.planner.conftest import TINY


def test_report_shows_every_section(tiny_config):
    report = plan(tiny_config, {"tp": 2, "fsdp": 2}, target="trn2", nodes=1, ranks=4, batch=4, seq=64,
                  checkpointing=True)
    text = str(report)
    for needle in ("step time", "tokens/s", "MFU", "memory per NeuronCore", "exposed communication",
                   "bottlenecks:", "assumptions:", "EFA 3200 Gbps", "tp=2 (+sequence parallel) fsdp=2"):
        assert needle in text, needle
    assert report.step_s > 0 and report.tokens_per_s == pytest.approx(4 * 64 / report.step_s)
    assert report.totals.comm_s > 0 and 0 < report.hfu < 1
    assert report.memory.fits


def test_modes_differ_as_their_kernels_do(tiny_config):
    kwargs = dict(target="trn2", nodes=1, ranks=2, batch=2, seq=64)
    eager = plan(tiny_config, {"fsdp": 2}, mode="eager", **kwargs)
    compiled = plan(tiny_config, {"fsdp": 2}, mode="compiled", **kwargs)
    assert compiled.totals.kernels < eager.totals.kernels
    assert compiled.step_s < eager.step_s
    assert compiled.totals.flops == pytest.approx(eager.totals.flops, rel=0.05)


def test_bad_layouts_name_the_cause(tiny_config):
    with pytest.raises(ValueError, match="does not divide the 64 ranks"):
        plan(tiny_config, {"tp": 3}, nodes=1, batch=64, seq=64)
    with pytest.raises(ValueError, match="global batch"):
        plan(tiny_config, {"tp": 4}, nodes=1, batch=3, seq=64)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        plan("no-such-config.json", {}, nodes=1, ranks=1, batch=1, seq=8)


@pytest.mark.slow
def test_a_model_too_big_for_its_cores_says_what_would_fit(tmp_path):
    big = dict(TINY, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256)
    path = tmp_path / "llama-8b.json"
    path.write_text(json.dumps(big))
    report = plan(str(path), {"fsdp": 2}, target="trn2", nodes=1, ranks=2, batch=2, seq=32)
    assert report.layers == 32 and report.total_params > 8e9
    assert not report.memory.fits
    verdict = report.memory.verdict()
    assert "does not fit" in verdict and "largest item is optimizer state" in verdict and "--fsdp" in verdict


def test_cli_plan(tiny_config, capsys):
    code = main(["plan", "--model", tiny_config, "--target", "trn2", "--nodes", "1", "--ranks", "2", "--fsdp", "2",
                 "--seq", "32", "--global-batch", "2", "--compile"])
    out = capsys.readouterr().out
    assert code == 0 and "step time" in out and "mode compiled" in out
    assert main(["plan", "--model", tiny_config, "--nodes", "1", "--tp", "3", "--global-batch", "2"]) == 2
    assert "does not divide" in capsys.readouterr().out


def test_a_model_fn_with_its_batch_fn():
    import torch
    import torch.nn as nn

    def model_fn():
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def batch_fn(micro_batch, seq, device):
        return torch.zeros(micro_batch, seq, 64, device=device)

    report = plan(model_fn, {"fsdp": 2}, target="trn2", nodes=1, ranks=2, batch=2, seq=128, batch_fn=batch_fn)
    # forward 2*128*(64*256*2) FLOPs, backward twice that (the first layer's input gradient is not needed)
    assert report.totals.flops >= 2 * 128 * 64 * 256 * 2 * 2
    assert report.step_s > 0 and report.memory.items["parameters"] == (64 * 256 * 2 + 256 + 64) // 2 * 4
    with pytest.raises(ValueError, match="batch_fn"):
        plan(model_fn, {"fsdp": 2}, target="trn2", nodes=1, ranks=2, batch=2, seq=128)


def test_fp8_runs_matmuls_at_the_fp8_rate():
    import torch
    import torch.nn as nn

    def model_fn():
        return nn.Sequential(nn.Linear(1024, 4096, bias=False), nn.Linear(4096, 1024, bias=False))

    def batch_fn(micro_batch, seq, device):
        return torch.zeros(micro_batch, seq, 1024, dtype=torch.bfloat16, device=device)

    kwargs = dict(target="trn2", nodes=1, ranks=1, batch=1, seq=4096, dtype="bf16", batch_fn=batch_fn)
    bf16 = plan(model_fn, {}, **kwargs)
    fp8 = plan(model_fn, {}, fp8=True, **kwargs)
    mm = lambda r: r.totals.by_name["aten::mm"][1]  # noqa: E731
    assert mm(fp8) < 0.75 * mm(bf16)          # the FP8 Tensor-engine rate is twice BF16's on trn2
    assert fp8.peak_flops == 2 * bf16.peak_flops


def test_compiled_graphs_trace_through_tensor_parallel_collectives():
    """DTensor's functional collectives are traced into the compiled graph (no graph break): fewer,
    larger kernels than ending a graph at each, the same FLOPs and collectives, and no slower."""
    import torch

    from torchneuron.planner.build import ParallelSpec
    from torchneuron.planner.cluster import instance, logical_target
    from torchneuron.planner.simulate import Replay, price
    from torchneuron.planner.step import StepSetup, trace_step
    from torchneuron.planner.topology import Topology
    from torchneuron.planner.world import simulated_world

    with simulated_world(2):
        trace = trace_step(StepSetup(dict(TINY), ParallelSpec(tp=2), torch.bfloat16, 1, 64))
    events = trace.micro.events
    assert any(getattr(e, "functional", False) for e in events)
    topology = Topology(instance("trn2"), logical_target("trn2", 2), 1, ranks=2)

    def replayed(traced: bool):
        items = price(events, "compiled", topology.target, topology, traced_collectives=traced)
        replay = Replay()
        replay.run(items)
        return replay.finish()

    through, split = replayed(True), replayed(False)
    assert through.kernels < split.kernels
    assert through.flops == pytest.approx(split.flops, rel=1e-9)
    assert through.comm_s == pytest.approx(split.comm_s, rel=1e-9)
    assert through.step_s < split.step_s
