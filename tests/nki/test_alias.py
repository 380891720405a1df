"""The opt-in import alias: kernels written against `neuronxcc.nki` or `nki` (NKI 0.3)
run unmodified."""
import subprocess
import sys
import textwrap

import torch

import torchneuron.nki as tnki

LEGACY = textwrap.dedent('''
    import numpy as np
    import neuronxcc.nki as nki
    import neuronxcc.nki.language as nl
    import neuronxcc.nki.isa as nisa
    from neuronxcc.nki.typing import tensor

    @nki.jit
    def scale_rows(a, s):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.load(a)
        nl.store(out, value=nisa.tensor_scalar(t, np.multiply, nl.load(s)))
        return out
''')

NEW = textwrap.dedent('''
    import nki
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def matmul_add(at, b, c):
        out = nl.ndarray((at.shape[1], b.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
        a_s = nl.ndarray(at.shape, dtype=at.dtype, buffer=nl.sbuf)
        b_s = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
        c_s = nl.ndarray(c.shape, dtype=c.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_s, src=at)
        nisa.dma_copy(dst=b_s, src=b)
        nisa.dma_copy(dst=c_s, src=c)
        p = nl.ndarray((at.shape[1], b.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=a_s, moving=b_s)
        r = nl.ndarray(p.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=r, data1=p, data2=c_s, op=nl.add)
        nisa.dma_copy(dst=out, src=r)
        return out
''')


def _module(src, name):
    ns = {"__name__": name}
    exec(compile(src, f"<{name}>", "exec"), ns)
    return ns


def test_alias_serves_both_generations():
    tnki.install_import_alias()
    try:
        import neuronxcc.nki.language as nl
        assert nl is tnki.language
        legacy = _module(LEGACY, "legacy_kernel")
        a, s = torch.randn(64, 32), torch.randn(64, 1)
        assert torch.allclose(legacy["scale_rows"](a, s), a * s)
        new = _module(NEW, "new_kernel")
        at, b, c = torch.randn(128, 64), torch.randn(128, 256), torch.randn(64, 256)
        assert torch.allclose(new["matmul_add"](at, b, c), at.T @ b + c, atol=1e-4)
    finally:
        tnki.uninstall_import_alias()
    assert "neuronxcc" not in sys.modules


def test_alias_is_opt_in_and_env_enables_it():
    code = "import torch, importlib.util as u; import torchneuron.nki; print(u.find_spec('neuronxcc') is not None)"
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "", "TORCHNEURON_NKI_ALIAS": "0"})
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={"PATH": "", "TORCHNEURON_NKI_ALIAS": "1"})
    assert off.stdout.strip() == "False", off.stderr
    assert on.stdout.strip() == "True", on.stderr
