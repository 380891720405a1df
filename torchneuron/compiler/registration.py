"""Registering the compiler with Inductor: C++ code generation, the wrapper and the graph pass for
"neuron" (the package's `register()` makes the backend name known to Dynamo)."""
from __future__ import annotations

from torchneuron.compiler import device_interface


_inductor_registered = False


def register_inductor() -> None:
    """Registers Inductor's C++ backend, the wrapper and the graph pipeline for "neuron", and a
    lowering calling the eager kernel for each op the core op set keeps whole that Inductor has
    none for (idempotent). Imports Inductor, so it runs on first use of the backend."""
    global _inductor_registered
    if _inductor_registered:
        return
    from torch._inductor.codegen.common import register_backend_for_device, register_device_op_overrides
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.lowering import lowerings

    from torchneuron.compiler.codegen import NeuronDeviceOpOverrides, NeuronWrapperCodegen
    from torchneuron.compiler.decompositions import KEEP_WHOLE
    from torchneuron.compiler.lowerings import register_eager_kernel_lowering
    from torchneuron.compiler.pipeline import NeuronGraphPass

    device_interface.register()  # Inductor looks the device up (also without Dynamo)
    register_device_op_overrides("neuron", NeuronDeviceOpOverrides())
    register_backend_for_device("neuron", CppScheduling, NeuronWrapperCodegen, CppWrapperCpu,
                                device_custom_pass=NeuronGraphPass())
    for op in KEEP_WHOLE:
        if op not in lowerings:
            register_eager_kernel_lowering(op)
    _inductor_registered = True
