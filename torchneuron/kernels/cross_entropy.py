"""Cross-entropy of a linear head in NKI: loss = CE(h @ W^T, labels), the [tokens, vocab]
logits never written to HBM. Forward and backward.

- `linear_ce_fwd(h [T, D], w [V, D], labels [T, 1] int32) -> (loss [T, 1], lse [T, 1])` (fp32):
  per token, lse = log sum_v exp(h . w_v) and loss = lse - h . w_label; a negative label (the
  ignore index) gives loss 0.
- `linear_ce_bwd(h, w, labels, lse, grad [T, 1] fp32) -> (dh [T, D], dw [V, D] fp32)`: with
  dlogits = grad * (softmax - onehot(label)) (0 on ignored tokens), dh = dlogits @ W and
  dw = dlogits^T @ h.
- `ce_fwd(logits [T, V], labels)` / `ce_bwd(logits, labels, lse, grad)`: the same over logits
  that exist already (one read forward; one read and one write of dlogits backward).

T and D multiples of 128, any V, bf16 / fp16 / fp32 h and w of one dtype.

Schedule: tokens go in blocks of up to `block_tiles(...)` 128-token tiles whose h^T (and, in
backward, h and an fp32 dh accumulator) stay in SBUF; per block, the vocabulary streams
through in chunks of 512: W^T [D, 512] is loaded once per block by one transposing DMA (and W
itself in backward), each tile's logits chunk is D/128 matmuls into one PSUM bank. Forward
keeps an online log-sum-exp per token (running max and rescaled sum, the Scalar engine's exp
summing its row as it goes) and picks the label's logit with `range_select` (its row max is
the label's logit when the label is in the chunk). Backward recomputes the chunk's logits,
dlogits = grad * (exp(logits - lse) - onehot) in the input dtype, then dh += dlogits @ W
(dlogits transposed 128 x 128 on the Tensor engine) and dW = dlogits^T @ h accumulated over the
block's tiles in PSUM; blocks after the first add their dW into the fp32 result in HBM.
"""
from __future__ import annotations

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

P = 128
CHUNK = 512        # vocabulary entries per logits chunk (one fp32 PSUM bank)
NEG = -3.0e38
SBUF_BUDGET = 160 * 1024  # bytes a partition the token block and the W chunk may take


class UnsupportedInput(ValueError):
    """Operands the cross-entropy kernels do not take (the op falls back to the generic path)."""


def check_shapes(h, w, labels, what: str) -> tuple[int, int, int]:
    """(T, D, V) of the operands, or UnsupportedInput naming the kernel's constraint."""
    if len(h.shape) != 2 or len(w.shape) != 2 or h.shape[1] != w.shape[1]:
        raise UnsupportedInput(f"{what}: need h [T, D] and w [V, D]; got h {tuple(h.shape)}, w {tuple(w.shape)}")
    t, d = h.shape
    v = w.shape[0]
    if t % P or d % P:
        raise UnsupportedInput(f"{what}: tokens T={t} and hidden size D={d} must be multiples of {P}")
    if tuple(labels.shape) != (t, 1):
        raise UnsupportedInput(f"{what}: labels must be [T, 1] = [{t}, 1], got {tuple(labels.shape)}")
    return t, d, v


def _itemsize(dtype) -> int:
    size = getattr(dtype, "itemsize", None)
    return size if isinstance(size, int) else 4


def block_tiles(t: int, d: int, itemsize: int, backward: bool) -> int:
    """128-token tiles a block keeps in SBUF: h^T (and in backward h, dlogits and fp32 dh)
    next to the streamed W chunk (W^T, and W in backward)."""
    per_tile = d * itemsize + (d * (itemsize + 4) + CHUNK * itemsize if backward else 0)
    w_chunk = (2 if backward else 1) * d * CHUNK // P * itemsize
    if w_chunk + per_tile > SBUF_BUDGET:
        raise UnsupportedInput(f"linear cross-entropy kernel: hidden size D={d} does not fit a W chunk and one "
                               f"token tile in SBUF ({w_chunk + per_tile} B a partition; at most {SBUF_BUDGET})")
    return max(1, min(t // P, (SBUF_BUDGET - w_chunk) // per_tile))


def _load_transposed(src, row0: int, rows: int, d: int):
    """src[row0:row0 + rows, :] transposed into SBUF as [128, D/128, rows] (one DMA: the
    source rows are contiguous, the engine permutes them)."""
    dst = nl.ndarray((P, d // P, rows), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=dst, src=src.ap([[d, rows], [P, d // P], [1, P]], offset=row0 * d))
    return dst


def _labels(labels, t0: int, nt: int):
    """A block's labels as fp32 [128, nt] (label and label + 1: the bounds range_select keeps)."""
    raw = nl.ndarray((P, nt), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=raw, src=labels.ap([[1, P], [P, nt]], offset=t0))
    lo = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=lo, src=raw, engine=nisa.gpsimd_engine)
    hi = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=hi, data=lo, op0=nl.add, operand0=1.0, engine=nisa.gpsimd_engine)
    valid = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=valid, data=lo, op0=nl.greater_equal, operand0=0.0, engine=nisa.gpsimd_engine)
    return lo, hi, valid


def _logits(h_t, w_t, ti: int, n: int, d: int):
    """One 128-token tile's logits over a vocabulary chunk: [128, n] fp32 in PSUM."""
    s_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum)
    for c in range(d // P):
        nisa.nc_matmul(dst=s_ps, stationary=h_t[:, c, ti * P:(ti + 1) * P], moving=w_t[:, c, 0:n])
    return s_ps


def _lse_state(nt: int):
    """Running max, rescaled sum and label logit of nt token tiles (online log-sum-exp)."""
    state = []
    for value in (NEG, 0.0, NEG):
        tile = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=value, engine=nisa.gpsimd_engine)
        state.append(tile)
    return tuple(state)


def _online_step(s, col: slice, n: int, v0: int, labels_f, state, dtype) -> None:
    """Folds a [128, n] chunk of logits (vocabulary v0..v0+n) into one tile's running state:
    the label's logit (range_select keeps the label's column; its row max is that logit), the
    new max, the old sum rescaled by exp(old max - new max) plus the chunk's sum of exps."""
    lo, hi, _ = labels_f
    m, total, target = state
    picked = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.range_select(dst=picked, on_true_tile=s, comp_op0=nl.greater_equal, comp_op1=nl.less,
                      bound0=lo[:, col], bound1=hi[:, col], range_start=float(v0), on_false_value=NEG,
                      reduce_res=target[:, col], reduce_op=nl.maximum, reduce_cmd=nisa.reduce_cmd.reduce)
    m_new = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m_new, op=nl.maximum, data=s, axis=1)
    nisa.tensor_tensor(dst=m_new, data1=m_new, data2=m[:, col], op=nl.maximum)
    neg = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg, data=m_new, op0=nl.multiply, operand0=-1.0, engine=nisa.gpsimd_engine)
    alpha = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=alpha, op=nl.exp, data=m[:, col], bias=neg)
    chunk_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    probs = nl.ndarray((P, n), dtype=dtype, buffer=nl.sbuf)
    nisa.activation(dst=probs, op=nl.exp, data=s, bias=neg, reduce_res=chunk_sum, reduce_op=nl.add)
    nisa.scalar_tensor_tensor(dst=total[:, col], data=total[:, col], op0=nl.multiply, operand0=alpha,
                              op1=nl.add, operand1=chunk_sum)
    nisa.tensor_copy(dst=m[:, col], src=m_new, engine=nisa.gpsimd_engine)


def _store_loss(loss, lse, t0: int, nt: int, labels_f, state) -> None:
    """lse = max + log(sum) and loss = (lse - label logit) * valid of nt tiles, to HBM."""
    m, total, target = state
    lse_sb = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lse_sb, op=nl.log, data=total)
    nisa.tensor_tensor(dst=lse_sb, data1=lse_sb, data2=m, op=nl.add)
    loss_sb = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=loss_sb, data1=lse_sb, data2=target, op=nl.subtract)
    nisa.tensor_tensor(dst=loss_sb, data1=loss_sb, data2=labels_f[2], op=nl.multiply)
    nisa.dma_copy(dst=loss.ap([[1, P], [P, nt]], offset=t0), src=loss_sb)
    nisa.dma_copy(dst=lse.ap([[1, P], [P, nt]], offset=t0), src=lse_sb)


def _grad_state(lse, grad, t0: int, nt: int, labels_f, width: int):
    """-lse, the incoming gradient zeroed on ignored tokens, and a ones tile for the one-hot."""
    neg_lse = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=neg_lse, src=lse.ap([[1, P], [P, nt]], offset=t0))
    nisa.tensor_scalar(dst=neg_lse, data=neg_lse, op0=nl.multiply, operand0=-1.0, engine=nisa.gpsimd_engine)
    g = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=g, src=grad.ap([[1, P], [P, nt]], offset=t0))
    nisa.tensor_tensor(dst=g, data1=g, data2=labels_f[2], op=nl.multiply, engine=nisa.gpsimd_engine)
    ones = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0, engine=nisa.gpsimd_engine)
    return neg_lse, g, ones


def _dlogits(s, col: slice, n: int, v0: int, labels_f, neg_lse, g, ones, dst) -> None:
    """dst = g * (exp(s - lse) - onehot(label)) for a [128, n] chunk of logits s."""
    lo, hi, _ = labels_f
    probs = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=probs, op=nl.exp, data=s, bias=neg_lse[:, col])
    onehot = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.range_select(dst=onehot, on_true_tile=ones[:, 0:n], comp_op0=nl.greater_equal, comp_op1=nl.less,
                      bound0=lo[:, col], bound1=hi[:, col], range_start=float(v0), on_false_value=0.0)
    nisa.tensor_tensor(dst=probs, data1=probs, data2=onehot, op=nl.subtract, engine=nisa.gpsimd_engine)
    nisa.tensor_scalar(dst=dst, data=probs, op0=nl.multiply, operand0=g[:, col], engine=nisa.gpsimd_engine)


def _blocks(t: int, tiles: int) -> list[tuple[int, int]]:
    return [(t0, min(tiles, (t - t0) // P)) for t0 in range(0, t, tiles * P)]


@nki.jit
def linear_ce_fwd(h, w, labels):
    t, d, v = check_shapes(h, w, labels, "linear_ce_fwd")
    loss = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    for t0, nt in _blocks(t, block_tiles(t, d, _itemsize(h.dtype), backward=False)):
        h_t = _load_transposed(h, t0, nt * P, d)
        labels_f = _labels(labels, t0, nt)
        m, total, target = _lse_state(nt)
        for v0 in range(0, v, CHUNK):
            n = min(CHUNK, v - v0)
            w_t = _load_transposed(w, v0, n, d)
            for ti in range(nt):
                s_ps = _logits(h_t, w_t, ti, n, d)
                _online_step(s_ps, slice(ti, ti + 1), n, v0, labels_f, (m, total, target), h.dtype)
        _store_loss(loss, lse, t0, nt, labels_f, (m, total, target))
    return loss, lse


@nki.jit
def linear_ce_bwd(h, w, labels, lse, grad):
    t, d, v = check_shapes(h, w, labels, "linear_ce_bwd")
    dh = nl.ndarray((t, d), dtype=h.dtype, buffer=nl.shared_hbm)
    dw = nl.ndarray((v, d), dtype=nl.float32, buffer=nl.shared_hbm)
    dchunks = [(c0, min(d, c0 + CHUNK)) for c0 in range(0, d, CHUNK)]
    for block, (t0, nt) in enumerate(_blocks(t, block_tiles(t, d, _itemsize(h.dtype), backward=True))):
        h_t = _load_transposed(h, t0, nt * P, d)
        h_n = nl.ndarray((P, nt, d), dtype=h.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=h_n, src=h.ap([[d, P], [P * d, nt], [1, d]], offset=t0 * d))
        labels_f = _labels(labels, t0, nt)
        neg_lse, g, ones = _grad_state(lse, grad, t0, nt, labels_f, CHUNK)
        dh_acc = nl.ndarray((P, nt, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dh_acc, value=0.0, engine=nisa.gpsimd_engine)
        for v0 in range(0, v, CHUNK):
            n = min(CHUNK, v - v0)
            subs = [(j * P, min(n, (j + 1) * P)) for j in range((n + P - 1) // P)]
            w_t = _load_transposed(w, v0, n, d)
            w_n = nl.ndarray((P, len(subs), d), dtype=w.dtype, buffer=nl.sbuf)
            for j, (a, b) in enumerate(subs):
                nisa.dma_copy(dst=w_n[0:b - a, j, :], src=w[v0 + a:v0 + b, :])
            dl = nl.ndarray((P, nt, CHUNK), dtype=h.dtype, buffer=nl.sbuf)
            for ti in range(nt):
                s_ps = _logits(h_t, w_t, ti, n, d)
                _dlogits(s_ps, slice(ti, ti + 1), n, v0, labels_f, neg_lse, g, ones, dl[:, ti, 0:n])
                # dh[tile] += dlogits @ W_chunk: dlogits^T 128 vocabulary rows at a time is the stationary
                dl_t = nl.ndarray((P, len(subs), P), dtype=h.dtype, buffer=nl.sbuf)
                for j, (a, b) in enumerate(subs):
                    tr = nl.ndarray((P, P), dtype=h.dtype, buffer=nl.psum)
                    nisa.nc_transpose(dst=tr[0:b - a, :], data=dl[:, ti, a:b])
                    nisa.tensor_copy(dst=dl_t[0:b - a, j, :], src=tr[0:b - a, :], engine=nisa.scalar_engine)
                for c0, c1 in dchunks:
                    acc = nl.ndarray((P, c1 - c0), dtype=nl.float32, buffer=nl.psum)
                    for j, (a, b) in enumerate(subs):
                        nisa.nc_matmul(dst=acc, stationary=dl_t[0:b - a, j, :], moving=w_n[0:b - a, j, c0:c1])
                    nisa.tensor_tensor(dst=dh_acc[:, ti, c0:c1], data1=dh_acc[:, ti, c0:c1], data2=acc, op=nl.add)
            # dW[chunk] = dlogits^T @ h over the block's tiles (PSUM accumulates over tiles)
            for j, (a, b) in enumerate(subs):
                for c0, c1 in dchunks:
                    acc = nl.ndarray((P, c1 - c0), dtype=nl.float32, buffer=nl.psum)
                    for ti in range(nt):
                        nisa.nc_matmul(dst=acc[0:b - a, :], stationary=dl[:, ti, a:b], moving=h_n[:, ti, c0:c1])
                    out = nl.ndarray((P, c1 - c0), dtype=nl.float32, buffer=nl.sbuf)
                    rows = dw[v0 + a:v0 + b, c0:c1]
                    if block == 0:
                        nisa.activation(dst=out[0:b - a, :], op=nl.copy, data=acc[0:b - a, :])
                    else:  # an earlier block's share is in HBM already
                        nisa.dma_copy(dst=out[0:b - a, :], src=rows)
                        nisa.tensor_tensor(dst=out[0:b - a, :], data1=out[0:b - a, :], data2=acc[0:b - a, :],
                                           op=nl.add)
                    nisa.dma_copy(dst=rows, src=out[0:b - a, :])
        dh_out = nl.ndarray((P, nt, d), dtype=h.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dh_out, src=dh_acc, engine=nisa.gpsimd_engine)
        nisa.dma_copy(dst=dh.ap([[d, P], [P * d, nt], [1, d]], offset=t0 * d), src=dh_out)
    return dh, dw



LOGITS_CHUNK = 2048  # vocabulary entries a chunk of the logits-input kernels


def check_logits(logits, labels, what: str) -> tuple[int, int]:
    """(T, V) of the logits-input kernels' operands, or UnsupportedInput naming the constraint."""
    if len(logits.shape) != 2 or logits.shape[0] % P or tuple(labels.shape) != (logits.shape[0], 1):
        raise UnsupportedInput(f"{what}: need logits [T, V] with T a multiple of {P} and labels [T, 1]; got "
                               f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)}")
    return logits.shape[0], logits.shape[1]


def _logits_chunks(v: int) -> list[tuple[int, int]]:
    return [(v0, min(LOGITS_CHUNK, v - v0)) for v0 in range(0, v, LOGITS_CHUNK)]


@nki.jit
def ce_fwd(logits, labels):
    """Cross-entropy of given logits [T, V]: (loss [T, 1], lse [T, 1]) fp32, one read of the
    logits (chunks of LOGITS_CHUNK through the same online log-sum-exp as linear_ce_fwd)."""
    t, v = check_logits(logits, labels, "ce_fwd")
    loss = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    for t0 in range(0, t, P):
        labels_f = _labels(labels, t0, 1)
        state = _lse_state(1)
        for v0, n in _logits_chunks(v):
            s = nl.ndarray((P, n), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=s, src=logits[t0:t0 + P, v0:v0 + n])
            _online_step(s, slice(0, 1), n, v0, labels_f, state, logits.dtype)
        _store_loss(loss, lse, t0, 1, labels_f, state)
    return loss, lse


@nki.jit
def ce_bwd(logits, labels, lse, grad):
    """Gradient of ce_fwd's loss: grad * (softmax(logits) - onehot(label)) [T, V] in the logits'
    dtype (0 on ignored tokens): one read of the logits, one write."""
    t, v = check_logits(logits, labels, "ce_bwd")
    dlogits = nl.ndarray((t, v), dtype=logits.dtype, buffer=nl.shared_hbm)
    for t0 in range(0, t, P):
        labels_f = _labels(labels, t0, 1)
        neg_lse, g, ones = _grad_state(lse, grad, t0, 1, labels_f, min(v, LOGITS_CHUNK))
        for v0, n in _logits_chunks(v):
            s = nl.ndarray((P, n), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=s, src=logits[t0:t0 + P, v0:v0 + n])
            out = nl.ndarray((P, n), dtype=logits.dtype, buffer=nl.sbuf)
            _dlogits(s, slice(0, 1), n, v0, labels_f, neg_lse, g, ones, out)
            nisa.dma_copy(dst=dlogits[t0:t0 + P, v0:v0 + n], src=out)
    return dlogits


HOST_TOKENS = 2048  # tokens a host chunk: its fp32 logits are HOST_TOKENS x V


def host_fwd(h, w, labels):
    """linear_ce_fwd's results computed with torch on the host, the kernel's numerics: fp32
    logits of the inputs' values, fp32 log-sum-exp; computed HOST_TOKENS tokens at a time."""
    import torch
    check_shapes(h, w, labels, "linear_ce_fwd")
    wf = w.float()
    losses, lses = [], []
    for t0 in range(0, h.shape[0], HOST_TOKENS):
        logits = h[t0:t0 + HOST_TOKENS].float() @ wf.T
        label = labels[t0:t0 + HOST_TOKENS].long()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        picked = logits.gather(1, label.clamp(min=0))
        losses.append(torch.where(label >= 0, lse - picked, 0.0))
        lses.append(lse)
    return torch.cat(losses), torch.cat(lses)


def host_bwd(h, w, labels, lse, grad):
    """linear_ce_bwd's results computed with torch on the host, the kernel's numerics:
    dlogits rounded to the input dtype before both matmuls, fp32 accumulation."""
    import torch
    check_shapes(h, w, labels, "linear_ce_bwd")
    wf = w.float()
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    dhs = []
    for t0 in range(0, h.shape[0], HOST_TOKENS):
        hf = h[t0:t0 + HOST_TOKENS].float()
        label = labels[t0:t0 + HOST_TOKENS].long()
        probs = torch.exp(hf @ wf.T - lse[t0:t0 + HOST_TOKENS])
        probs.scatter_add_(1, label.clamp(min=0), torch.full_like(label, -1.0, dtype=torch.float32))
        scale = torch.where(label >= 0, grad[t0:t0 + HOST_TOKENS], 0.0)
        dlogits = (probs * scale).to(h.dtype).float()
        dhs.append((dlogits @ wf).to(h.dtype))
        dw += dlogits.T @ hf
    return torch.cat(dhs), dw


def flops(t: int, d: int, v: int, backward: bool = False) -> float:
    """Useful matmul FLOPs: the logits (forward); their recomputation, dh and dW (backward)."""
    return 2.0 * t * d * v * (3 if backward else 1)


def hbm_bytes(t: int, d: int, v: int, itemsize: int, backward: bool = False) -> int:
    """Bytes the op must move at least: h and W in (dh and the fp32 dW out in backward)."""
    if backward:
        return t * d * itemsize * 2 + v * d * (itemsize + 4)
    return (t * d + v * d) * itemsize


def host_ce_fwd(logits, labels):
    """ce_fwd's results computed with torch on the host (fp32 log-sum-exp)."""
    import torch
    check_logits(logits, labels, "ce_fwd")
    x = logits.float()
    label = labels.long()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    return torch.where(label >= 0, lse - x.gather(1, label.clamp(min=0)), 0.0), lse


def host_ce_bwd(logits, labels, lse, grad):
    """ce_bwd's result computed with torch on the host (fp32, rounded once to the logits' dtype)."""
    import torch
    check_logits(logits, labels, "ce_bwd")
    label = labels.long()
    probs = torch.exp(logits.float() - lse)
    classes = torch.arange(logits.shape[1], device=logits.device).view(1, -1)
    probs = probs - (classes == label).to(probs.dtype)
    return (probs * torch.where(label >= 0, grad, 0.0)).to(logits.dtype)
