"""Builds the C++ runtime of the software NeuronCore (torchneuron/runtime/_C): one library from
the csrc/ folders beside the Python that owns them (runtime: device primitives; ops: op execution;
eager: the adaptive queue; serving/llm: vLLM's fused layers).

Build with torch already installed and without build isolation, so pip never pulls a second
torch into a build environment:  pip install --no-build-isolation -e .
"""
import glob
import os

# Importing torch autoloads installed device backends, this package included: a stale _C.so in the
# tree would then fail the very build that replaces it. The build needs none of them.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

CSRC_DIRS = ["torchneuron/runtime/csrc", "torchneuron/ops/csrc", "torchneuron/eager/csrc",
             "torchneuron/serving/llm/csrc"]

setup(
    ext_modules=[
        CppExtension(
            "torchneuron.runtime._C",
            sorted(path for folder in CSRC_DIRS for path in glob.glob(os.path.join(folder, "*.cpp"))),
            include_dirs=[os.path.abspath(folder) for folder in CSRC_DIRS],
            extra_compile_args=["-O2", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
)
