"""Builds the C++ runtime of the software NeuronCore (torchneuron/runtime/_C).

Build with torch already installed and without build isolation, so pip never pulls a second
torch into a build environment:  pip install --no-build-isolation -e .
"""
import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "torchneuron.runtime._C",
            sorted(glob.glob("torchneuron/runtime/csrc/*.cpp")),
            extra_compile_args=["-O2", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
)
