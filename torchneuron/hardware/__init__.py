"""torchneuron.hardware: targets (specs), the performance model, the device timeline.

The floor above the runtime: pure Python (torch for dtypes, numpy); it reads the runtime's work
log and devices, nothing above. Modules:

- targets.py: the machines (trn1, trn2, trn3) and the current target;
- instructions.py: the cost of one NeuronCore instruction (the NKI simulator's interface);
- taxonomy.py: the category of an aten op by name (`op_category`), shared with eager and the compiler;
- model.py: the cost of one aten op, copy or collective (`op_cost`, `Cost`);
- timeline.py: per-device stream clocks of modeled device time, and their listeners;
- estimate.py: the `estimate()` context manager summarising a region's device work;
- worklog.py: the runtime's work log turned into device time (`drain`, `charge`);
- properties.py: the device properties and memory capacity the current target gives.

`install()` (called when torchneuron is imported) connects the work log to the timeline and
sizes the devices' memory.

Note: `torchneuron.hardware.estimate` is the function; its module is importable with
`from torchneuron.hardware.estimate import Estimate`.
"""

from .estimate import Estimate, estimate
from .instructions import ENGINES, instruction_cost
from .model import Cost, TensorSig, collective_cost, copy_cost, launch_cost, op_cost
from .targets import TARGETS, Target, UnsupportedDtypeError, get_target, on_target_change, set_target
from .timeline import DeviceTimeline, TimelineEntry, add_listener, all_timelines, get_timeline, remove_listener
from .worklog import charge, drain
from . import properties, worklog

__all__ = [
    "ENGINES", "TARGETS", "Cost", "DeviceTimeline", "Estimate", "Target", "TensorSig",
    "TimelineEntry", "UnsupportedDtypeError", "add_listener", "all_timelines", "charge", "collective_cost",
    "copy_cost", "drain", "estimate", "get_target", "get_timeline", "install", "instruction_cost", "launch_cost",
    "on_target_change", "op_cost", "remove_listener", "set_target",
]


def install() -> None:
    """Prices the runtime's work log on the device timeline and sizes every device's memory."""
    worklog.install()
    properties.configure_memory_capacity()
