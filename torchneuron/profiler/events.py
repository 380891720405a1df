"""What the profiler reports: one unit of device work (DeviceEvent) and a memory sample."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DeviceEvent:
    """One unit of device work as the profiler reports it (times in microseconds of modeled
    device time, relative to the start of the device's first event in the profile)."""

    id: int
    device: int
    stream: int
    kind: str            # op | copy | fused | graph | nki | collective | other
    name: str            # as charged (aten ops with their overload: "aten::sum.dim_IntList")
    op: str              # aten op without overload ("aten::sum"), or the charged name
    category: str        # the performance model's op category ("matmul", "elementwise", ...)
    engine: str
    bound: str
    start_us: float
    duration_us: float
    flops: float
    bytes: float
    fallback: bool
    host_fallback_us: float
    launch_us: float     # modeled launch cost included in duration_us
    copy_kind: str       # h2d | d2h | d2d | ""
    dtype: str
    shapes: str
    source_file: str
    source_line: int
    source_function: str
    module_path: str
    module_type: str
    phase: str           # forward | backward | optimizer | other
    autograd_node: str
    forward_source: str  # for backward work: the forward op's source line
    host_time_us: float  # host wall time when issued, relative to the profile's start
    thread: int
    host_op: str = ""    # the torch.profiler op it is linked to (filled by linking)
    host_op_id: int = -1
    meta: dict | None = None


@dataclass(slots=True)
class MemorySample:
    """Device memory right after a piece of work was issued (profile_memory=True)."""

    event_id: int
    device: int
    host_time_us: float
    device_time_us: float
    allocated_bytes: int
    reserved_bytes: int
