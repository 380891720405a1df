"""What a kernel substitution is (patterns.py applies them; patterns_rope_ce.py defines some).

- `Substitution`: a pattern (`matches(node) -> bool`) and its rewrite (`rewrite(node) ->
  replacement node`) on the torch-level graph Dynamo captured;
- `example_value(arg)`: a node's example (fake) value, or the argument itself;
- `FLOAT_TYPES`: the float dtypes the NKI kernels take.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx import Node

FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)


def example_value(arg: Any) -> Any:
    return arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, Node) else arg


@dataclass(frozen=True)
class Substitution:
    """A pattern (`matches(node) -> bool`) and its rewrite (`rewrite(node) -> replacement node`)."""

    name: str
    matches: Callable[[Node], bool]
    rewrite: Callable[[Node], Node]
