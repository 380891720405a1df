"""Where each rank sits, and what a collective over a group of ranks costs on that topology.

`Topology` places ranks core-major: rank r is logical core r % C of chip (r // C) % K of node
r // (C*K) (C logical cores a chip, K chips a node), as torchrun and the Neuron runtime number
them. `Topology.collective(kind, nbytes, ranks)` prices one collective of a group
hierarchically, innermost level first, with the cheapest algorithm at each level:

- within a chip: the device model's own ring through HBM (`hardware.collective_cost`), the
  same price a collective gets on the software NeuronCore;
- across chips of a node, over the NeuronLink torus: a bidirectional ring (2 of the chip's 4
  links), a 2-D torus algorithm when the group covers whole rows and columns (rings along both
  dimensions at once: all 4 links), or, for all-reduce/broadcast/reduce, a double binary tree
  (log-depth latency);
- across nodes over EFA: a ring or a tree.

All-reduce is reduce-scatter inside, all-reduce of the shard across the outer levels, then
all-gather inside; all-gather runs outer levels first (on the small shards), reduce-scatter
inner levels first. A level's bandwidth is shared by every core of the chip (node) taking part,
since the other groups of the same mesh dimension communicate at the same time (SPMD). The
bytes convention is `hardware.collective_cost`'s: nbytes is the full buffer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from torchneuron.hardware import Cost, Target, collective_cost

from torchneuron.planner.cluster import Assumptions, Instance

_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "all_gather_into_tensor": "all_gather",
            "_allgather_base": "all_gather", "all_gather_single": "all_gather", "reducescatter": "reduce_scatter",
            "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
            "reduce_scatter_single": "reduce_scatter", "alltoall": "all_to_all", "all_to_all_single": "all_to_all",
            "alltoall_base": "all_to_all"}


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy a group spans: `members` of the group per unit of the level
    above, each with `bytes_per_s` of its own and `step_s` a ring step."""

    name: str            # "chip", "torus", "efa"
    members: int
    bytes_per_s: float
    step_s: float
    torus_dims: tuple[int, int] | None = None   # (rows, cols) when the group covers whole rows and columns


def ring_cost(kind: str, nbytes: float, members: int, bytes_per_s: float, step_s: float) -> Cost:
    """A ring collective at one level, with the hardware model's ring formula (steps and byte
    fractions per kind) at this level's per-member bandwidth and step latency."""
    pseudo = _level_target(bytes_per_s, step_s)
    return collective_cost(kind, int(nbytes), members, pseudo)


@lru_cache(maxsize=256)
def _level_target(bytes_per_s: float, step_s: float) -> Target:
    # A one-core "chip" whose link is the level's per-member bandwidth: collective_cost's ring
    # then prices exactly this level (every ring of > 1 member crosses the link).
    from torchneuron.hardware import TARGETS

    return dataclasses.replace(TARGETS["trn2"], name=f"level/{bytes_per_s:.6g}/{step_s:.3g}", cores_per_chip=1,
                               neuronlink_chip_bytes_per_s=bytes_per_s, link_step_latency_s=step_s)


def tree_cost(kind: str, nbytes: float, members: int, bytes_per_s: float, step_s: float) -> Cost:
    """Double binary tree (all_reduce = reduce up, broadcast down, pipelined): 2*ceil(log2 n)
    steps, and each member sends the buffer twice (once as a child, once as a parent, the two
    trees each carrying half); broadcast and reduce: one pass."""
    depth = math.ceil(math.log2(max(2, members)))
    passes = 2 if kind == "all_reduce" else 1
    latency = passes * depth * step_s
    transfer = passes * nbytes / bytes_per_s
    return Cost(latency + transfer, "link", 0.0, float(passes * nbytes), "memory" if transfer > latency else "latency")


class Topology:
    """`nodes` nodes of `instance`, ranks on logical cores of `target` (an LNC-adjusted Target)."""

    def __init__(self, instance: Instance, target: Target, nodes: int, assumptions: Assumptions | None = None,
                 ranks: int | None = None):
        """`ranks`: use only the first `ranks` logical cores (a part of one node), e.g. to compare
        with a run on this host's software NeuronCores."""
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.instance = instance
        self.target = target
        self.nodes = nodes
        self.assumptions = assumptions or Assumptions()
        self.cores_per_chip = target.cores_per_chip
        self.cores_per_node = self.cores_per_chip * instance.chips
        self.world_size = self.cores_per_node * nodes
        if ranks is not None:
            if not 1 <= ranks <= self.world_size:
                raise ValueError(f"ranks must be between 1 and the {self.world_size} logical cores of {nodes} node(s)")
            self.world_size = ranks
        self._cache: dict[tuple, tuple[Cost, str]] = {}

    def __repr__(self) -> str:
        return (f"Topology({self.nodes} x {self.instance.name}, {self.world_size} ranks, "
                f"{self.cores_per_chip} logical cores a chip)")

    def place(self, rank: int) -> tuple[int, int, int]:
        """(node, chip, core) of a rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this world of {self.world_size} ranks")
        return rank // self.cores_per_node, rank // self.cores_per_chip % self.instance.chips, rank % self.cores_per_chip

    def levels(self, ranks: Sequence[int]) -> list[Level]:
        """The levels a group spans, innermost first (only those with more than one member)."""
        places = [self.place(r) for r in ranks]
        nodes = {p[0] for p in places}
        chips = {(p[0], p[1]) for p in places}
        per_chip = max(1, len(places) // len(chips))
        chips_per_node = max(1, len(chips) // len(nodes))
        a = self.assumptions
        link = self.target.neuronlink_chip_bytes_per_s * a.neuronlink_efficiency
        links = self.instance.torus_links
        levels = []
        if per_chip > 1:
            levels.append(Level("chip", per_chip, 0.0, self.target.link_step_latency_s))
        if chips_per_node > 1:
            rows = {p[1] // self.instance.torus[1] for p in places}
            cols = {p[1] % self.instance.torus[1] for p in places}
            dims = (len(rows), len(cols)) if len(rows) * len(cols) == chips_per_node and min(len(rows), len(cols)) > 1 \
                else None
            # every core of a chip takes part (SPMD): each member gets 1/C of the chip's links
            ring_links = 1 if chips_per_node == 2 else min(2, links)
            levels.append(Level("torus", chips_per_node, link * ring_links / links / self.cores_per_chip,
                                self.target.link_step_latency_s, torus_dims=dims))
        if len(nodes) > 1:
            efa = self.instance.efa_bytes_per_s * a.efa_efficiency / self.cores_per_node
            levels.append(Level("efa", len(nodes), efa, a.efa_step_latency_s))
        return levels

    # ---- pricing ------------------------------------------------------------------------------
    def collective(self, kind: str, nbytes: int, ranks: Sequence[int]) -> tuple[Cost, str]:
        """(Cost, algorithm description) of one collective of the group `ranks`."""
        kind = _ALIASES.get(kind, kind)
        ranks = tuple(sorted(ranks))
        key = (kind, int(nbytes), ranks)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._price(kind, max(0, int(nbytes)), ranks)
        return found

    def _price(self, kind: str, nbytes: int, ranks: tuple[int, ...]) -> tuple[Cost, str]:
        levels = self.levels(ranks)
        if not levels:
            return Cost(0.0, "link", 0.0, 0.0, "latency"), "local"
        if len(levels) == 1 and levels[0].name == "chip":  # exactly the software NeuronCore's price
            return collective_cost(kind, nbytes, len(ranks), self.target), "ring(chip)"
        parts: list[tuple[Cost, str]] = []
        if kind == "all_reduce":
            parts = self._all_reduce(nbytes, levels)
        elif kind == "all_gather":
            shard = nbytes
            for level in levels:  # outer levels first, on the smaller pieces
                shard //= level.members
            for level in reversed(levels):
                shard *= level.members
                parts.append(self._level("all_gather", shard, level))
        elif kind == "reduce_scatter":
            for level in levels:
                parts.append(self._level("reduce_scatter", nbytes, level))
                nbytes //= level.members
        elif kind == "all_to_all":
            parts = self._all_to_all(nbytes, levels, len(ranks))
        elif kind in ("broadcast", "reduce"):
            # pipelined through the levels: the slowest level's time, plus the others' fill
            parts = [self._level(kind, nbytes, level) for level in levels]
            slowest = max(parts, key=lambda p: p[0].duration_s)[0]
            fill = sum(level.step_s * (level.members - 1) for level in levels)
            return (Cost(slowest.duration_s + fill, "link", 0.0, slowest.bytes, slowest.bound),
                    "pipelined " + " + ".join(p[1] for p in parts))
        else:  # send, recv, barrier, gather, scatter: through the outermost level crossed
            outer = levels[-1]
            parts = [(ring_cost(kind, nbytes, len(ranks), outer.bytes_per_s or self._chip_bw(), outer.step_s),
                      f"ring({outer.name})")]
        return _total(parts)

    def _chip_bw(self) -> float:
        return min(self.target.dma_bytes_per_s, self.target.hbm_bytes_per_s / 2)

    def _level(self, kind: str, nbytes: int, level: Level) -> tuple[Cost, str]:
        """The cheapest algorithm for one collective at one level."""
        if level.name == "chip":
            return collective_cost(kind, nbytes, level.members, self.target), "ring(chip)"
        options = [(ring_cost(kind, nbytes, level.members, level.bytes_per_s, level.step_s), f"ring({level.name})")]
        if level.torus_dims and kind in ("all_reduce", "all_gather", "reduce_scatter"):
            options.append((self._torus_2d(kind, nbytes, level), "torus2d"))
        if kind in ("all_reduce", "broadcast", "reduce"):
            options.append((tree_cost(kind, nbytes, level.members, level.bytes_per_s, level.step_s),
                            f"tree({level.name})"))
        return min(options, key=lambda option: option[0].duration_s)

    def _torus_2d(self, kind: str, nbytes: int, level: Level) -> Cost:
        """Rings along both torus dimensions. Two halves of the data run rows-then-columns and
        columns-then-rows at once, so each phase has all four links: twice a ring's bandwidth."""
        rows, cols = level.torus_dims
        bw, step = 2 * level.bytes_per_s, level.step_s
        if kind == "all_reduce":  # reduce-scatter along rows, all-reduce along columns, all-gather
            phases = [ring_cost("reduce_scatter", nbytes, cols, bw, step),
                      ring_cost("all_reduce", nbytes // cols, rows, bw, step),
                      ring_cost("all_gather", nbytes, cols, bw, step)]
        elif kind == "all_gather":
            phases = [ring_cost(kind, nbytes // cols, rows, bw, step), ring_cost(kind, nbytes, cols, bw, step)]
        else:
            phases = [ring_cost(kind, nbytes, cols, bw, step), ring_cost(kind, nbytes // cols, rows, bw, step)]
        return Cost(sum(p.duration_s for p in phases), "link", 0.0, sum(p.bytes for p in phases), "memory")

    def _all_reduce(self, nbytes: int, levels: list[Level]) -> list[tuple[Cost, str]]:
        if len(levels) == 1:
            return [self._level("all_reduce", nbytes, levels[0])]
        inner, rest = levels[0], levels[1:]
        return ([self._level("reduce_scatter", nbytes, inner)] + self._all_reduce(nbytes // inner.members, rest)
                + [self._level("all_gather", nbytes, inner)])

    def _all_to_all(self, nbytes: int, levels: list[Level], group: int) -> list[tuple[Cost, str]]:
        """Each member sends nbytes/group to every other; the bytes bound for members outside a
        level's unit but inside the next one's cross that level."""
        parts = []
        inside = 1
        for level in levels:
            outside = inside * level.members
            crossing = nbytes * (outside - inside) / group
            bw = level.bytes_per_s or self._chip_bw()
            seconds = crossing / bw + (level.members - 1) * level.step_s
            parts.append((Cost(seconds, "link", 0.0, crossing, "memory"), f"pairwise({level.name})"))
            inside = outside
        return parts


def _total(parts: list[tuple[Cost, str]]) -> tuple[Cost, str]:
    duration = sum(p[0].duration_s for p in parts)
    sent = sum(p[0].bytes for p in parts)
    bound = "memory" if any(p[0].bound == "memory" for p in parts) else "latency"
    return Cost(duration, "link", 0.0, sent, bound), " + ".join(p[1] for p in parts)
