"""Train a tiny Llama with FSDP2 + tensor parallelism on 4 neuron ranks.

    python -m torchneuron.examples.train_distributed            # launches torchrun for you
    torchrun --standalone --nproc-per-node 4 -m torchneuron.examples.train_distributed

The ranks form a 2 x 2 DeviceMesh: "tp" splits attention heads and MLP columns (Megatron style, with
sequence-parallel norms), "dp" shards the parameters with FSDP2 (bf16 compute, fp32 gradient
reduction). Rank 0 prints each step's loss, the host throughput (tokens per second of wall time on
this machine) and the modeled step time on the target Trainium (trn2 by default) from the device
timeline, where collectives overlap with compute as they would on the device.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)


@dataclass
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 128
    seq_len: int = 32


def rotary(seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attention, self.feed_forward = Attention(cfg), FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary(cfg.seq_len, cfg.dim // cfg.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.output(self.norm(x))


def apply_tensor_parallel(model: TinyLlama, mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism: activations between blocks are sharded on the
    sequence dim, norms run on that shard, attention and MLP see the full sequence."""
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def apply_fsdp(model: TinyLlama, mesh: DeviceMesh, param_dtype: torch.dtype = torch.bfloat16,
               reshard_after_forward: bool = True) -> None:
    """FSDP2 per block and at the root: `param_dtype` parameters for compute, fp32 gradient reduction."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def build(cfg: LlamaConfig, dp: int, tp: int,
          param_dtype: torch.dtype = torch.bfloat16) -> tuple[TinyLlama, DeviceMesh]:
    """The model on this rank's device, split over a (dp, tp) mesh (same initial weights on all ranks)."""
    mesh = init_device_mesh("neuron", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TinyLlama(cfg).to("neuron")
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if dp > 1:
        apply_fsdp(model, mesh["dp"], param_dtype)
    return model, mesh


def batch(cfg: LlamaConfig, step: int, dp_rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic next-token data the model can learn (arithmetic sequences: the stride is in the
    context), the same on every TP rank of one DP rank."""
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    start = torch.randint(0, cfg.vocab, (size, 1), generator=generator)
    stride = torch.randint(1, 4, (size, 1), generator=generator)
    tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab
    return tokens[:, :-1].to("neuron"), tokens[:, 1:].to("neuron")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def modeled_now() -> float:
    """Modeled device time of this rank's device once all its streams are done (seconds)."""
    from torchneuron.hardware.timeline import get_timeline

    torch.neuron.synchronize()
    from torchneuron.hardware import worklog

    worklog.drain()
    return get_timeline(torch.neuron.current_device()).synchronize()


def train(steps: int, dp: int, tp: int, batch_size: int, target: str) -> None:
    import torchneuron

    torchneuron.set_target(target)
    # the TP output layer hands FSDP's root a view of the gathered logits; nothing here writes to it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group()  # the backend is "neuron", the default for the neuron accelerator
    cfg = LlamaConfig()
    model, mesh = build(cfg, dp, tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = mesh["dp"].get_local_rank()
    tokens_per_step = dp * batch_size * cfg.seq_len
    for step in range(steps):
        inputs, targets = batch(cfg, step, dp_rank, batch_size)
        start_host, start_device = time.perf_counter(), modeled_now()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        device_s = modeled_now() - start_device
        host_s = time.perf_counter() - start_host
        reported = loss.detach().clone()
        dist.all_reduce(reported, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        if dist.get_rank() == 0:
            print(f"step {step}  loss {reported.item():.4f}  host {tokens_per_step / host_s:,.0f} tokens/s  "
                  f"modeled {target} step {device_s * 1e3:.3f} ms", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per DP rank")
    parser.add_argument("--target", default="trn2")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:  # not under torchrun: become it
        from torch.distributed.run import main as torchrun

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torchrun(["--standalone", f"--nproc-per-node={args.dp * args.tp}", "-m",
                  "torchneuron.examples.train_distributed", *(argv if argv is not None else sys.argv[1:])])
        return
    train(args.steps, args.dp, args.tp, args.batch_size, args.target)


if __name__ == "__main__":
    main()
