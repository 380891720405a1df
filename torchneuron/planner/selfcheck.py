"""Self-consistency: the same small configuration planned, and run for real on this host.

`measure(config, mesh, seq, ranks)` runs the step the planner traces (step.py's `DecoderLoss`,
build.py's `parallelize`, AdamW) on `ranks` processes of the real `neuron` backend
(`torchneuron.distributed.spawn`) with real weights and data, and returns the modeled device
time of one step (one micro-batch and the optimizer, after a warm-up step) from the device
timelines. Every rank starts the measured step at the same modeled time (the latest of their
clocks), and the step ends when the last rank's optimizer does: with pipeline parallelism
(pipeline.py's stages and schedule, run on the real backend, whose transfers carry the sender's
modeled time) the later stages wait for the earlier ones as in the plan. `compare(...)` plans the
same configuration on as many logical cores of one node (the software NeuronCore is one physical
core: LNC=1) and returns both times.
"""
from __future__ import annotations

import torch

from torchneuron.planner.build import ModelSource, ParallelSpec


def _rank_step(config: ModelSource, spec: ParallelSpec, seq: int, dtype_name: str, micro_batches: int) -> float:
    import dataclasses
    from contextlib import nullcontext

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from torchneuron.hardware.timeline import flush_pending, get_timeline
    from torchneuron.planner.build import Zero1, load_config, parallelize
    from torchneuron.planner.pipeline import StageRun
    from torchneuron.planner.step import DecoderLoss, run_micro_batch
    from torchneuron.planner.world import mesh as make_mesh

    dist.init_process_group("neuron")
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    device = torch.device("neuron", torch.neuron.current_device())
    model = AutoModelForCausalLM.from_config(load_config(config), attn_implementation="sdpa")
    model = model.to(device=device, dtype=torch.float32 if spec.fsdp > 1 else dtype)
    device_mesh = make_mesh({"pp": spec.pp, "dp": spec.dp, "fsdp": spec.fsdp, "tp": spec.tp})
    ids = torch.randint(0, model.config.vocab_size, (micro_batches, seq), device=device)
    if spec.pp > 1:  # as step.trace_step builds the traced stages
        parallelize(model, device_mesh, dataclasses.replace(spec, fsdp=1), dtype)
        stages = StageRun(model, device_mesh, spec, seq, 1, dtype, device, nullcontext(), micro_batches,
                          simulated=False, whole_model=True)
        parallelize(model, device_mesh, dataclasses.replace(spec, tp=1, checkpointing=False), dtype,
                    root=stages.modules)
        stages.build(dtype)
        params = [p for module in stages.modules for p in module.parameters()]
        run = lambda: stages.step(None, ids)  # noqa: E731
    else:
        root = parallelize(model, device_mesh, spec, dtype, root=DecoderLoss(model, spec.tp > 1))
        params = list(model.parameters())
        run = lambda: [run_micro_batch(root, ids[i:i + 1]) for i in range(micro_batches)]  # noqa: E731
    if spec.fsdp > 1:
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    else:
        optimizer = Zero1(params, device_mesh["dp"].get_group() if spec.dp > 1 else None)

    def step() -> None:
        run()
        optimizer.step()
        optimizer.zero_grad()

    timeline = get_timeline(device.index)

    def now() -> float:  # every issued piece of work charged, all streams joined
        torch.neuron.synchronize()
        flush_pending()
        return timeline.synchronize()

    step()  # warm-up, as the planner does
    latest = torch.tensor([now()], dtype=torch.float64)
    dist.all_reduce(latest, op=dist.ReduceOp.MAX)  # a CPU tensor: not charged
    timeline.wait_until(torch.neuron.current_stream(device).stream_id, float(latest[0]))
    start = now()
    step()
    return now() - start


def measure(config: ModelSource, mesh: dict[str, int], seq: int, ranks: int, dtype: str = "bfloat16",
            micro_batches: int = 1, schedule: str = "1f1b") -> float:
    """Modeled step seconds of the real run on `ranks` software NeuronCores: from the common start
    to the end of the last rank's step."""
    from torchneuron.distributed import spawn

    spec = ParallelSpec(tp=mesh.get("tp", 1), fsdp=mesh.get("fsdp", 1), dp=mesh.get("dp", 1), pp=mesh.get("pp", 1),
                        sequence_parallel=mesh.get("tp", 1) > 1, schedule=schedule)
    times = spawn(_rank_step, ranks, (config, spec, seq, dtype, micro_batches), timeout=300,
                  env={"TORCHNEURON_TARGET": "trn2", "TORCHNEURON_DEVICE_COUNT": str(ranks)})
    return max(times)


def compare(config: ModelSource, mesh: dict[str, int], seq: int, ranks: int, micro_batches: int = 1,
            schedule: str = "1f1b") -> tuple[float, float]:
    """(planned, measured) modeled step seconds of `micro_batches` micro-batches of one sequence
    per data-parallel rank and the optimizer."""
    from torchneuron.planner.training import plan

    replicas = ranks // (mesh.get("tp", 1) * mesh.get("pp", 1))
    planned = plan(config, mesh, target="trn2", nodes=1, lnc=1, ranks=ranks, batch=replicas * micro_batches,
                   seq=seq, mode="eager", pp_schedule=schedule)
    return planned.step_s, measure(config, mesh, seq, ranks, micro_batches=micro_batches, schedule=schedule)
