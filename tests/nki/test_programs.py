"""How the programs of a launch run (programs.py): the restart from sequential to cooperating
programs leaves no trace, ranks running side by side have their own SBUF, rank-dependent
control flow around a collective either completes or fails cleanly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torchneuron.nki as nki
import torchneuron.nki.collectives as ncc
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki.errors import CollectiveError


def test_restart_applies_in_place_writes_once():
    """The first, sequential attempt stops at the collective after program 0 incremented its row
    of the caller's tensor; the cooperative rerun starts from the caller's values again."""

    @nki.jit
    def bump_then_reduce(x):
        r = nl.program_id(0)
        row = nl.ndarray((1, 8), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=x[r:r + 1, :])
        one = nl.ndarray((1, 8), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=one, data=row, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=x[r:r + 1, :], src=one)
        total = nl.ndarray((1, 8), dtype=x.dtype, buffer=nl.sbuf)
        ncc.all_reduce(srcs=[one], dsts=[total], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)
        out = nl.ndarray((2, 8), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[r:r + 1, :], src=total)
        return out

    x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    before = x.clone()
    out = bump_then_reduce[2](x)
    torch.testing.assert_close(x, before + 1, rtol=0, atol=0)
    torch.testing.assert_close(out, (before + 1).sum(0, keepdim=True).expand(2, 8), rtol=0, atol=0)
    out = bump_then_reduce[2](x)  # later calls start cooperative directly
    torch.testing.assert_close(x, before + 2, rtol=0, atol=0)


def test_ranks_side_by_side_have_their_own_sbuf():
    """Each of 4 ranks holds a tile of ~60% of a partition's SBUF across the collective: on one
    shared SBUF they could not all be alive; each rank is its own NeuronCore."""

    @nki.jit
    def big_tiles(x):
        r = nl.program_id(0)
        cols = 24 * 1024  # fp32: 96 KiB a partition (trn2 has 192 KiB)
        big = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=big, value=1.0)
        small = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=small, src=big[:, 0:1])
        total = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        ncc.all_reduce(srcs=[small], dsts=[total], replica_group=ncc.ReplicaGroup([[0, 1, 2, 3]]), op=nl.add)
        nisa.tensor_copy(dst=small, src=big[:, 1:2])  # keeps `big` alive past the collective
        out = nl.ndarray((4, 128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[r], src=total)
        return out

    out = big_tiles[4](np.zeros(1, np.float32))
    assert np.array_equal(out, np.full((4, 128, 1), 4.0, np.float32))


def test_rank_dependent_loop_counts_deadlock_cleanly():
    @nki.jit
    def uneven(x):
        r = nl.program_id(0)
        t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=1.0)
        for _ in range(r + 1):  # rank 1 makes one more all-reduce than rank 0
            ncc.all_reduce(srcs=[t], dsts=[t], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)
        return x

    with pytest.raises(CollectiveError, match=r"rank 1 waits in its 2nd collective.*\[0\] finished"):
        uneven[2](np.zeros(1, np.float32))
