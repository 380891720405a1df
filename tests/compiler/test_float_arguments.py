"""Python float arguments that change between calls of a compiled function.

Dynamo passes such a float in as a 0-d tensor (`specialize_float=False`). Where AOTAutograd cannot
keep it a tensor (pow's exponent, a norm's eps, clamp's bound), its tensorify pass restarts
Dynamo's analysis to specialize the float: the backend must let that restart through, not report
it as a compile failure. And where it burns the value into the graph without a restart, the
captured graph is the same for every value: no cache may serve a later value the artifact of an
earlier one (pytorch/pytorch#197889, which Inductor-CPU has).
"""
import pytest
import torch
import torch.nn.functional as F

import torchneuron  # noqa: F401

VALUES = (0.5, 0.25, 0.125, 2.0)
PROGRAMS = {
    "pow exponent": lambda x, s: x.pow(s) + s,
    "clamp bound": lambda x, s: torch.clamp(x, max=s) * 2,
    "full value": lambda x, s: x + torch.full((4,), s, device=x.device),
    "rms_norm eps": lambda x, s: F.rms_norm(x * s, (4,), eps=s + 1e-3),
    "huber delta": lambda x, s: F.huber_loss(x, x.flip(0) * 3, delta=s),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_changing_float_argument_gives_eagers_result_for_every_value(name, fresh_dynamo):
    program = PROGRAMS[name]
    compiled = torch.compile(program, backend="neuron")
    x = torch.rand(4) + 0.5
    for value in VALUES:
        got = compiled(x.to("neuron"), value).cpu()
        torch.testing.assert_close(got, program(x, value), msg=f"{name} with {value}")


def test_a_float_argument_keeps_its_graph_out_of_the_memory_cache(fresh_dynamo):
    from torchneuron.compiler import cache

    seen = []

    def spy(gm, example_inputs):  # (Dynamo drops the placeholders' graph arguments after the call)
        seen.append((cache.has_float_arguments(gm), cache.graph_key(gm, example_inputs, {})))
        return gm.forward

    program = torch.compile(lambda x, s: x.pow(s) + s, backend=spy)
    program(torch.ones(2), 0.5)
    program(torch.ones(2), 0.25)  # the float is now dynamic: an argument of the graph
    (first_has_floats, first_key), (second_has_floats, second_key) = seen
    assert not first_has_floats and first_key is not None
    assert second_has_floats and second_key is None
