"""Pipeline parallelism, planned with PyTorch's own pipelining code.

Tracing (`StageRun`): the traced rank's decoder stage(s) are `torch.distributed.pipelining.
PipelineStage`s (the first stage holds the embedding, the last the final norm, the output layer
and the loss), driven by a real schedule (`SCHEDULES`: GPipe, 1F1B, interleaved 1F1B) over
micro-batches, exactly as a training script would; its sends and receives of activations and
gradients go through the simulated world's process group, so the trace records them as p2p
events. Every forward and backward the schedule runs is marked as a segment of the trace (an
action of the schedule: kind, stage, micro-batch), the events between two actions belong to the
earlier one (a last stage's loss after its forward, FSDP's gradient reduction after the last
backward), the rest of the step (gradient scaling) is the tail.

One deviation from a real job: the stages' start-up vote (each stage sends the next whether its
shapes are static, the last sends the result back) reads the other ranks' answers, which a
simulated world does not have; every planner stage is given its shapes, so every rank would vote
static, and the planner sets that outcome (`_agree_static`).

The schedule run is traced with few micro-batches (`traced_micro_batches`: the first, a steady
state one and the last differ: FSDP gathers in the first forward and reduces after the last
backward); the step has as many as the plan asks, and every micro-batch in between costs what
the steady-state one did.

Replay (`replay`): the schedule's own `pipeline_order` (every rank's actions, as the schedule
computes them for the whole pipeline) is replayed on one device timeline per pipeline rank: an
action starts when its rank is free and its input has arrived (a forward needs the previous
stage's activation, a backward the next stage's gradient), a send runs on its rank's pipeline
stream at the topology's price, and each rank ends with the tail and its optimizer step. The
bubble is what the dependencies add to the critical rank's own work. Stages the trace does not
hold (the middle ones) cost what the traced first-rank stage does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchneuron.planner.simulate import Item, Replay, Totals
from torchneuron.planner.trace import CollectiveEvent, Tracer

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
_FORWARD, _BACKWARD = "F", "B"


def schedule_class(name: str) -> type:
    """The torch.distributed.pipelining schedule called `name` (see SCHEDULES)."""
    from torch.distributed.pipelining import schedules

    classes = {"gpipe": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B,
               "interleaved1f1b": schedules.ScheduleInterleaved1F1B}
    found = classes.get(name.lower())
    if found is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    return found


def is_multi_stage(name: str) -> bool:
    return name.lower() == "interleaved1f1b"


def traced_micro_batches(schedule: str, pp: int, micro_batches: int) -> int:
    """Micro-batches of the traced schedule run: a first, a steady-state and a last one, and at
    least as many as the schedule needs (1F1B: one per stage)."""
    wanted = max(3, pp) if schedule.lower() != "gpipe" else 3
    return min(micro_batches, wanted)


class DecoderStage(nn.Module):
    """A contiguous run of a transformers decoder's layers, with the embedding on the first stage
    and the final norm and the output layer on the last (the loss is the schedule's `loss_fn`).
    Hidden states travel between stages as this rank's local tensors (sequence-parallel shards
    under tensor parallelism)."""

    def __init__(self, lm: nn.Module, layers: list[nn.Module], first: bool, last: bool, seq: int):
        super().__init__()
        inner = lm.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = getattr(inner, "rotary_emb", None)
        self.norm = inner.norm if last else None
        self.lm_head = lm.lm_head if last else None
        self.seq = seq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(self.seq, device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions) if self.rotary_emb is not None else None
        for layer in self.layers:
            out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.lm_head is None:
            return hidden
        return self.lm_head(self.norm(hidden))


def decoder_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's loss (the schedule's `loss_fn`): cross-entropy over the vocabulary."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _agree_static(stages: list, has_backward: bool, p2p_done: bool) -> None:
    """The outcome of the stages' start-up vote in a world where every stage knows its shapes."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


@dataclass
class Segment:
    """One schedule action of the traced run: events[start:end] of the traced step."""

    kind: str           # "F", "B", "REDUCE_GRAD", ...
    stage: int
    micro_batch: int | None
    start: int
    end: int


@dataclass
class PipelineTrace:
    """What the traced rank's schedule run tells the replay."""

    schedule: str
    num_stages: int
    stages: tuple[int, ...]              # stage indices the traced rank holds
    stage_to_rank: dict[int, int]        # pipeline rank of every stage
    micro_batches: int                   # of the traced run
    segments: list[Segment] = field(default_factory=list)
    tail_start: int = 0                  # events[tail_start:] ran after the last action
    sends: dict[str, int] = field(default_factory=dict)   # "F"/"B" -> bytes a stage sends per action
    in_flight: int = 1                   # micro-batches whose activations the traced rank held at once


class StageRun:
    """The traced rank's pipeline stages and schedule (see the module docstring). `lm` holds this
    rank's layers (`whole_model`: all of them, and the rank takes its stages' share); `modules`
    are its stages' modules (FSDP's roots); `simulated`: in the planner's fake world."""

    def __init__(self, lm: nn.Module, device_mesh, spec, seq: int, micro_batch: int, dtype: torch.dtype,
                 device: torch.device, fake_mode, micro_batches: int, simulated: bool = True,
                 whole_model: bool = False):
        from torch.distributed.pipelining import PipelineStage

        from torchneuron.planner.build import decoder_layers

        self.spec, self.seq, self.micro_batch, self.fake_mode = spec, seq, micro_batch, fake_mode
        self.simulated, self.device = simulated, device
        pp_mesh = device_mesh["pp"]
        self.group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        virtual = spec.virtual_stages if is_multi_stage(spec.schedule) else 1
        self.num_stages = spec.pp * virtual
        indices = [self.pp_rank + k * spec.pp for k in range(virtual)]
        layers = list(decoder_layers(lm))
        # the planner builds only this rank's layers; a real run (selfcheck) builds the whole model
        per_stage = len(layers) // (self.num_stages if whole_model else virtual)
        shard = spec.tp if spec.sequence_parallel and spec.tp > 1 else 1
        self.modules = []
        for k, index in enumerate(indices):
            first = (index if whole_model else k) * per_stage
            chunk = layers[first:first + per_stage]
            self.modules.append(DecoderStage(lm, chunk, index == 0, index == self.num_stages - 1, seq))
        self._make_stage = lambda module, index: PipelineStage(
            module, index, self.num_stages, device, input_args=self._example_input(index, device, shard),
            output_args=self._example_output(lm, index, device, shard), group=self.group)
        self.indices = indices
        self.hidden = lm.config.hidden_size
        self.vocab = lm.config.vocab_size
        self.micro_batches = micro_batches
        self.vocab_parallel = spec.tp > 1
        self.stages: list = []
        self.schedule = None

    def _example_input(self, index: int, device: torch.device, shard: int) -> torch.Tensor:
        with self.fake_mode:
            if index == 0:
                return torch.zeros(self.micro_batch, self.seq, dtype=torch.long, device=device)
            return self._hidden(device, shard)

    def _hidden(self, device: torch.device, shard: int) -> torch.Tensor:
        return torch.empty(self.micro_batch, self.seq // shard, self.hidden, dtype=self.dtype, device=device,
                           requires_grad=True)

    def _example_output(self, lm: nn.Module, index: int, device: torch.device, shard: int) -> torch.Tensor:
        with self.fake_mode:
            if index == self.num_stages - 1:
                vocab = self.vocab // (self.spec.tp if self.vocab_parallel else 1)
                return torch.empty(self.micro_batch, self.seq, vocab, dtype=self.dtype, device=device,
                                   requires_grad=True)
            return self._hidden(device, shard)

    def build(self, dtype: torch.dtype) -> None:
        """The PipelineStages and the schedule (after parallelisation: the stages wrap the sharded
        modules)."""
        self.dtype = dtype
        self.stages = [self._make_stage(m, i) for m, i in zip(self.modules, self.indices)]
        self.schedule = self._schedule(self.micro_batches)

    def _schedule(self, micro_batches: int):
        cls = schedule_class(self.spec.schedule)
        stages = self.stages if is_multi_stage(self.spec.schedule) else self.stages[0]
        schedule = cls(stages, micro_batches, loss_fn=decoder_loss)
        if self.simulated:
            schedule._warmup_p2p = _agree_static
        return schedule

    def order(self, micro_batches: int) -> dict[int, list]:
        """Every pipeline rank's actions for a step of `micro_batches` (the schedule's own order)."""
        return normalized(self._schedule(micro_batches).pipeline_order)

    def stage_to_rank(self) -> dict[int, int]:
        mapping = getattr(self.schedule, "stage_index_to_group_rank", None)
        return dict(mapping) if mapping else {s: s % self.spec.pp for s in range(self.num_stages)}

    def step(self, tracer: Tracer | None = None, ids: torch.Tensor | None = None) -> PipelineTrace | None:
        """One schedule step over the micro-batches of `ids` (token ids, and the labels; zeros when
        not given); with a tracer, marks its actions."""
        from torchneuron.planner.build import loss_context

        if ids is None:
            with self.fake_mode:
                ids = torch.zeros(self.micro_batches * self.micro_batch, self.seq, dtype=torch.long,
                                  device=self.device)
        args = (ids,) if 0 in self.indices else ()
        target = ids if self.num_stages - 1 in self.indices else None
        record = None
        if tracer is not None:
            record = PipelineTrace(self.spec.schedule, self.num_stages, tuple(self.indices), self.stage_to_rank(),
                                   self.micro_batches)
            self._mark(tracer, record)
        try:
            with loss_context(self.vocab_parallel and target is not None):
                self.schedule.step(*args, target=target, return_outputs=False)
        finally:
            if tracer is not None:
                self._unmark()
        if record is not None:
            record.tail_start = len(tracer.events)
            _attach_gaps(record, tracer.events)
        return record

    def _mark(self, tracer: Tracer, record: PipelineTrace) -> None:
        methods = (("forward_one_chunk", _FORWARD), ("backward_one_chunk", _BACKWARD),
                   ("perform_reduce_grad", "REDUCE_GRAD"))
        for stage in self.stages:
            for attr, kind in methods:
                original = getattr(stage, attr)

                def marked(*args, _original=original, _kind=kind, _stage=stage.stage_index, **kwargs):
                    start = len(tracer.events)
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        micro = args[0] if _kind != "REDUCE_GRAD" else None
                        record.segments.append(Segment(_kind, _stage, micro, start, len(tracer.events)))
                setattr(stage, attr, marked)

    def _unmark(self) -> None:
        for stage in self.stages:
            for attr in ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad"):
                stage.__dict__.pop(attr, None)


def _attach_gaps(record: PipelineTrace, events: list) -> None:
    """Events between two actions belong to the earlier one (p2p sends excepted: they are the
    replay's own transfers, priced from their bytes); after the last action, to the tail."""
    segments = sorted(record.segments, key=lambda s: s.start)
    if not segments:
        raise RuntimeError("the pipeline schedule ran no forward or backward on the traced rank")
    for segment, following in zip(segments, segments[1:] + [None]):
        stop = following.start if following is not None else None
        gap = events[segment.end:stop]
        for event in gap:
            if isinstance(event, CollectiveEvent) and event.kind == "send" and segment.kind in (_FORWARD, _BACKWARD):
                record.sends.setdefault(segment.kind, event.nbytes)
        if following is not None:
            segment.end = following.start
        else:
            record.tail_start = segment.end
    record.segments = segments
    live = peak = 0
    for segment in segments:
        live += {_FORWARD: 1, _BACKWARD: -1}.get(segment.kind, 0)
        peak = max(peak, live)
    record.in_flight = max(peak, 1)


def normalized(order: dict[int, list]) -> dict[int, list]:
    """The schedule's order with each stage's forwards, and its backwards, numbered 0, 1, ... in
    the order they run (every schedule here runs a stage's micro-batches in order). Torch 2.13's
    `Schedule1F1B._get_pipeline_order` numbers the last stage's forwards from 1 (its warm-up loop
    is empty, so the counter it increments was never set); its execution is right."""
    from torch.distributed.pipelining.schedules import _Action

    out = {}
    for rank, actions in order.items():
        counters: dict[tuple[int, str], int] = {}
        fixed = []
        for action in actions:
            if action is not None and action.microbatch_index is not None:
                key = (action.stage_index, action.computation_type.value)
                index = counters.get(key, 0)
                counters[key] = index + 1
                action = _Action(action.stage_index, action.computation_type, index, action.sub_actions)
            fixed.append(action)
        out[rank] = fixed
    return out


def in_flight(order: dict[int, list], rank: int) -> int:
    """The most micro-batches whose activations `rank` holds at once under `order`."""
    live = peak = 0
    for action in order.get(rank, []):
        if action is None:
            continue
        kind = action.computation_type.value
        live += {_FORWARD: 1, _BACKWARD: -1}.get(kind, 0)
        peak = max(peak, live)
    return max(peak, 1)


# ---------------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------------

@dataclass
class StageCosts:
    """Priced work of the traced stages: actions by (kind, stage, traced micro-batch), the tail
    and the optimizer step, by stage."""

    actions: dict[tuple[str, int, int | None], list[Item]]
    tail: dict[int, list[Item]]
    sends: dict[str, int]
    traced_micro_batches: int

    def stand_in(self, stage: int, num_stages: int) -> int:
        """The traced stage whose costs an untraced one takes: itself when traced, else a traced
        stage of the same kind (last; first; any)."""
        traced = sorted({s for _, s, _ in self.actions})
        if stage in traced:
            return stage
        middle = [s for s in traced if 0 < s < num_stages - 1]
        return middle[0] if middle else traced[0]

    def items(self, kind: str, stage: int, micro_batch: int | None, micro_batches: int,
              num_stages: int) -> list[Item]:
        stage = self.stand_in(stage, num_stages)
        if micro_batch is not None:
            last = self.traced_micro_batches - 1
            micro_batch = 0 if micro_batch == 0 else last if micro_batch == micro_batches - 1 else min(1, last)
        return self.actions.get((kind, stage, micro_batch), [])


@dataclass
class PipelineResult:
    totals: Totals            # the critical (last to finish) rank's, step_s = the pipeline's step
    bubble_s: float           # what waiting for other stages adds to that rank's own work
    p2p_s: float              # that rank's sends, busy
    finish_s: dict[int, float]
    critical_rank: int


def replay(order: dict[int, list], costs: StageCosts, micro_batches: int, num_stages: int,
           stage_to_rank: dict[int, int], send_cost: Callable[[str, int, int], Any],
           optimizer: dict[int, list[Item]]) -> PipelineResult:
    """Replays every pipeline rank's actions (see the module docstring). `send_cost(kind, from
    stage, to stage)` prices one transfer; `optimizer` holds each traced stage's optimizer items
    (a rank with several stages runs one optimizer over all of them: the traced rank's)."""
    ranks = sorted(order)
    replays = {r: Replay() for r in ranks}
    arrived: dict[tuple[str, int, int], float] = {}
    position = {r: 0 for r in ranks}
    done = 0
    total = sum(1 for r in ranks for a in order[r] if a is not None)
    while done < total:
        progressed = False
        for rank in ranks:
            actions = order[rank]
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if action is None:
                    position[rank] += 1
                    continue
                kind, stage, micro = action.computation_type.value, action.stage_index, action.microbatch_index
                need = _dependency(kind, stage, micro, num_stages)
                if need is not None and need not in arrived:
                    break
                run = replays[rank]
                if need is not None:
                    run.timeline.wait_until(0, arrived[need])
                run.run(costs.items(kind, stage, micro, micro_batches, num_stages))
                end = run.timeline.now(0)
                target = _receiver(kind, stage, num_stages)
                if target is not None and micro is not None:
                    if stage_to_rank[target] == rank:
                        arrived[(kind, stage, micro)] = end
                    else:
                        cost = send_cost(kind, stage, target)
                        arrived[(kind, stage, micro)] = run.run_one(Item("c10d::send", cost, "comm:pp"))
                elif kind == _FORWARD and stage == num_stages - 1 and micro is not None:
                    arrived[(kind, stage, micro)] = end       # the last stage's own backward follows
                position[rank] += 1
                done += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the pipeline schedule's order deadlocks in the replay (an action waits for one "
                               "that never runs); report the schedule and its degrees")
    finish = {}
    for rank in ranks:
        own = [s for s, r in stage_to_rank.items() if r == rank]
        tail_stage = costs.stand_in(max(own), num_stages)
        replays[rank].run(costs.tail.get(tail_stage, []))
        replays[rank].run(optimizer.get(tail_stage, []))
        finish[rank] = replays[rank].timeline.synchronize()
    critical = max(ranks, key=lambda r: finish[r])
    totals = replays[critical].finish()
    alone = Replay()   # the critical rank's own work, nothing to wait for
    for action in order[critical]:
        if action is not None:
            alone.run(costs.items(action.computation_type.value, action.stage_index, action.microbatch_index,
                                  micro_batches, num_stages))
    own = [s for s, r in stage_to_rank.items() if r == critical]
    tail_stage = costs.stand_in(max(own), num_stages)
    alone.run(costs.tail.get(tail_stage, []))
    alone.run(optimizer.get(tail_stage, []))
    bubble = max(0.0, totals.step_s - alone.finish().step_s)
    return PipelineResult(totals, bubble, totals.comm_by_group.get("comm:pp", 0.0), finish, critical)


def _dependency(kind: str, stage: int, micro: int | None, num_stages: int) -> tuple[str, int, int] | None:
    if micro is None:
        return None
    if kind == _FORWARD and stage > 0:
        return (_FORWARD, stage - 1, micro)
    if kind == _BACKWARD:
        return (_BACKWARD, stage + 1, micro) if stage < num_stages - 1 else (_FORWARD, stage, micro)
    return None


def _receiver(kind: str, stage: int, num_stages: int) -> int | None:
    if kind == _FORWARD and stage < num_stages - 1:
        return stage + 1
    if kind == _BACKWARD and stage > 0:
        return stage - 1
    return None


def uniform_formula(forward_s: float, backward_s: float, micro_batches: int, pp: int) -> float:
    """The textbook step of GPipe and 1F1B with identical stages and free transfers:
    (m + pp - 1) slots of one forward and one backward (the bubble is pp - 1 of them). The
    replay must reproduce it (a test checks)."""
    return (micro_batches + pp - 1) * (forward_s + backward_s)


def trimmed(items: list[Item]) -> list[Item]:
    """Items without the traced p2p transfers (the replay prices its own)."""
    return [i for i in items if not (i.stream.startswith("comm:") and i.name in ("c10d::send", "c10d::recv"))]


