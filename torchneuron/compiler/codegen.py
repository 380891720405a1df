"""Host code generation: Inductor's C++ backend registered for the `neuron` device.

A neuron buffer is host memory, so Inductor's CPU code generation (`CppScheduling`) produces
correct kernels for it; this module owns the pieces that make Inductor accept the device:

- `NeuronDeviceOpOverrides`: device guard, streams and synchronisation lines in generated code;
- `NeuronWrapperCodegen`: the Python wrapper. It allocates buffers with the runtime's
  `empty_strided`, calls the C++ kernels as CPU kernels (they take raw pointers into host
  memory) and embeds the graph's `DeviceProgram` (the fused-kernel
  plan built by `pipeline.NeuronGraphPass`), so the generated module charges its kernels to the
  device timeline on every call, also when Inductor's caches reload it in a later process. In
  tiered mode (tiered.py) its kernels build in the background (`BackgroundBuild`) and `call`
  runs the graph's ATen tier until they are built;
registration.py registers both with Inductor.
"""
from __future__ import annotations

import torch
from torch._inductor.codegen.common import DeviceOpOverrides
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.virtualized import V

from torchneuron.compiler.plan import PLAN_META_KEY

PROGRAM_NAME = "_neuron_program"
BUILD_NAME = "_neuron_build"


class NeuronDeviceOpOverrides(DeviceOpOverrides):
    """Lines Inductor writes for device management: the host executes synchronously."""

    def import_get_raw_stream_as(self, name: str) -> str:
        return f"def {name}(index):\n    return torch.neuron.current_stream(index).stream_id\n"

    def set_device(self, device_idx: int) -> str:
        return f"torch.neuron.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.neuron.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.neuron.device({device_idx})"

    def cpp_kernel_type(self) -> str:
        return "void*"


def _tiered() -> bool:
    from torchneuron.compiler import tiered

    return _current_plan() is not None and tiered.enabled()


def _current_plan():
    graph = V.graph
    module = getattr(graph, "module", None)
    meta = getattr(module, "meta", None) or {}
    return meta.get(PLAN_META_KEY)


class NeuronWrapperCodegen(PythonWrapperCodegen):
    """Python wrapper whose kernel calls go to host C++ kernels and whose `call` charges the
    graph's fused kernels to the device timeline."""

    @staticmethod
    def create(is_subgraph: bool, subgraph_name: str | None, parent_wrapper: PythonWrapperCodegen | None,
               partition_signatures=None) -> PythonWrapperCodegen:
        if is_subgraph:
            return SubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper, partition_signatures)
        return NeuronWrapperCodegen()

    def _generate_kernel_call_helper(self, kernel_name: str, call_args, *, device=None, **kwargs) -> None:
        device = device or V.graph.get_current_device_or_throw()
        if device.type == "neuron":
            device = torch.device("cpu")  # the kernel reads and writes host memory directly
        super()._generate_kernel_call_helper(kernel_name, call_args, device=device, **kwargs)

    def make_allocation(self, name, device, dtype, shape, stride, allocation_shape=None, is_pinned=False) -> str:
        """Buffers come straight from the device allocator (`empty_strided_neuron`, the runtime's
        counterpart of Inductor's `empty_strided_cpu`) instead of through `torch.empty_strided`."""
        from torch._inductor import config as inductor_config

        if device.type != "neuron" or is_pinned or inductor_config.test_configs.track_memory_lifecycle:
            return super().make_allocation(name, device, dtype, shape, stride, allocation_shape, is_pinned)
        line = super().make_allocation(name, torch.device("cpu"), dtype, shape, stride, allocation_shape)
        return line.replace(f"{name} = empty_strided_cpu(", f"{name} = empty_strided_neuron(", 1)

    def write_header(self) -> None:
        super().write_header()
        self.imports.writeline("from torchneuron.runtime._C import empty_strided as empty_strided_neuron")
        plan = _current_plan()
        if plan is not None:
            self.imports.writeline("from torchneuron.compiler.program import DeviceProgram")
            self.header.writeline(f"{PROGRAM_NAME} = DeviceProgram.from_json({plan.to_json()!r})")
        if _tiered():
            self.imports.writeline("from torchneuron.compiler.tiered import BackgroundBuild")
            self.header.writeline("async_compile = BackgroundBuild()")

    def write_async_compile_wait(self) -> None:
        if not _tiered():
            return super().write_async_compile_wait()
        self.prefix.splice(f"""

            {BUILD_NAME} = async_compile.start(globals())
            del async_compile
            """)

    def generate_after_suffix(self, result) -> None:
        super().generate_after_suffix(result)
        if _current_plan() is not None:
            build = f", {BUILD_NAME}" if _tiered() else ""
            result.writeline(f"call = {PROGRAM_NAME}.wrap(call{build})")
