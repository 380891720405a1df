"""The c10d process group of the `neuron` backend.

`NeuronProcessGroup` is what `init_process_group("neuron")` (or `new_group`, `DeviceMesh`) creates. It
is a Python subclass of `torch.distributed.ProcessGroup`: Python callers (`dist.*`, FSDP2, pipelining,
DCP) reach its methods directly, C++ callers (DDP's reducer, functional collectives) through pybind's
trampolines or, for the methods without one, through the c10d ops it overrides for PrivateUse1
(dispatch.py). For every collective it validates the tensors' device, checks that all ranks agree
(checks.py), moves the data over gloo on host views (collectives.py) and charges the collective to the
device timeline (work.py). It accepts neuron and CPU tensors (CPU ones, as for object collectives, are
not charged).
"""
from __future__ import annotations

import datetime
import os
from typing import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroupGloo

from torchneuron.distributed import collectives as coll
from torchneuron.distributed.checks import Signature, check, translate
from torchneuron.distributed.host import Staged, reduce_code, reduce_spec
from torchneuron.distributed.work import CoalescedWork, CommStreams, NeuronWork
from torchneuron.hardware.timeline import recording_enabled

Tensors = list[torch.Tensor]
_CLOCK_TAG = 1 << 24   # the tag offset of a transfer's clock message (user tags are small)


def _numel(tensors: Tensors) -> int:
    return sum(t.numel() for t in tensors)


def _nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _gloo_device() -> ProcessGroupGloo.Device:
    """Loopback when the job's master is on this host (single-machine jobs stay off the network),
    GLOO_SOCKET_IFNAME when set, else gloo's default (the hostname's interface)."""
    if not os.environ.get("GLOO_SOCKET_IFNAME") and os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):
        return ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return ProcessGroupGloo.create_default_device()


class NeuronProcessGroup(dist.ProcessGroup):
    """Collectives on neuron tensors over gloo, charged to the device timeline."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [_gloo_device()]
        self._gloo = ProcessGroupGloo(store, rank, size, options)
        self._timeout = timeout
        self._name = ""
        self._desc = ""
        self._seq = 0
        self._streams = CommStreams()
        self._coalescing: list[NeuronWork] | None = None
        # c10d probes a group's per-device backends (init_process_group(device_id=...), object
        # collectives' choice of CPU tensors), so each device type gets one: a placeholder that raises
        # if anything tries to run a collective on it (every collective comes here instead). gloo is
        # not registered on purpose: this Python object stays its only owner, and pybind destroys it
        # with the GIL released. Were the C++ group an owner, a C++ holder (DDP's reducer) could
        # destroy gloo under the GIL while a gloo thread waits for the GIL to drop a finished work's
        # thread-local Python state (every backward stashes one): a deadlock.
        placeholder_options = FakeProcessGroup.Options()
        placeholder_options.error_on_collective = True
        placeholder = FakeProcessGroup._create_internal(rank, size, placeholder_options)
        for device in ("cpu", "neuron"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, placeholder)

    # ---- identity (c10d calls these through the trampoline) ---------------------------------------
    def getBackendName(self) -> str:
        return "neuron"

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    @property
    def issued(self) -> int:
        """Collectives this group has issued so far (the same count on every rank)."""
        return self._seq

    def __repr__(self) -> str:
        return f"NeuronProcessGroup(name={self._name!r}, rank={self.rank()}, size={self.size()})"

    # ---- the common path ------------------------------------------------------------------------
    def _device_of(self, kind: str, tensors: Tensors) -> int | None:
        """The neuron device index of the tensors, None for CPU tensors; a clear error otherwise."""
        types = {t.device.type for t in tensors}
        if types - {"neuron", "cpu"}:
            bad = sorted(types - {"neuron", "cpu"})
            raise ValueError(f"neuron backend: {kind} got a tensor on {', '.join(bad)}; the 'neuron' process group "
                             f"works on neuron tensors (and CPU ones): move it with .to('neuron') or use a group "
                             f"of that device's backend")
        if len(types) > 1:
            raise ValueError(f"neuron backend: {kind} mixes neuron and CPU tensors; pass all of one device")
        if any(t.layout != torch.strided for t in tensors):
            raise ValueError(f"neuron backend: {kind} supports dense tensors only")
        if types != {"neuron"}:
            return None
        indices = {t.device.index for t in tensors}
        if len(indices) > 1:
            raise ValueError(f"neuron backend: {kind} got tensors on several devices {sorted(indices)}; "
                             f"one collective works on one device")
        return indices.pop()

    def _run(self, signature: Signature, tensors: Tensors, result: Tensors, body: Callable[[], None],
             nbytes: int, device: int | None = -1) -> NeuronWork:
        """Checks, moves the data, charges the device timeline (of the tensors' device unless `device`
        is given; None: not charged): one collective end to end."""
        if device == -1:
            device = self._device_of(signature.kind, tensors)
        self._seq += 1
        try:
            check(signature, self._gloo, self._seq, self.size(), self._name)
            body()
        except Exception as error:
            raise self._translate(error, signature.kind) from error
        return self._issued(signature.kind, nbytes, device, result)

    def _issued(self, kind: str, nbytes: int, device: int | None, result: Tensors,
                finish: Callable[[], None] | None = None) -> NeuronWork:
        end = self._streams.charge(kind, nbytes, self.size(), device) if device is not None else None
        return self._work(result, device, end, finish)

    def _work(self, result: Tensors, device: int | None, end: torch.Event | None,
              finish: Callable[[], None] | None) -> NeuronWork:
        work = NeuronWork(result, device, end, self._streams.get(device) if end is not None else None, finish)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _translate(self, error: BaseException, kind: str) -> BaseException:
        return translate(error, kind, self._name, self.rank(), self.size(), self._timeout.total_seconds())

    # ---- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors: Tensors, opts: dist.AllreduceOptions = dist.AllreduceOptions()) -> NeuronWork:
        if len(tensors) != 1:
            raise ValueError("neuron backend: allreduce takes one tensor per call (use allreduce_coalesced)")
        return self.allreduce_coalesced(tensors, opts)

    def allreduce_coalesced(self, tensors: Tensors, opts=None) -> NeuronWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        spec = reduce_spec(op, self.size())
        if len({t.dtype for t in tensors}) > 1:
            raise TypeError("neuron backend: a coalesced all_reduce needs tensors of one dtype")
        signature = Signature("all_reduce", tensors[0].dtype, _numel(tensors), _numel(tensors),
                              reduce=reduce_code(op), count=len(tensors))
        return self._run(signature, tensors, tensors, lambda: coll.all_reduce(self._gloo, tensors, spec),
                         _nbytes(tensors))

    def reduce(self, tensors: Tensors, opts=None) -> NeuronWork:
        (tensor,) = tensors
        spec = reduce_spec(opts.reduceOp, self.size())
        signature = Signature("reduce", tensor.dtype, tensor.numel(), tensor.numel(), root=opts.rootRank,
                              reduce=reduce_code(opts.reduceOp))
        return self._run(signature, tensors, tensors,
                         lambda: coll.reduce(self._gloo, tensor, opts.rootRank, spec, self.rank()), _nbytes(tensors))

    def reduce_scatter_single(self, output: torch.Tensor, tensor: torch.Tensor, opts=None) -> NeuronWork:
        return self.reduce_scatter_single_coalesced([output], [tensor], opts)

    def reduce_scatter_single_coalesced(self, outputs: Tensors, inputs: Tensors, opts=None) -> NeuronWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        spec = reduce_spec(op, self.size())
        signature = Signature("reduce_scatter_single", inputs[0].dtype, _numel(inputs), _numel(outputs),
                              reduce=reduce_code(op), count=len(inputs))
        return self._run(signature, outputs + inputs, outputs,
                         lambda: coll.reduce_scatter_single(self._gloo, outputs, inputs, spec, self.size()),
                         _nbytes(inputs))

    def reduce_scatter(self, outputs: Tensors, input_lists: list[Tensors], opts=None) -> NeuronWork:
        (output,), (inputs,) = outputs, input_lists
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        spec = reduce_spec(op, self.size())
        signature = Signature("reduce_scatter", output.dtype, _numel(inputs), output.numel(), reduce=reduce_code(op),
                              in_splits=[t.numel() for t in inputs])
        return self._run(signature, [output, *inputs], outputs,
                         lambda: coll.reduce_scatter(self._gloo, output, inputs, spec, self.rank(), self.size()),
                         _nbytes(inputs))

    # ---- data movement ----------------------------------------------------------------------------
    def broadcast(self, tensors: Tensors, opts: dist.BroadcastOptions = dist.BroadcastOptions()) -> NeuronWork:
        (tensor,) = tensors
        signature = Signature("broadcast", tensor.dtype, tensor.numel(), tensor.numel(), root=opts.rootRank)
        return self._run(signature, tensors, tensors, lambda: coll.broadcast(self._gloo, tensor, opts.rootRank),
                         _nbytes(tensors))

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, opts=None) -> NeuronWork:
        return self.all_gather_single_coalesced([output], [tensor], opts)

    def all_gather_single_coalesced(self, outputs: Tensors, inputs: Tensors, opts=None) -> NeuronWork:
        if len({t.dtype for t in outputs + inputs}) == 1:
            signature = Signature("all_gather_single", inputs[0].dtype, _numel(inputs), _numel(outputs),
                                  count=len(inputs))
        else:  # mixed dtypes travel as bytes
            signature = Signature("all_gather_single", torch.uint8, _nbytes(inputs), _nbytes(outputs),
                                  count=len(inputs))
        return self._run(signature, outputs + inputs, outputs,
                         lambda: coll.all_gather_single(self._gloo, outputs, inputs, self.size()), _nbytes(outputs))

    def allgather(self, output_lists: list[Tensors], tensors: Tensors, opts=None) -> NeuronWork:
        (outputs,), (tensor,) = output_lists, tensors
        signature = Signature("all_gather", tensor.dtype, tensor.numel(), _numel(outputs),
                              out_splits=[t.numel() for t in outputs])
        return self._run(signature, [tensor, *outputs], outputs,
                         lambda: coll.all_gather(self._gloo, outputs, tensor, self.size()), _nbytes(outputs))

    def allgather_coalesced(self, output_lists: list[Tensors], tensors: Tensors, opts=None) -> NeuronWork:
        works = [self.allgather([outputs], [tensor]) for outputs, tensor in zip(output_lists, tensors)]
        return CoalescedWork(works)

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                          in_splits: list[int], opts=None) -> NeuronWork:
        world = self.size()
        out_splits = self._splits(output, out_splits, world)
        in_splits = self._splits(tensor, in_splits, world)
        signature = Signature("all_to_all", tensor.dtype, tensor.numel(), output.numel(), in_splits=in_splits,
                              out_splits=out_splits)
        return self._run(signature, [output, tensor], [output],
                         lambda: coll.all_to_all_single(self._gloo, output, tensor, out_splits, in_splits),
                         _nbytes([tensor]))

    @staticmethod
    def _splits(tensor: torch.Tensor, splits: list[int], world: int) -> list[int]:
        """Row splits along dim 0 (even when empty) as element counts."""
        rows = tensor.shape[0] if tensor.dim() else 1
        row = tensor.numel() // rows if rows else 0
        if not splits:
            if rows % world:
                raise ValueError(f"all_to_all_single: dim 0 ({rows}) does not divide evenly among {world} ranks; "
                                 f"pass split sizes")
            return [rows // world * row] * world
        if len(splits) != world or sum(splits) != rows:
            raise ValueError(f"all_to_all_single: split sizes {list(splits)} must have {world} entries summing to "
                             f"dim 0 ({rows})")
        return [int(n) * row for n in splits]

    def alltoall(self, outputs: Tensors, inputs: Tensors, opts=None) -> NeuronWork:
        if len({t.dtype for t in outputs + inputs}) > 1:
            raise TypeError("neuron backend: all_to_all needs tensors of one dtype")
        signature = Signature("all_to_all", inputs[0].dtype, _numel(inputs), _numel(outputs),
                              in_splits=[t.numel() for t in inputs], out_splits=[t.numel() for t in outputs])
        return self._run(signature, outputs + inputs, outputs, lambda: coll.all_to_all(self._gloo, outputs, inputs),
                         _nbytes(inputs))

    def gather(self, output_lists: list[Tensors], tensors: Tensors, opts=None) -> NeuronWork:
        (tensor,) = tensors
        outputs = output_lists[0] if output_lists else []
        signature = Signature("gather", tensor.dtype, tensor.numel(), _numel(outputs), root=opts.rootRank,
                              out_splits=[t.numel() for t in outputs])
        return self._run(signature, [tensor, *outputs], outputs,
                         lambda: coll.gather(self._gloo, outputs, tensor, opts.rootRank, self.rank()),
                         tensor.numel() * tensor.element_size() * self.size())

    def scatter(self, outputs: Tensors, input_lists: list[Tensors], opts=None) -> NeuronWork:
        (output,) = outputs
        inputs = input_lists[0] if input_lists else []
        signature = Signature("scatter", output.dtype, _numel(inputs), output.numel(), root=opts.rootRank,
                              in_splits=[t.numel() for t in inputs])
        return self._run(signature, [output, *inputs], outputs,
                         lambda: coll.scatter(self._gloo, output, inputs, opts.rootRank, self.rank()),
                         output.numel() * output.element_size() * self.size())

    def barrier(self, opts=None) -> NeuronWork:
        """Charged to the current neuron device (as NCCL's barrier is an all-reduce on the current GPU)."""
        return self._run(Signature("barrier"), [], [], lambda: self._gloo.barrier().wait(), 0,
                         device=torch.neuron.current_device())

    # ---- point to point (host-asynchronous: a send completes when the peer receives) --------------
    # A transfer carries the sender's modeled start time in a second message: the receiver's copy
    # starts no earlier than the sender's (nor than the receive was posted), so a rank waiting for
    # another's data (a pipeline stage for its activations) waits on the device timeline too.
    def send(self, tensors: Tensors, dst: int, tag: int) -> NeuronWork:
        (tensor,) = tensors
        device = self._device_of("send", tensors)
        staged = Staged(tensor)
        pending = self._gloo.send([staged.buffer], dst, tag)
        end, start = (self._streams.charge_timed("send", _nbytes(tensors), self.size(), device)
                      if device is not None else (None, -1.0))
        clock = torch.tensor([start], dtype=torch.float64)
        clock_sent = self._gloo.send([clock], dst, tag + _CLOCK_TAG)

        def finish() -> None:
            self._p2p_finish("send", pending, staged)()
            clock_sent.wait()
            del clock_keep[:]
        clock_keep = [clock]  # alive until gloo has sent it
        return self._work(tensors, device, end, finish)

    def recv(self, tensors: Tensors, src: int, tag: int) -> NeuronWork:
        clock = torch.empty(1, dtype=torch.float64)
        clock_pending = self._gloo.recv([clock], src, tag + _CLOCK_TAG)

        def sender_start(pending: dist.Work) -> float:
            clock_pending.wait()
            return float(clock[0])
        return self._posted_recv(tensors, tag, sender_start, src)

    def recv_anysource(self, tensors: Tensors, tag: int) -> NeuronWork:
        def sender_start(pending: dist.Work) -> float:
            clock = torch.empty(1, dtype=torch.float64)
            self._gloo.recv([clock], pending._source_rank(), tag + _CLOCK_TAG).wait()
            return float(clock[0])
        return self._posted_recv(tensors, tag, sender_start, None)

    def _posted_recv(self, tensors: Tensors, tag: int, sender_start: Callable[[dist.Work], float],
                     src: int | None) -> NeuronWork:
        """A receive charged when its data has come (on the first wait), after the point of the
        issuing stream where it was posted and not before the sender's transfer began."""
        (tensor,) = tensors
        device = self._device_of("recv", tensors)
        staged = Staged(tensor)
        if src is None:  # from any source
            pending = self._gloo.recv_anysource([staged.buffer], tag)
        else:
            pending = self._gloo.recv([staged.buffer], src, tag)
        posted = None
        if device is not None and recording_enabled():
            posted = torch.neuron.Event(device=device)
            posted.record(torch.neuron.current_stream(device))
        work = self._work(tensors, device, None, None)

        def finish() -> None:
            self._p2p_finish("recv", pending, staged)()
            start = sender_start(pending)
            if posted is not None:
                work._end, _ = self._streams.charge_timed("recv", _nbytes(tensors), self.size(), device,
                                                          after=posted, not_before=start)
                work._stream = self._streams.get(device)
        work._finish = finish
        if src is None:
            work.set_source(pending._source_rank)
        return work

    def _p2p_finish(self, kind: str, pending: dist.Work, staged: Staged) -> Callable[[], None]:
        def finish() -> None:
            try:
                pending.wait()
            except Exception as error:
                raise self._translate(error, kind) from error
            staged.finish()
        return finish

    # ---- coalescing blocks (dist._coalescing_manager) ----------------------------------------------
    def _start_coalescing(self, device: torch.device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: torch.device) -> NeuronWork:
        works, self._coalescing = self._coalescing or [], None
        return CoalescedWork(works)

    # ---- old names of the same collectives ------------------------------------------------------
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single
