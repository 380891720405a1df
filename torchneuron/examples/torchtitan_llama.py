"""TorchTitan's Llama-3 debug model trained on neuron under torchrun: FSDP2, TP, PP, compile, DCP.

    python -m torchneuron.examples.torchtitan_llama --nproc 2                 # FSDP2 on 2 ranks
    python -m torchneuron.examples.torchtitan_llama --nproc 2 -- --parallelism.tensor_parallel_degree 2
    python -m torchneuron.examples.torchtitan_llama --nproc 2 --pp 2          # pipeline: 2 ranks, 4 stages
    python -m torchneuron.examples.torchtitan_llama --nproc 2 --compile      # blocks + loss, backend "neuron"
    python -m torchneuron.examples.torchtitan_llama --nproc 2 --device cpu   # the CPU + gloo reference

Runs torchtitan's own trainer (`torchtitan.train.main`) unmodified on each rank, with the config
of torchtitan_config.py; arguments after `--` go to torchtitan. torchtitan finds the device
through `torch._utils._get_available_device_type()`, which is neuron once torchneuron is
imported (the PrivateUse1 module `torch.neuron` says it is available), and the c10d backend
through `Backend.default_device_backend_map["neuron"]`. No download: `write_assets` builds a
byte-level BPE tokenizer (the `tokenizers` library, trained in process) and a c4_test-like JSON
dataset in the job folder. Initial weights come from a seed checkpoint made on one rank
(torchtitan's `--checkpoint.create_seed_checkpoint`), so runs of any parallelism and either
device start from the same weights and their losses can be compared.

torchtitan has no CPU device (it falls back to "cuda" when no accelerator is found), so the
reference run (`--device cpu`) points torchtitan's device module at `CpuDevice` before torchtitan
is imported. torchtitan's code is not changed; two things around it are: the PyTorch APIs after
2.13 it calls are backported onto 2.13's (torchtitan_compat.py: pipeline parallelism needs one),
and its check that FlexAttention blocks compile only with inductor lets the backend "neuron"
through (`_neuron_compiles_flex_blocks`).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

# The ranks run this file as a script, so torchtitan_config.py beside it imports as a top-level
# module: a CPU reference rank then never imports torchneuron (see `_torchrun`).
CONFIG = ["--module", "torchtitan_config", "--config", "llama3_debugmodel_neuron"]
SEED_CHECKPOINT = "seed"
VOCAB_SIZE = 2048  # the debug model's embedding rows; the tokenizer stays below
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
_WORDS = ("the a an of to in on for with by from model device tensor shard rank step loss layer "
          "weight gradient core memory host stream kernel graph compile train learn token sequence batch "
          "pipeline stage parallel fast slow large small first last next every each some many few red "
          "green blue river mountain city garden morning evening quiet bright simple careful").split()


# ---- assets: a tokenizer and a dataset, made locally ----

def _corpus(documents: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(documents):
        sentences = (" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16))).capitalize() + "."
                     for _ in range(rng.randint(4, 12)))
        texts.append(" ".join(sentences))
    return texts


def write_assets(folder: str | os.PathLike, documents: int = 400) -> tuple[Path, Path]:
    """Writes a c4_test-like dataset (`data.json`, one {"text": ...} per line) and a byte-level
    BPE tokenizer trained on it (`tokenizer.json`, `tokenizer_config.json` naming BOS/EOS) under
    `folder`; returns (tokenizer folder, dataset folder). Idempotent."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    tokenizer_dir, dataset_dir = folder / "tokenizer", folder / "c4_test"
    if (tokenizer_dir / "tokenizer.json").exists() and (dataset_dir / "data.json").exists():
        return tokenizer_dir, dataset_dir
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    dataset_dir.mkdir(parents=True, exist_ok=True)
    texts = _corpus(documents)
    with open(dataset_dir / "data.json", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    with open(tokenizer_dir / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}, f)
    return tokenizer_dir, dataset_dir


# ---- one rank ----

class CpuDevice:
    """The device module torchtitan asks for (`torch.cuda`'s shape) for CPU tensors: the CPU's
    own functions, a name and the host's memory as capacity; the host keeps no allocator
    statistics, so torchtitan's memory report reads -1."""

    device_count = staticmethod(torch.cpu.device_count)
    set_device = staticmethod(torch.cpu.set_device)
    synchronize = staticmethod(torch.cpu.synchronize)
    is_available = staticmethod(torch.cpu.is_available)

    class _Properties:
        name = "cpu"
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @staticmethod
    def current_device() -> int:  # an index, as barrier(device_ids=...) takes (torch.cpu's is "cpu")
        return 0

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @classmethod
    def get_device_properties(cls, device: object = None) -> "_Properties":
        return cls._Properties()

    @staticmethod
    def memory_stats(device: object = None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def _cpu_flex_attention_backward() -> None:
    """Lets the CPU reference train FlexAttention: PyTorch 2.13 refuses its backward for CPU inputs
    (Inductor's CPU template has none; the check is in `flex_attention` itself, so no backend
    passes it), although the higher-order op's eager implementation, the one the neuron device
    runs, has one. The reference lifts that check for CPU inputs and compiles FlexAttention with
    the `aot_eager` backend (the eager implementation under AOTAutograd), as neuron runs it."""
    import torch.nn.attention.flex_attention as flex

    refuse = flex._validate_device

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != "cpu":
            refuse(query, key, value)

    flex._validate_device = validate_device
    torch.compiler.set_default_backend("aot_eager")


def _gloo_fsdp_sum_reduction() -> None:
    """Lets the CPU reference run torchtitan's FSDP2 on gloo: torchtitan sets FSDP's gradient divide
    factor to 1 (it scales by the global token count itself), which FSDP2 reduce-scatters with
    `ReduceOp.PREMUL_SUM(1.0)`, and gloo has no PREMUL_SUM. The reference reduces with SUM instead
    (FSDP's `set_force_sum_reduction_for_comms`), the same values for a factor of 1."""
    from torch.distributed.fsdp import FSDPModule

    set_factor = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        set_factor(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _neuron_compiles_flex_blocks() -> None:
    """Lets torchtitan's `--compile.backend neuron` compile the transformer blocks: for a model with
    FlexAttention, torchtitan's `apply_compile` (torchtitan/distributed/compile.py) accepts only
    "inductor", or "aot_eager" with the flex region scooped out to inductor, because another backend
    would run FlexAttention as decomposed ATen ops with no fused kernel. The neuron compiler lowers
    the flex_attention ops itself (torchneuron/compiler/flex_attention.py: the reference numerics,
    priced as one NKI flash-attention kernel), so "neuron" passes through unchanged and each block
    is compiled as torchtitan does it, `block.compile(backend="neuron", fullgraph=True)`."""
    import torchtitan.distributed.compile as titan_compile

    choose_backend = titan_compile._maybe_regional_inductor_backend

    def maybe_regional_inductor_backend(model: torch.nn.Module, backend: str) -> object:
        return backend if backend == "neuron" else choose_backend(model, backend)

    titan_compile._maybe_regional_inductor_backend = maybe_regional_inductor_backend


def _select_device(device: str) -> None:
    """Makes torchtitan's device `device` (call before any other torchtitan import)."""
    import torchtitan.tools.utils as titan_utils

    if device == "cpu":
        titan_utils.device_type, titan_utils.device_module = "cpu", CpuDevice
        _cpu_flex_attention_backward()
        _gloo_fsdp_sum_reduction()
        return
    import torchneuron  # noqa: F401  (the device and its c10d backend; `import torch` loads it too)

    # torchtitan compiles FlexAttention with torch.compile's default backend when its attention
    # module is imported (also in eager runs): on neuron tensors that is the neuron compiler.
    torch.compiler.set_default_backend("neuron")
    _neuron_compiles_flex_blocks()

    if titan_utils.device_type != device:
        raise RuntimeError(f"torchtitan chose device {titan_utils.device_type!r}, not {device!r}: torchtitan was "
                           f"imported before torchneuron registered the device, or torch.{device} is unavailable")


def rank_main(device: str, titan_args: Sequence[str]) -> None:
    """One torchrun rank: chooses the device, then runs torchtitan's training entry point."""
    import torchtitan_compat  # beside this script, as torchtitan_config (see CONFIG)

    torchtitan_compat.install()
    _select_device(device)
    from torchtitan import train

    sys.argv = ["torchtitan.train", *CONFIG, *titan_args]
    train.main()


# ---- the launcher ----

def _assets_args(folder: Path, dump: Path) -> list[str]:
    tokenizer_dir, dataset_dir = write_assets(folder)
    return ["--hf_assets_path", str(tokenizer_dir), "--dataloader.dataset_path", str(dataset_dir),
            "--dump_folder", str(dump)]


def launch(nproc: int, titan_args: Sequence[str], *, device: str = "neuron", dump: str | os.PathLike,
           assets: str | os.PathLike | None = None, compile: bool = False, timeout: float = 600,
           env: dict[str, str] | None = None) -> list[dict]:
    """Runs torchtitan on `nproc` local ranks under torchrun and returns the losses the metrics
    rank logged ([{"step", "loss", "max_loss", "grad_norm"}, ...]). The weights start from the
    seed checkpoint in `assets` (made on first use). Raises with the ranks' output on failure."""
    dump = Path(dump)
    assets = Path(assets) if assets is not None else dump.parent / "assets"
    args = _assets_args(assets, dump) + ["--checkpoint.enable", "--checkpoint.initial_load_path",
                                         str(seed_checkpoint(assets))]
    if compile:
        if device != "neuron":
            raise ValueError(f"compile=True compiles with the backend 'neuron', on neuron ranks only, not {device!r}: "
                             "the CPU reference runs eager (PyTorch 2.13's inductor has no CPU FlexAttention backward)")
        args += ["--compile.enable", "--compile.backend", "neuron"]  # components: the blocks and the loss
    for stale in dump.glob("losses_rank*.jsonl"):  # a resumed job appends to a fresh record
        stale.unlink()
    _torchrun(nproc, device, args + list(titan_args), timeout, env, log=dump / "torchrun.log")
    return read_losses(dump)


def pipeline_args(nproc: int, pp: int) -> list[str]:
    """torchtitan's arguments for `pp` pipeline stages a model replica, FSDP2 over the other ranks
    (torchtitan splits the layers into stages itself: embeddings on the first, norm and output on the
    last; the debug model's Interleaved1F1B schedule puts 2 stages on each rank, 4 for `pp=2`)."""
    if pp < 1 or nproc % pp:
        raise ValueError(f"--pp {pp} must divide the rank count {nproc} (each rank holds stages of one pipeline)")
    return ["--parallelism.pipeline_parallel_degree", str(pp), "--parallelism.data_parallel_shard_degree",
            str(nproc // pp)]


def seed_checkpoint(assets: Path, timeout: float = 600) -> Path:
    """torchtitan's seed checkpoint of the debug model (full weights, made on one CPU rank) in
    `assets`; made on first use."""
    dump = assets / SEED_CHECKPOINT
    step0 = dump / "checkpoint" / "step-0"
    if not step0.exists():
        shutil.rmtree(dump, ignore_errors=True)
        _torchrun(1, "cpu", _assets_args(assets, dump) + ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                                                          "--parallelism.data_parallel_shard_degree", "1"],
                  timeout, None)
    return step0


def read_losses(dump: str | os.PathLike) -> list[dict]:
    """The losses of the rank that logged real ones (under PP only the last stage has them)."""
    for path in sorted(Path(dump).glob("losses_rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if records and all(r["loss"] >= 0 for r in records):
            return records
    raise RuntimeError(f"no rank wrote losses under {dump}")


def _neuron_devices(environ: dict[str, str]) -> int:
    # imported here: a rank runs this file as a script, and a CPU rank must not import torchneuron
    from torchneuron.settings import Settings

    return Settings.from_environ(environ).device_count


def _torchrun(nproc: int, device: str, titan_args: Sequence[str], timeout: float, env: dict[str, str] | None,
              log: Path | None = None) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.abspath(__file__), "--rank", "--device", device, "--", *titan_args]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               **(env or {})}
    # the ranks import the torchneuron this launcher is part of (not another one installed)
    package_root = str(Path(__file__).resolve().parents[2])
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, environ.get("PYTHONPATH", "")) if p)
    if device == "cpu":  # the reference is stock PyTorch: `import torch` must not load torchneuron either
        environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    elif _neuron_devices(environ) < nproc:
        # torchtitan puts local rank r on device r: a process needs as many neuron devices as ranks
        environ.update(TORCHNEURON_DEVICE_COUNT=str(nproc))  # a child setting, read there by settings.py
    result = subprocess.run(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=timeout)
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        Path(log).write_text(result.stdout)
    if result.returncode != 0:
        raise RuntimeError(f"torchtitan on {nproc} {device} rank(s) exited with {result.returncode}:\n"
                           f"{' '.join(command)}\n{result.stdout[-6000:]}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    titan_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="neuron", choices=["neuron", "cpu"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (the other ranks: FSDP2)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer block and the loss with backend 'neuron'")
    parser.add_argument("--folder", default="./outputs/torchtitan_llama", help="assets and job output")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # torchrun's ranks
    args = parser.parse_args(own)
    if args.rank:
        rank_main(args.device, titan_args)
        return
    folder = Path(args.folder)
    if args.pp > 1:
        titan_args = pipeline_args(args.nproc, args.pp) + titan_args
    losses = launch(args.nproc, titan_args, device=args.device, dump=folder / f"{args.device}_{args.nproc}",
                    assets=folder / "assets", compile=args.compile)
    for record in losses:
        print(f"step {record['step']}: loss {record['loss']:.6f}  grad norm {record['grad_norm']:.6f}")


if __name__ == "__main__":
    main()
