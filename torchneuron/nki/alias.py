"""Opt-in import alias: make `neuronxcc.nki` and `nki` resolve to `torchneuron.nki`.

Nothing named `neuronxcc` or `nki` is shipped as a top-level package. Instead
`install_import_alias()` (or TORCHNEURON_NKI_ALIAS=1 before importing torchneuron.nki)
inserts a meta-path finder that serves these names, and their submodules `language`,
`isa`, `typing`, `collectives`, from this package, so existing kernels run unmodified:

    import torchneuron.nki
    torchneuron.nki.install_import_alias()
    import neuronxcc.nki.language as nl   # -> torchneuron.nki.language
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

_ROOTS = ("neuronxcc.nki", "nki")
_SUBMODULES = {"language", "isa", "typing", "compiler", "collectives", "isa.constants"}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        if self.target == "":
            mod = types.ModuleType(spec.name)  # the `neuronxcc` namespace package
            mod.__path__ = []
            return mod
        return importlib.import_module(self.target)

    def exec_module(self, module):
        if self.target == "":
            module.nki = importlib.import_module("torchneuron.nki")
        elif self.target == "torchneuron.nki.isa":
            # `nki.isa` is a module here, `nki.isa.constants` its submodule (a package in NKI)
            sys.modules[module.__spec__.name + ".constants"] = module.constants


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        mapped = _map(fullname)
        if mapped is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(mapped),
                                               is_package=fullname != "" and not mapped.endswith(
                                                   tuple(_SUBMODULES)))


def _map(name: str) -> str | None:
    if name == "neuronxcc":
        return ""
    for root in _ROOTS:
        if name == root:
            return "torchneuron.nki"
        if name.startswith(root + "."):
            rest = name[len(root) + 1:]
            if rest in _SUBMODULES:
                return "torchneuron.nki." + ("constants" if rest == "isa.constants" else rest)
    return None


_finder = _AliasFinder()


def install_import_alias() -> None:
    """Serve `neuronxcc.nki[.language|.isa|.typing]` and `nki[...]` from torchneuron.nki."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall_import_alias() -> None:
    """Remove the alias and forget modules imported through it."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in list(sys.modules):
        if name == "neuronxcc" or _map(name) is not None:
            del sys.modules[name]
