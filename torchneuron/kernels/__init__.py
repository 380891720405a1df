"""torchneuron.kernels: NKI-lib, kernels written in NKI and registered as torch ops.

Modules: `elementwise` (tensor add, single program and SPMD), `matmul` (four optimisation
levels), `norms` (softmax, rmsnorm and its backward, layernorm, transpose), `attention`
(flash-attention forward), and `torch_ops` (the torch ops `torch.ops.nki_kernels.*`, imported
on first use of `torchneuron.kernels.torch_ops`).
"""
