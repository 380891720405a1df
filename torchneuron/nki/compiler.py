"""`nki.compiler`: direct-allocation and scheduling directives.

Owns the small surface kernels use to place tensors themselves (`sbuf.mod_alloc`,
`psum.mod_alloc`) and to steer the compiler (`skip_middle_end_transformations`,
`no_reorder`, ...). The simulator honours allocations for capacity accounting (a modulo
allocation is charged for its physical tiles only); directives are accepted and have no
effect on results.
"""
from __future__ import annotations

from typing import Any, Callable

from .language import ModAlloc


class _Memory:
    def __init__(self, kind: str):
        self.kind = kind

    def mod_alloc(self, *args: Any, base_addr: int = 0, base_bank: int = 0, num_free_tiles: tuple = (),
                  num_bank_tiles: tuple = (), **kwargs: Any) -> ModAlloc:
        return ModAlloc(self.kind, tuple(num_free_tiles or num_bank_tiles) or (1,),
                        base_bank * 2048 if self.kind == "psum" else base_addr)

    def auto_alloc(self, *args: Any, **kwargs: Any) -> ModAlloc:
        return ModAlloc(self.kind)

    alloc = mod_alloc


sbuf = _Memory("sbuf")
psum = _Memory("psum")


def skip_middle_end_transformations(fn: Callable) -> Callable:
    return fn


def enable_stack_allocator(fn: Callable | None = None, **kwargs: Any):
    return fn if fn is not None else (lambda f: f)


force_auto_alloc = enable_stack_allocator


def no_reorder(*args: Any, **kwargs: Any) -> None:
    return None
