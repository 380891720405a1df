"""torchtitan 0.3.0's Llama-3 debug model (FlexAttention, selective activation checkpointing) trained
by torchtitan's own trainer under torchrun on 2 neuron ranks with FSDP2 and TP: each run's losses
and gradient norms equal the same run on CPU + gloo; a DCP checkpoint saved by 2 FSDP2 ranks resumes
on 1 rank (neuron and CPU resume to the same loss); the loss compiled with backend "neuron" equals
the eager CPU run. Every run starts from one seed checkpoint."""
from __future__ import annotations

import shutil

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

from torchneuron.examples import torchtitan_llama  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

FSDP = ["--parallelism.data_parallel_shard_degree", "2"]
TP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
# No PP: torchtitan 0.3.0 calls `schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)`, an API of
# PyTorch after 2.13, whose schedules take whole batches and split them again ("Expecting 2 arg_mbs
# but got 1") on any device.


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("torchtitan")


def run(folder, name, device, nproc, args):
    return torchtitan_llama.launch(nproc, args, device=device, dump=folder / f"{name}_{device}",
                                   assets=folder / "assets")


def assert_same_losses(neuron, cpu):
    assert [r["step"] for r in neuron] == [r["step"] for r in cpu] and neuron
    for n, c in zip(neuron, cpu):
        # bf16 parameters (FSDP2's mixed precision) round a few ULPs apart after the first update
        assert n["loss"] == pytest.approx(c["loss"], rel=1e-4), (neuron, cpu)
        assert n["grad_norm"] == pytest.approx(c["grad_norm"], rel=1e-3), (neuron, cpu)


@pytest.mark.parametrize("name,args", [("fsdp", FSDP), ("tp", TP)], ids=["fsdp", "tp"])
def test_two_ranks_match_cpu_gloo(folder, name, args):
    neuron = run(folder, name, "neuron", 2, args)
    assert [r["step"] for r in neuron] == [1, 2]
    assert_same_losses(neuron, run(folder, name, "cpu", 2, args))


def test_dcp_checkpoint_of_two_ranks_resumes_on_one(folder):
    """2 FSDP2 ranks save step 2 (model, optimizer, schedule); 1 rank loads it (the dataloader's
    per-rank state cannot reshard, torchtitan refuses it, so it is left out) and trains step 3."""
    saved = folder / "fsdp_neuron" / "checkpoint" / "step-2"
    if not saved.exists():
        run(folder, "fsdp", "neuron", 2, FSDP)
    resume = ["--training.steps", "3", "--checkpoint.exclude_from_loading", "dataloader",
              "--parallelism.data_parallel_shard_degree", "1"]
    losses = {}
    for device in ("neuron", "cpu"):
        dump = folder / f"resume_{device}"
        shutil.copytree(saved, dump / "checkpoint" / "step-2")
        losses[device] = torchtitan_llama.launch(1, resume, device=device, dump=dump, assets=folder / "assets")
    assert [r["step"] for r in losses["neuron"]] == [3]
    assert_same_losses(losses["neuron"], losses["cpu"])


def test_compiled_loss_backend_neuron_matches_cpu_eager(folder):
    """torchtitan's compile option with backend "neuron" on the loss (the FlexAttention model's
    blocks: torchtitan accepts only "inductor"/"aot_eager" for them) equals the eager CPU run."""
    compiled = run(folder, "compiled", "neuron", 2,
                   FSDP + ["--compile.enable", "--compile.components", "loss", "--compile.backend", "neuron"])
    cpu_dump = folder / "fsdp_cpu"
    cpu = torchtitan_llama.read_losses(cpu_dump) if cpu_dump.exists() else run(folder, "fsdp", "cpu", 2, FSDP)
    assert_same_losses(compiled, cpu)
