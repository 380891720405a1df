"""Pipeline parallelism: torch.distributed.pipelining's schedules run on the traced stages, and the
replay of every rank's actions from the schedule's own order."""
import pytest
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from torchneuron.hardware import Cost
from torchneuron.planner import plan
from torchneuron.planner.pipeline import StageCosts, normalized, replay, uniform_formula
from torchneuron.planner.simulate import Item

FORWARD_S, BACKWARD_S = 1e-3, 2e-3


def _order(schedule: str, pp: int, m: int) -> dict:
    """The schedule's order for all ranks, as torch computes it (without building stages)."""
    from torch.distributed.pipelining import schedules

    cls = {"gpipe": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B}[schedule]
    fake = type("Stage", (), {"num_stages": pp, "group_size": pp, "group_rank": 0, "stage_index": 0,
                              "is_first": True, "is_last": pp == 1, "has_backward": True})()
    return normalized(cls(fake, m, loss_fn=lambda out, target: out).pipeline_order)


def _uniform_costs(pp: int, transfer_s: float = 0.0):
    compute = lambda s: [Item("work", Cost(s, "tensor", 0.0, 0.0, "compute"), "compute")]  # noqa: E731
    actions = {}
    for stage in range(pp):
        for mb in (0, 1, 2):
            actions[("F", stage, mb)] = compute(FORWARD_S)
            actions[("B", stage, mb)] = compute(BACKWARD_S)
    costs = StageCosts(actions, {}, {"F": 1, "B": 1}, 3)
    send = lambda kind, a, b: Cost(transfer_s, "link", 0.0, 0.0, "latency")  # noqa: E731
    return costs, send


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4)])
def test_replay_of_identical_stages_matches_the_textbook_formula(schedule, pp, m):
    costs, send = _uniform_costs(pp)
    result = replay(_order(schedule, pp, m), costs, m, pp, {s: s for s in range(pp)}, send, {})
    expected = uniform_formula(FORWARD_S, BACKWARD_S, m, pp)
    assert result.totals.step_s == pytest.approx(expected, rel=1e-9)
    assert result.bubble_s == pytest.approx((pp - 1) * (FORWARD_S + BACKWARD_S), rel=1e-9)


def test_transfers_lengthen_the_critical_path():
    costs, free = _uniform_costs(4)
    _, slow = _uniform_costs(4, transfer_s=1e-4)
    order = _order("1f1b", 4, 8)
    fast = replay(order, costs, 8, 4, {s: s for s in range(4)}, free, {})
    slowed = replay(order, costs, 8, 4, {s: s for s in range(4)}, slow, {})
    # the first forward and the last backward cross every stage boundary: 2 * 3 transfers at least
    assert slowed.totals.step_s >= fast.totals.step_s + 6e-4 - 1e-12
    assert slowed.p2p_s > 0 and fast.p2p_s == 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_planned_pipeline_runs_torch_pipelining(tiny_config, schedule):
    kwargs = dict(target="trn2", nodes=1, ranks=4, batch=8, seq=32)
    flat = plan(tiny_config, {"fsdp": 4}, **kwargs)
    piped = plan(tiny_config, {"pp": 2, "fsdp": 2}, pp_schedule=schedule, **kwargs)
    assert piped.spec.pp == 2 and piped.micro_batches == 4 and piped.spec.schedule == schedule
    assert piped.bubble_s > 0 and piped.p2p_s > 0 and flat.bubble_s == 0
    # the bubble is about (pp - 1) of m + pp - 1 slots: one of five here
    assert 0.05 < piped.bubble_s / piped.step_s < 0.4
    text = str(piped)
    assert "pipeline bubble" in text and f"({schedule}, torch.distributed.pipelining)" in text


def test_unknown_schedule_and_uneven_stages_name_the_fix(tiny_config):
    with pytest.raises(ValueError, match="gpipe, 1f1b, interleaved1f1b"):
        plan(tiny_config, {"pp": 2}, ranks=2, batch=2, seq=16, pp_schedule="zigzag")
    with pytest.raises(ValueError, match="do not split into"):
        plan(tiny_config, {"pp": 2}, ranks=2, batch=2, seq=16, pp_schedule="interleaved1f1b", virtual_stages=2)


def test_interleaved_schedule_shrinks_the_bubble(tiny_config, tmp_path):
    """Two stages per rank (Interleaved1F1B): each rank holds stages r and r + pp, and the bubble
    is a smaller share of the step than 1F1B's over the same layers."""
    import json

    from tests.planner.conftest import TINY

    path = tmp_path / "tiny-4-layers.json"
    path.write_text(json.dumps(dict(TINY, num_hidden_layers=4)))
    kwargs = dict(target="trn2", nodes=1, ranks=4, batch=8, seq=32)
    plain = plan(str(path), {"pp": 2, "fsdp": 2}, pp_schedule="1f1b", **kwargs)
    interleaved = plan(str(path), {"pp": 2, "fsdp": 2}, pp_schedule="interleaved1f1b", virtual_stages=2, **kwargs)
    assert interleaved.spec.virtual_stages == 2
    assert interleaved.bubble_s / interleaved.step_s < plain.bubble_s / plain.step_s


def test_pipeline_with_tensor_parallel_stages(tmp_path, monkeypatch):
    """With tp > 1 too, the last stage is traced in a simulated world of its own and priced with its
    own layers: its forward holds the vocabulary-parallel output layer, so it costs more than the
    first stage's (embedding lookup) forward. A sharding decision DTensor cached in the first
    world would name that world's destroyed process groups in the second."""
    import json

    import torchneuron.planner.training as training
    from tests.planner.conftest import TINY

    recorded: list = []

    def recording(actions, *args):
        recorded.append(actions)
        return StageCosts(actions, *args)

    monkeypatch.setattr(training, "StageCosts", recording)
    path = tmp_path / "wide-vocabulary.json"
    path.write_text(json.dumps(dict(TINY, vocab_size=8192)))
    report = plan(str(path), {"pp": 2, "tp": 2}, target="trn2", nodes=1, ranks=4, batch=4, seq=32)
    assert report.bubble_s > 0 and report.p2p_s > 0
    assert "collectives on tp" in str(report) and "the first and the last stage traced" in str(report)
    (actions,) = recorded

    def forward_s(stage: int) -> float:
        return sum(item.cost.duration_s for item in actions[("F", stage, 0)])

    assert forward_s(1) > 1.2 * forward_s(0)
