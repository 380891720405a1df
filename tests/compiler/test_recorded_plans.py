"""`recorded_plans()`: the plans a region charges, with their size bindings, priced at other sizes."""
import torch

import torchneuron  # noqa: F401
from torchneuron.compiler.cost import plan_costs
from torchneuron.compiler.program import recorded_plans
from torchneuron.hardware.targets import TRN2


def test_a_symbolic_plan_recorded_at_one_size_prices_another():
    fn = torch.compile(lambda x, w: torch.relu(x @ w).sum(), backend="neuron", dynamic=True)
    x, w = torch.randn(24, 40, device="neuron"), torch.randn(40, 56, device="neuron")
    with recorded_plans() as charged:
        fn(x, w)
    fn(x, w)  # outside the region: not recorded
    assert len(charged) == 1
    plan, bindings = charged[0]
    assert sorted(bindings.values()) == [24, 40, 56]
    bigger = {name: 16 * value for name, value in bindings.items()}
    small = sum(c.duration_s for c in plan_costs(plan.kernels, bindings, TRN2))
    large = sum(c.duration_s for c in plan_costs(plan.kernels, bigger, TRN2))
    assert large > 4 * small  # 4096x the FLOPs: the fp32 matmul, not the launches, sets the time
