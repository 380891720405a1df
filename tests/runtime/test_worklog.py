"""The work log's record layout and the enums both languages use come from C++ (_C), once."""
from __future__ import annotations

import numpy as np
import torch

from torchneuron.ops import policy
from torchneuron.runtime import _C, worklog
from torchneuron.runtime.extension import runtime_ops


def test_record_dtype_is_the_cpp_struct():
    assert worklog.RECORD.itemsize == int(runtime_ops().worklog_record_size())
    assert worklog.RECORD.names[:3] == ("kind", "op_id", "device")
    assert worklog.RECORD["sigs"].shape == (worklog.MAX_SIGS,)


def test_records_decode_with_it():
    worklog.take()  # start from an empty log
    a = torch.ones(3, 5, device="neuron")
    (a * 2).sum()
    records = worklog.take()
    names = [worklog.op_name(int(r["op_id"])) for r in records if r["kind"] == worklog.OP]
    assert "aten::mul.Tensor" in names
    mul = records[names.index("aten::mul.Tensor")]
    assert worklog.signature(mul["sigs"][0]) == (torch.float32, (3, 5))


def test_enums_are_distinct_and_flags_are_bits():
    kinds = [worklog.OP, worklog.COPY, worklog.EVENT_RECORD, worklog.EVENT_WAIT, worklog.SYNC_DEVICE,
             worklog.SYNC_STREAM, worklog.SYNC_EVENT]
    assert sorted(kinds) == list(range(7))
    for bits in (_C.WORK_FLAGS.values(), _C.OP_POLICY.values()):
        bits = list(bits)
        assert all(b > 0 and b & (b - 1) == 0 for b in bits) and len(set(bits)) == len(bits)
    assert policy.fallback_policy("aten::linalg_svd") & policy.HOST_ONLY
    assert set(_C.QUEUE_KINDS) >= {"SYNC", "FUNCTIONAL", "INPLACE", "ALLOCATE", "VIEW", "OUT", "RANDOM_BIT"}
    assert np.dtype(_C.WORK_RECORD_DTYPE) == worklog.RECORD



def test_an_error_noting_a_records_context_reaches_the_caller_and_leaves_the_device_usable():
    import pytest

    def broken(code):
        raise KeyError("classify failed")
    a = torch.ones(4, device="neuron")
    _C.contexts_start({}, broken, torch.nn.Module)
    try:
        with pytest.raises(KeyError, match="classify failed"):
            a.mul(3)
        with pytest.raises(RuntimeError, match="already being recorded"):
            _C.contexts_start({}, broken, torch.nn.Module)
    finally:
        _C.contexts_take()
    assert torch.equal((a + 1).cpu(), torch.full((4,), 2.0))  # no hook left behind
    assert _C.context_count() == 0
