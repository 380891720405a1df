"""Every collective of the neuron backend on 2 and 4 ranks, against values worked out by hand.

One job per world size runs all collectives (spawning is the expensive part) and returns what each
rank saw; the tests below check those values.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _cpu(value):
    return value.cpu().tolist() if isinstance(value, torch.Tensor) else [_cpu(v) for v in value]


def _full(n: int, value: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype, device="neuron")


def _reductions(r: int, w: int) -> dict:
    out = {}
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        t = _full(3, r + 1.0)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        out[name] = _cpu(t)
    t = _full(3, r + 1.0)
    work = dist.all_reduce(t, async_op=True)
    out["async"] = (work.wait(), work.is_completed(), _cpu(t))
    for dtype in (torch.bfloat16, torch.int64, torch.int16):
        t = _full(5, r + 1, dtype)
        dist.all_reduce(t)
        out[str(dtype)] = _cpu(t)
    base = torch.arange(12.0, device="neuron").view(3, 4) * (r + 1)
    strided = base.t()  # not contiguous: staged and written back
    dist.all_reduce(strided)
    out["strided"] = _cpu(base)
    t = _full(2, r + 1.0)
    dist.reduce(t, dst=w - 1)
    out["reduce"] = _cpu(t)
    return out


def _movement(r: int, w: int) -> dict:
    out = {}
    t = _full(4, float(r))
    dist.broadcast(t, src=w - 1)
    out["broadcast"] = _cpu(t)
    gathered = [torch.empty(2, device="neuron") for _ in range(w)]
    dist.all_gather(gathered, _full(2, float(r)))
    out["all_gather"] = _cpu(gathered)
    uneven = [torch.empty(j + 1, device="neuron") for j in range(w)]
    dist.all_gather(uneven, _full(r + 1, float(r)))
    out["all_gather_uneven"] = _cpu(uneven)
    flat = torch.empty(2 * w, device="neuron")
    dist.all_gather_into_tensor(flat, _full(2, float(r)))
    out["all_gather_into_tensor"] = _cpu(flat)
    piece = torch.empty(2, device="neuron")
    dist.reduce_scatter(piece, [_full(2, 10.0 * j + r) for j in range(w)])
    out["reduce_scatter"] = _cpu(piece)
    dist.reduce_scatter_tensor(piece, torch.arange(2.0 * w, device="neuron") * (r + 1), op=dist.ReduceOp.AVG)
    out["reduce_scatter_tensor_avg"] = _cpu(piece)
    # uneven all_to_all_single: rank r sends j+1 copies of 10r+j to rank j
    send = torch.cat([_full(j + 1, 10.0 * r + j) for j in range(w)])
    recv = torch.empty(w * (r + 1), device="neuron")
    dist.all_to_all_single(recv, send, output_split_sizes=[r + 1] * w, input_split_sizes=list(range(1, w + 1)))
    out["all_to_all_single"] = _cpu(recv)
    outputs = [torch.empty(r + 1, device="neuron") for _ in range(w)]
    dist.all_to_all(outputs, [_full(j + 1, 10.0 * r + j) for j in range(w)])
    out["all_to_all"] = _cpu(outputs)
    gather_list = [torch.empty(2, device="neuron") for _ in range(w)] if r == 0 else None
    dist.gather(_full(2, float(r)), gather_list, dst=0)
    out["gather"] = _cpu(gather_list) if gather_list else None
    piece = torch.empty(2, device="neuron")
    dist.scatter(piece, [_full(2, 5.0 * j) for j in range(w)] if r == 0 else None, src=0)
    out["scatter"] = _cpu(piece)
    return out


def _point_to_point(r: int, w: int) -> dict:
    out = {}
    right, left = (r + 1) % w, (r - 1) % w
    got = torch.empty(3, device="neuron")
    works = [dist.isend(_full(3, float(r)), right), dist.irecv(got, left)]
    for work in works:
        work.wait()
    out["isend_irecv"] = _cpu(got)
    got = torch.empty(3, device="neuron")
    ops = [dist.P2POp(dist.isend, _full(3, 100.0 + r), right), dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["batch_isend_irecv"] = _cpu(got)
    if r == 0:
        got = torch.empty(2, device="neuron")
        out["recv_any"] = dist.recv(got)
    elif r == 1:
        dist.send(_full(2, 7.0), 0)
    dist.barrier()
    return out


def _objects(r: int, w: int) -> dict:
    out = {}
    objects = [None] * w
    dist.all_gather_object(objects, {"rank": r, "name": f"r{r}"})
    out["all_gather_object"] = objects
    box = [f"from {r}", r]
    dist.broadcast_object_list(box, src=w - 1)
    out["broadcast_object_list"] = box
    gathered = [None] * w if r == 0 else None
    dist.gather_object(("g", r), gathered, dst=0)
    out["gather_object"] = gathered
    received = [None]
    dist.scatter_object_list(received, [{"to": j} for j in range(w)] if r == 0 else None, src=0)
    out["scatter_object_list"] = received[0]
    return out


def _functional(r: int, w: int) -> dict:
    group = dist.group.WORLD
    out = {}
    x = torch.arange(4.0, device="neuron") + r
    out["fc_all_reduce"] = _cpu(funcol.wait_tensor(funcol.all_reduce(x, "sum", group)))
    out["fc_all_gather_tensor"] = _cpu(funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group)))
    out["fc_reduce_scatter_tensor"] = _cpu(funcol.wait_tensor(funcol.reduce_scatter_tensor(
        torch.arange(2.0 * w, device="neuron"), "sum", 0, group)))
    out["fc_all_to_all_single"] = _cpu(funcol.wait_tensor(funcol.all_to_all_single(
        torch.arange(float(w), device="neuron") + 10 * r, None, None, group)))
    leaf = torch.full((2,), float(r + 1), device="neuron", requires_grad=True)
    gathered = funcol.all_gather_tensor_autograd(leaf, 0, group)
    (gathered * torch.arange(2.0 * w, device="neuron")).sum().backward()
    out["fc_all_gather_autograd_grad"] = _cpu(leaf.grad)
    a, b = _full(2, r + 1.0), _full(3, 2.0 * r)
    with dist._coalescing_manager(async_ops=True) as manager:
        dist.all_reduce(a)
        dist.all_reduce(b)
    manager.wait()
    out["fc_coalesced"] = (_cpu(a), _cpu(b))
    return out


def _subgroups(r: int, w: int) -> dict:
    halves = [dist.new_group(list(range(s, s + 2))) for s in range(0, w, 2)]
    group = halves[r // 2]
    t = _full(2, r + 1.0)
    dist.all_reduce(t, group=group)
    return {"pair_sum": _cpu(t), "group_size": dist.get_world_size(group), "group_rank": dist.get_rank(group)}


def _timeline(r: int, w: int) -> dict:
    """Modeled device time of a step with a 64 MiB all-reduce and independent matmuls, sync vs async."""
    from torchneuron.hardware.timeline import get_timeline
    from torchneuron.hardware import worklog

    device = torch.neuron.current_device()
    timeline = get_timeline(device)
    a = torch.randn(1024, 1024, device="neuron")
    grad = torch.ones(16 << 20, device="neuron")
    times = {}
    for mode in ("t_sync", "t_async", "t_compute"):
        torch.neuron.synchronize()
        worklog.drain()
        start = timeline.now(torch.neuron.current_stream().stream_id)
        work = dist.all_reduce(grad, async_op=True) if mode != "t_compute" else None
        if mode == "t_sync":
            work.wait()
        for _ in range(4):
            a = (a @ a).tanh()
        if work is not None:
            work.wait()
        worklog.drain()
        times[mode] = timeline.now(torch.neuron.current_stream().stream_id) - start
    from torchneuron.hardware.model import collective_cost

    times["t_comm"] = collective_cost("all_reduce", grad.numel() * 4, w).duration_s
    times["comm_stream_used"] = len(timeline.stream_ids()) >= 2
    return times


def _charges(r: int, w: int) -> dict:
    """What each collective charged to the device timeline: (name, stream, modeled seconds)."""
    from torchneuron.hardware import timeline

    entries = []
    timeline.add_listener(entries.append)
    x = torch.ones(256, device="neuron")
    dist.all_reduce(x)
    dist.all_gather_into_tensor(torch.empty(256 * w, device="neuron"), x)
    dist.reduce_scatter_tensor(torch.empty(256 // w, device="neuron"), x)
    dist.all_to_all_single(torch.empty(256, device="neuron"), x)
    dist.broadcast(x, 0)
    timeline.remove_listener(entries.append)
    return {"charges": [(e.name, e.stream, e.duration_s) for e in entries if e.name.startswith("c10d::")],
            "compute_stream": torch.neuron.current_stream().stream_id}


def _collectives_job() -> dict:
    dist.init_process_group("neuron")
    r, w = dist.get_rank(), dist.get_world_size()
    out = {"rank": r, "world": w, "device": torch.neuron.current_device(), "backend": dist.get_backend()}
    for part in (_reductions, _movement, _point_to_point, _objects, _functional, _subgroups, _charges, _timeline):
        out.update(part(r, w))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    return request.getfixturevalue(f"pool{request.param}").run(_collectives_job, timeout=200)


def test_each_rank_on_its_local_device(ranks):
    count = torch.neuron.device_count()
    assert [o["device"] for o in ranks] == [r % count for r in range(len(ranks))]
    assert all(o["backend"] == "neuron" for o in ranks)


def test_all_reduce_ops(ranks):
    w = len(ranks)
    for o in ranks:
        assert o["SUM"] == [w * (w + 1) / 2] * 3
        assert o["AVG"] == [(w + 1) / 2] * 3
        assert o["MAX"] == [float(w)] * 3
        assert o["MIN"] == [1.0] * 3
        assert o["PRODUCT"] == [float(math.factorial(w))] * 3
        assert o["async"] == (True, True, [w * (w + 1) / 2] * 3)


def test_all_reduce_dtypes_and_strides(ranks):
    w = len(ranks)
    total = w * (w + 1) // 2
    for o in ranks:
        for dtype in (torch.bfloat16, torch.int64, torch.int16):
            assert o[str(dtype)] == [total] * 5
        assert o["strided"] == (torch.arange(12.0).view(3, 4) * total).tolist()


def test_reduce_to_root(ranks):
    w = len(ranks)
    for r, o in enumerate(ranks):
        assert o["reduce"] == ([w * (w + 1) / 2] * 2 if r == w - 1 else [r + 1.0] * 2)


def test_broadcast_and_gathers(ranks):
    w = len(ranks)
    for r, o in enumerate(ranks):
        assert o["broadcast"] == [w - 1.0] * 4
        assert o["all_gather"] == [[float(j)] * 2 for j in range(w)]
        assert o["all_gather_uneven"] == [[float(j)] * (j + 1) for j in range(w)]
        assert o["all_gather_into_tensor"] == [float(j) for j in range(w) for _ in range(2)]
        assert o["gather"] == ([[float(j)] * 2 for j in range(w)] if r == 0 else None)
        assert o["scatter"] == [5.0 * r] * 2


def test_reduce_scatter(ranks):
    w = len(ranks)
    for r, o in enumerate(ranks):
        assert o["reduce_scatter"] == [sum(10.0 * r + j for j in range(w))] * 2
        scale = (w + 1) / 2  # mean of (j + 1) over ranks
        assert o["reduce_scatter_tensor_avg"] == pytest.approx([2 * r * scale, (2 * r + 1) * scale])


def test_all_to_all_uneven(ranks):
    w = len(ranks)
    for r, o in enumerate(ranks):
        expected = [[10.0 * i + r] * (r + 1) for i in range(w)]
        assert o["all_to_all_single"] == [v for piece in expected for v in piece]
        assert o["all_to_all"] == expected


def test_point_to_point(ranks):
    w = len(ranks)
    for r, o in enumerate(ranks):
        assert o["isend_irecv"] == [float((r - 1) % w)] * 3
        assert o["batch_isend_irecv"] == [100.0 + (r - 1) % w] * 3
    assert ranks[0]["recv_any"] == 1


def test_object_collectives(ranks):
    w = len(ranks)
    for r, o in enumerate(ranks):
        assert o["all_gather_object"] == [{"rank": j, "name": f"r{j}"} for j in range(w)]
        assert o["broadcast_object_list"] == [f"from {w - 1}", w - 1]
        assert o["gather_object"] == ([("g", j) for j in range(w)] if r == 0 else None)
        assert o["scatter_object_list"] == {"to": r}


def test_functional_collectives(ranks):
    w = len(ranks)
    for r, o in enumerate(ranks):
        assert o["fc_all_reduce"] == [4.0 * ((w - 1) * w / 2 / 4) + v * w for v in range(4)]
        assert o["fc_all_gather_tensor"] == [v + j for j in range(w) for v in range(4)]
        assert o["fc_reduce_scatter_tensor"] == [2.0 * r * w, (2.0 * r + 1) * w]
        assert o["fc_all_to_all_single"] == [10.0 * j + r for j in range(w)]
        # d(sum(gathered * c))/d leaf = reduce_scatter of c: this rank's chunk of c summed over ranks
        assert o["fc_all_gather_autograd_grad"] == [2.0 * r * w, (2.0 * r + 1) * w]
        assert o["fc_coalesced"] == ([w * (w + 1) / 2] * 2, [float(w * (w - 1))] * 3)


def test_subgroups(ranks):
    for r, o in enumerate(ranks):
        pair = r // 2 * 2
        assert o["pair_sum"] == [float(pair + 1 + pair + 2)] * 2
        assert (o["group_size"], o["group_rank"]) == (2, r % 2)


def test_collectives_charged_on_a_comm_stream_that_overlaps(ranks):
    for o in ranks:
        assert o["comm_stream_used"]
        assert o["t_comm"] > 0
        # a synchronous all-reduce adds its modeled time to the step; an async one hides under compute
        assert o["t_sync"] == pytest.approx(o["t_compute"] + o["t_comm"], rel=0.05)
        assert o["t_async"] == pytest.approx(max(o["t_compute"], o["t_comm"]), rel=0.05)
        assert o["t_async"] < o["t_sync"]


def test_each_collective_charged_with_the_model_cost(ranks):
    from torchneuron.hardware.model import collective_cost

    w = len(ranks)
    nbytes = 256 * 4  # the full buffer: all-reduced, gathered, unscattered, sent
    expected = [("c10d::all_reduce", collective_cost("all_reduce", nbytes, w)),
                ("c10d::all_gather_single", collective_cost("all_gather", nbytes * w, w)),
                ("c10d::reduce_scatter_single", collective_cost("reduce_scatter", nbytes, w)),
                ("c10d::all_to_all", collective_cost("all_to_all", nbytes, w)),
                ("c10d::broadcast", collective_cost("broadcast", nbytes, w))]
    for o in ranks:
        assert [name for name, _, _ in o["charges"]] == [name for name, _ in expected]
        assert [seconds for _, _, seconds in o["charges"]] == pytest.approx([c.duration_s for _, c in expected])
        assert all(stream != o["compute_stream"] for _, stream, _ in o["charges"])
