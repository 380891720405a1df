"""Self-consistency: the same small configuration planned, and run for real on this host.

`measure(config, mesh, seq, ranks)` runs the step the planner traces (step.py's `DecoderLoss`,
build.py's `parallelize`, AdamW) on `ranks` processes of the real `neuron` backend
(`torchneuron.distributed.spawn`) with real weights and data, and returns the modeled device
time of one step (one micro-batch and the optimizer, after a warm-up step) from the device
timeline of rank 0. `compare(...)` plans the same configuration on as many logical cores of one
node (the software NeuronCore is one physical core: LNC=1) and returns both times.
"""
from __future__ import annotations

import torch

from torchneuron.planner.build import ModelSource, ParallelSpec


def _rank_step(config: ModelSource, spec: ParallelSpec, seq: int, dtype_name: str) -> float:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from torchneuron.hardware.timeline import flush_pending, get_timeline
    from torchneuron.planner.build import Zero1, load_config, parallelize
    from torchneuron.planner.step import DecoderLoss, run_micro_batch
    from torchneuron.planner.world import mesh as make_mesh

    dist.init_process_group("neuron")
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    device = torch.device("neuron", torch.neuron.current_device())
    model = AutoModelForCausalLM.from_config(load_config(config), attn_implementation="sdpa")
    model = model.to(device=device, dtype=torch.float32 if spec.fsdp > 1 else dtype)
    device_mesh = make_mesh({"pp": spec.pp, "dp": spec.dp, "fsdp": spec.fsdp, "tp": spec.tp})
    root = parallelize(model, device_mesh, spec, dtype, root=DecoderLoss(model, spec.tp > 1))
    if spec.fsdp > 1:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    else:
        optimizer = Zero1(list(model.parameters()), device_mesh["dp"].get_group() if spec.dp > 1 else None)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)

    def step() -> None:
        run_micro_batch(root, ids)
        optimizer.step()
        optimizer.zero_grad()

    timeline = get_timeline(device.index)

    def now() -> float:  # every issued piece of work charged, all streams joined
        torch.neuron.synchronize()
        flush_pending()
        return timeline.synchronize()

    step()  # warm-up, as the planner does
    start = now()
    step()
    return now() - start


def measure(config: ModelSource, mesh: dict[str, int], seq: int, ranks: int, dtype: str = "bfloat16") -> float:
    """Modeled step seconds of the real run on `ranks` software NeuronCores (rank 0's timeline)."""
    from torchneuron.distributed import spawn

    spec = ParallelSpec(tp=mesh.get("tp", 1), fsdp=mesh.get("fsdp", 1), dp=mesh.get("dp", 1))
    times = spawn(_rank_step, ranks, (config, spec, seq, dtype), timeout=300,
                  env={"TORCHNEURON_TARGET": "trn2", "TORCHNEURON_DEVICE_COUNT": str(ranks)})
    return times[0]


def compare(config: ModelSource, mesh: dict[str, int], seq: int, ranks: int) -> tuple[float, float]:
    """(planned, measured) modeled step seconds of one micro-batch and the optimizer."""
    from torchneuron.planner.training import plan

    planned = plan(config, mesh, target="trn2", nodes=1, lnc=1, ranks=ranks, batch=ranks // mesh.get("tp", 1),
                   seq=seq, mode="eager")
    return planned.step_s, measure(config, mesh, seq, ranks)
