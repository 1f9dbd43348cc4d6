"""Receptive-field arithmetic for spatial tiling, one axis at a time (pure Python): map sizes, who
owns which rows, and what each tile must compute.

Design: docs/design/tiling.md
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

Interval = tuple[int, int]


def hull(*intervals: Interval) -> Interval:
    """Smallest interval containing all the given ones."""
    return min(i[0] for i in intervals), max(i[1] for i in intervals)


def clip(interval: Interval, n: int) -> Interval:
    return max(interval[0], 0), min(interval[1], n)


def intersect(a: Interval, b: Interval) -> Interval | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def even_bounds(n: int, parts: int) -> list[int]:
    """Split points of ``n`` into ``parts`` nearly equal pieces (first pieces no larger)."""
    return [i * n // parts for i in range(parts + 1)]


@dataclass(frozen=True)
class Window:
    """How one layer maps an input axis to an output axis.

    ``pad_lo``/``pad_hi`` are the layer's own padding before and after the
    map; output ``o`` reads inputs ``o*stride - pad_lo + j*dilation`` for
    ``j < kernel``. Elementwise layers are ``Window()``.
    """

    kernel: int = 1
    stride: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    dilation: int = 1
    ceil_mode: bool = False

    @property
    def extent(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    @property
    def elementwise(self) -> bool:
        return self == Window()

    def out_size(self, n: int) -> int:
        span = n + self.pad_lo + self.pad_hi - self.extent
        if span < 0:
            return 0
        if not self.ceil_mode:
            return span // self.stride + 1
        out = -(-span // self.stride) + 1
        if (out - 1) * self.stride >= n + self.pad_lo:  # PyTorch: the last window must start inside
            out -= 1
        return out

    def needed(self, out: Interval) -> Interval:
        """Input interval read by outputs ``out``, in map coordinates, before clipping to the map."""
        return out[0] * self.stride - self.pad_lo, (out[1] - 1) * self.stride - self.pad_lo + self.extent

    def split_point(self, b: int, n_in: int) -> int:
        """Where an output split at ``b`` lands on the input: where output ``b``'s window starts,
        moved to the middle of the part it shares with output ``b - 1``'s window, if any."""
        shared = max(0, self.extent - self.stride)
        return min(max(b * self.stride - self.pad_lo + (shared + 1) // 2, 0), n_in)


@dataclass(frozen=True)
class Branches:
    """A residual block along one axis: ``main`` and ``shortcut`` (empty = identity) then a sum."""

    main: tuple["Node", ...]
    shortcut: tuple["Node", ...] = ()


Node = Union[Window, Branches]


def path_sizes(path: tuple[Node, ...], n: int) -> list[int]:
    """Map size before each layer of ``path`` and after the last one (``len(path) + 1`` sizes)."""
    sizes = [n]
    for node in path:
        if isinstance(node, Window):
            n = node.out_size(n)
        else:
            main, short = path_sizes(node.main, n)[-1], path_sizes(node.shortcut, n)[-1]
            if main != short:
                raise ValueError(f"residual paths disagree on the output size ({main} vs {short})")
            n = main
        sizes.append(n)
    return sizes


def _split_point(node: Node, b: int, n_in: int, n_out: int) -> int:
    if b <= 0:
        return 0
    if b >= n_out:
        return n_in
    if isinstance(node, Window):
        return node.split_point(b, n_in)
    sizes = path_sizes(node.main, n_in)
    for i in reversed(range(len(node.main))):
        b = _split_point(node.main[i], b, sizes[i], sizes[i + 1])
    return b


def path_bounds(path: tuple[Node, ...], sizes: list[int], out_bounds: list[int]) -> list[list[int]]:
    """Partition of every map of ``path`` given the partition of its output (split points, 0 to n)."""
    bounds = [out_bounds]
    for i in reversed(range(len(path))):
        bounds.append([_split_point(path[i], b, sizes[i], sizes[i + 1]) for b in bounds[-1]])
    return bounds[::-1]


@dataclass(frozen=True)
class Step:
    """One layer as one tile sees it along one axis.

    The tile holds ``src`` of the layer's input and computes ``dst`` of its
    output. ``need`` is the input window ``dst`` reads; the part of it outside
    ``[0, n_in)`` is padding. ``owned`` is the part of ``dst`` this tile owns.
    For a residual block, ``main`` and ``shortcut`` hold the steps of its paths.
    """

    n_in: int
    src: Interval
    dst: Interval
    need: Interval
    owned: Interval
    main: tuple["Step", ...] = ()
    shortcut: tuple["Step", ...] = ()

    @property
    def pad(self) -> tuple[int, int]:
        """Padding before and after the input that this tile must add itself."""
        return max(0, -self.need[0]), max(0, self.need[1] - self.n_in)

    @property
    def crop(self) -> Interval:
        """Part of ``src`` (in ``src``-relative coordinates) the layer reads."""
        lo, hi = clip(self.need, self.n_in)
        return lo - self.src[0], hi - self.src[0]


def plan_steps(path: tuple[Node, ...], sizes: list[int], bounds: list[list[int]], tile: int,
               out: Interval) -> tuple[Step, ...]:
    """The steps of ``tile`` through ``path`` (a fused group) computing ``out`` of the last map."""
    steps: list[Step] = []
    dst = out
    for i in reversed(range(len(path))):
        node, n_in = path[i], sizes[i]
        owned_in = (bounds[i][tile], bounds[i][tile + 1])
        owned_out = (bounds[i + 1][tile], bounds[i + 1][tile + 1])
        if isinstance(node, Window):
            need = node.needed(dst)
            step = Step(n_in, hull(clip(need, n_in), owned_in), dst, need, owned_out)
        else:
            main = _inner_steps(node.main, n_in, bounds[i + 1], tile, dst)
            short = _inner_steps(node.shortcut, n_in, bounds[i + 1], tile, dst)
            src = hull(main[0].src if main else dst, short[0].src if short else dst, owned_in)
            step = Step(n_in, src, dst, src, owned_out, main, short)
        steps.append(step)
        dst = step.src
    return tuple(reversed(steps))


def _inner_steps(path: tuple[Node, ...], n_in: int, out_bounds: list[int], tile: int,
                 out: Interval) -> tuple[Step, ...]:
    if not path:
        return ()
    sizes = path_sizes(path, n_in)
    return plan_steps(path, sizes, path_bounds(path, sizes, out_bounds), tile, out)

