"""Tiered execution of compiled graphs: a planned graph runs at once with ATen kernels while
Inductor's fused C++ for it builds in the background, and switches to the C++ when it is ready.

A cold `torch.compile` on this host spends seconds in Dynamo, AOTAutograd, the device pipeline
and Inductor's Python code generation, and tens of seconds in g++ building one library per fused
kernel. Once the device pipeline (pipeline.py) has planned a graph, its kernel plan, hence its
modeled device time, is known; only the host code is missing. With TORCHNEURON_COMPILE_TIERED
on (the default):

- `backend.compile_graph` offers an `AtenTier` of the post-autograd graph (NKI ops lowered to
  their host kernels) while Inductor generates the code (`offering`);
- the generated module's `async_compile` is a `BackgroundBuild` (codegen.py): each kernel's C++
  goes to a pool of build threads instead of being waited for when the module loads, and
  `start(globals())` returns the module's `Build`, which loads the libraries when they are built;
- `DeviceProgram.wrap` (program.py) runs the ATen tier until the build is done, the generated
  code after. Both charge the plan's kernels to the device timeline (the same modeled time).

Thread safety: only g++ (a subprocess, outside the GIL, started by build threads running at a
lower priority so that the steps meanwhile keep the CPU) and loading the built libraries run off
the calling thread. Inductor's code generation stays on it: Inductor's configuration is
process-global (torch.compile's config patches would come and go under a compile running in a
thread), and Inductor's own async mode (`fx_compile_mode="async+subprocess"`) compiles in a child
process where the neuron device is not registered, and disables Inductor's caches.

Results: the ATen tier runs the eager kernels, so adaptive eager's programs (which round as the
eager kernels, eager_numerics.py) give eager's results bit for bit in both tiers; a torch.compile
graph gives eager's results in the ATen tier and Inductor's in the C++ one (the usual compiled
against eager difference). The ATen tier returns its outputs with the strides of the generated
code's, so a forward in one tier and its backward in the other agree on saved tensors; a graph
whose output strides are symbolic has no ATen tier (its first call waits for the build).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from torchneuron import settings
from torchneuron.compiler.errors import NeuronCompileError

BUILD_NICENESS = 10
_local = threading.local()
_lock = threading.Lock()
_builders: ThreadPoolExecutor | None = None
_loader: ThreadPoolExecutor | None = None
_pending: set["Build"] = set()
_stats = {"builds": 0, "builds_failed": 0, "build_seconds": 0.0, "aten_tier_calls": 0, "switches": 0,
          "waited_for_build": 0}


def enabled() -> bool:
    """Whether new graphs are generated for tiered execution (TORCHNEURON_COMPILE_TIERED)."""
    return settings.current().compile_tiered


def _pools() -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The g++ threads (as many as Inductor's compile threads) and the one thread that loads
    each module's libraries once they are built."""
    global _builders, _loader
    with _lock:
        if _builders is None:
            from torch._inductor.async_compile import get_compile_threads

            _builders = ThreadPoolExecutor(max(1, get_compile_threads()), thread_name_prefix="torchneuron-build",
                                           initializer=_lower_priority)
            _loader = ThreadPoolExecutor(1, thread_name_prefix="torchneuron-load", initializer=_lower_priority)
    return _builders, _loader


def _lower_priority() -> None:
    """Builds yield the CPU to the caller's thread: a build thread (and the g++ it starts, which
    inherits its priority) runs BUILD_NICENESS steps nicer, so the steps running meanwhile are not
    slowed down by the builds on a host with few cores."""
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + BUILD_NICENESS))
    except (AttributeError, OSError):  # not Linux, or not allowed: builds at the caller's priority
        pass


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class AtenTier:
    """A post-autograd graph run with ATen kernels, called as Inductor's generated code is:
    `tier(args)` with a list it empties, returning the outputs with the generated code's strides."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.output_strides: list[tuple[int, ...] | None] | None = None
        # The strides the graph was traced with: Inductor compiles a backward for the forward's
        # generated output strides, and an ATen graph's views need the strides it was traced for.
        self.input_strides: list[tuple[int, ...] | None] = []
        written = {n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.args
                   and isinstance(n.args[0], torch.fx.Node) and getattr(n.target, "_schema", None) is not None
                   and n.target._schema.is_mutable}
        for node in gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            stride = None
            if isinstance(val, torch.Tensor) and node not in written:
                try:
                    stride = tuple(int(s) for s in val.stride())
                except (TypeError, ValueError):  # symbolic
                    stride = None
            self.input_strides.append(stride)

    @staticmethod
    def of(gm: torch.fx.GraphModule) -> "AtenTier":
        """A tier over a copy of `gm` (Inductor rewrites `gm` itself), NKI ops lowered to host kernels."""
        from torchneuron.compiler.host_stand_ins import lower_to_host

        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        for node in graph.nodes:  # a device kernel may return other strides than its fake tensor's:
            if node.op == "call_function" and node.target in _VIEWS:  # a view of it could then fail
                node.target = torch.ops.aten.reshape.default
        copy = torch.fx.GraphModule(gm, graph)
        lower_to_host(copy)
        return AtenTier(copy)

    def set_output_strides(self, strides: list[Any] | None) -> bool:
        """Takes the generated code's output strides; False if one is symbolic (no ATen tier then)."""
        if strides is None:
            return False
        concrete: list[tuple[int, ...] | None] = []
        for entry in strides:
            if entry is None:
                concrete.append(None)
                continue
            try:
                concrete.append(tuple(int(s) for s in entry))
            except (TypeError, ValueError):
                return False
        self.output_strides = concrete
        return True

    def __call__(self, args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        for i, (value, stride) in enumerate(zip(values, self.input_strides)):
            if stride is not None and isinstance(value, torch.Tensor) and value.stride() != stride \
                    and value.numel() > 1:
                values[i] = torch.empty_strided(value.shape, stride, dtype=value.dtype,
                                                device=value.device).copy_(value)
        outputs = self.gm(*values)
        del values
        strides = self.output_strides or ()
        if not any(isinstance(o, torch.Tensor) and s is not None and o.stride() != s and o.numel() > 1
                   for o, s in zip(outputs, strides)):
            return outputs
        restrided = list(outputs)
        for i, (out, stride) in enumerate(zip(outputs, strides)):
            if isinstance(out, torch.Tensor) and stride is not None and out.stride() != stride and out.numel() > 1:
                like = torch.empty_strided(out.shape, stride, dtype=out.dtype, device=out.device)
                restrided[i] = like.copy_(out).requires_grad_(out.requires_grad)
        return type(outputs)(restrided) if isinstance(outputs, tuple) else restrided


class _Offer:
    def __init__(self, tier: AtenTier | None) -> None:
        self.tier, self.build = tier, None


@contextlib.contextmanager
def offering(tier: AtenTier | None) -> Iterator[_Offer]:
    """Offers `tier` to the module Inductor generates (and loads) inside; `.build` is its Build."""
    offer, prior = _Offer(tier), getattr(_local, "offer", None)
    _local.offer = offer
    try:
        yield offer
    finally:
        _local.offer = prior


class _Kernel:
    """One kernel's library, being built."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self.load = load


class Build:
    """The background build of one generated module's kernels, and the tier that runs meanwhile."""

    def __init__(self, scope: dict[str, Any], tier: AtenTier | None) -> None:
        self.tier = tier
        self.started = time.perf_counter()
        kernels = [(name, value) for name, value in scope.items() if isinstance(value, _Kernel)]
        with _lock:
            _pending.add(self)
            _stats["builds"] += 1
        self._future: Future = _pools()[1].submit(self._finish, scope, kernels)

    def _finish(self, scope: dict[str, Any], kernels: list[tuple[str, _Kernel]]) -> None:
        from torch._inductor.codecache import CodeCacheFuture

        try:
            for name, kernel in kernels:
                scope[name] = kernel.load()
            for name, value in list(scope.items()):  # anything else Inductor's AsyncCompile started
                if isinstance(value, (Future, CodeCacheFuture)):
                    scope[name] = value.result()
        except BaseException:
            with _lock:
                _stats["builds_failed"] += 1
            raise
        finally:
            with _lock:
                _stats["build_seconds"] += time.perf_counter() - self.started
                _pending.discard(self)

    @property
    def ready(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        """Waits for the build; raises NeuronCompileError if it failed."""
        try:
            self._future.result()
        except Exception as error:
            raise NeuronCompileError(f"building the graph's host code failed: {type(error).__name__}: "
                                     f"{str(error).strip()[:500]}") from error

    def runner(self, compiled: Callable[[list], Any]) -> Callable[[list], Any]:
        """What runs this call: the ATen tier while the build is under way, `compiled` after."""
        if self.tier is not None and not self._future.done():
            _stats["aten_tier_calls"] += 1
            return self.tier
        if self.tier is not None:
            _stats["switches"] += 1
        else:
            _stats["waited_for_build"] += not self._future.done()
        self.wait()
        self.tier = None  # frees the graph copy
        return compiled


class BackgroundBuild:
    """The generated module's `async_compile` in tiered mode: C++ kernels build in the background."""

    def __init__(self) -> None:
        self._inductor: Any = None

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> _Kernel:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return _Kernel(CppPythonBindingsCodeCache.load_pybinding_async(argtypes, source_code,
                                                                        submit_fn=_pools()[0].submit))

    def start(self, scope: dict[str, Any]) -> Build:
        """Starts loading the module's kernels as they are built; takes the offered ATen tier."""
        offer = getattr(_local, "offer", None)
        tier = offer.tier if offer is not None and offer.build is None else None
        build = Build(scope, tier)
        if offer is not None and offer.build is None:
            offer.build = build
        return build

    def __getattr__(self, name: str) -> Any:  # anything else: Inductor's own AsyncCompile
        if self._inductor is None:
            from torch._inductor.async_compile import AsyncCompile

            self._inductor = AsyncCompile()
        return getattr(self._inductor, name)


def wait(timeout: float | None = None) -> bool:
    """Waits until every background build has finished (True) or `timeout` seconds passed (False)."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    while True:
        with _lock:
            pending = [build for build in _pending if not build.ready]
        if not pending:
            return True
        for build in pending:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            try:
                build._future.result(timeout=left)
            except TimeoutError:
                return False
            except Exception:
                pass  # reported when the graph next runs


def stats() -> dict[str, float]:
    """Builds started and failed, their wall seconds in all, calls the ATen tier ran, switches to
    the generated code, first calls that had to wait for a build (no ATen tier), builds pending."""
    with _lock:
        return {**_stats, "pending": len(_pending)}
