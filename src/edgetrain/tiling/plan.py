"""The geometry of one tiled section on one grid, and what it costs.

``SectionPlan`` holds, for the layers of the tiled section, the size and the
ownership partition of every feature map (per axis, from ``regions``), and
answers per device and per group of layers: which steps the device runs, how
many FLOPs that is (overlap recomputation included), and which pieces of a
group's input it receives from which neighbour. Everything here is counted
from region sizes, nothing is measured; ``grouping`` and the report use it.

Devices are numbered row-major: device ``d`` holds tile ``(d // cols, d % cols)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgetrain.errors import EdgetrainError
from edgetrain.tiling.layers import Block, Layer, Unit
from edgetrain.tiling.regions import Interval, Step, even_bounds, intersect, path_bounds, path_sizes, plan_steps

Rect = tuple[Interval, Interval]


def area(rect: Rect) -> int:
    return (rect[0][1] - rect[0][0]) * (rect[1][1] - rect[1][0])


def intersect_rect(a: Rect, b: Rect) -> Rect | None:
    rows, cols = intersect(a[0], b[0]), intersect(a[1], b[1])
    return (rows, cols) if rows and cols else None


@dataclass
class SectionPlan:
    units: list[Unit]
    input_hw: tuple[int, int]
    grid: tuple[int, int]
    in_channels: int
    sizes: tuple[list[int], list[int]] = field(init=False)
    bounds: tuple[list[list[int]], list[list[int]]] = field(init=False)
    channels: list[int] = field(init=False)
    _steps: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        rows, cols = self.grid
        sizes, bounds = [], []
        for axis, tiles in ((0, rows), (1, cols)):
            path = tuple(u.node(axis) for u in self.units)
            try:
                s = path_sizes(path, self.input_hw[axis])
            except ValueError as e:
                raise EdgetrainError(f"the tiled section cannot be split: {e}") from None
            sizes.append(s)
            bounds.append(path_bounds(path, s, even_bounds(s[-1], tiles)))
        self.sizes, self.bounds = (sizes[0], sizes[1]), (bounds[0], bounds[1])
        self.channels = [self.in_channels] + [u.out_channels for u in self.units]
        for p in range(len(self.units) + 1):
            if min(self.sizes[0][p], self.sizes[1][p]) < 1:
                raise EdgetrainError(f"the feature map after {self._where(p)} is empty; use a larger input")
        for d in range(self.devices):
            for axis in (0, 1):
                self._check_owned(self.steps(0, len(self.units), d, axis), self.units, axis)

    @property
    def devices(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def end(self) -> int:
        return len(self.units)

    def _where(self, p: int) -> str:
        if p == 0:
            return "the input"
        u = self.units[p - 1]
        return f"layer {u.name!r} ({type(u.module).__name__})"

    def _check_owned(self, steps: tuple[Step, ...], units: list, axis: int) -> None:
        # Backwards: an empty share spreads to the maps before it, so the last one is the culprit.
        for s, u in reversed(list(zip(steps, units))):
            if s.owned[1] > s.owned[0] and isinstance(u, Block):
                self._check_owned(s.main, u.main, axis)
                self._check_owned(s.shortcut, u.shortcut, axis)
            if s.owned[1] <= s.owned[0]:
                rows, cols = self.grid
                raise EdgetrainError(
                    f"grid {rows}x{cols} is larger than the feature map after layer {u.name!r} "
                    f"({type(u.module).__name__}), whose {'rows' if axis == 0 else 'columns'} cannot give every "
                    f"tile a share; use a smaller grid or end the tiled section before {u.name!r}")

    def tile(self, device: int) -> tuple[int, int]:
        return divmod(device, self.grid[1])

    def steps(self, a: int, b: int, device: int, axis: int) -> tuple[Step, ...]:
        """Steps of ``device`` along ``axis`` through the group of layers ``a..b-1``."""
        t = self.tile(device)[axis]
        key = (a, b, t, axis)
        if key not in self._steps:
            path = tuple(u.node(axis) for u in self.units[a:b])
            bounds = self.bounds[axis]
            out = (bounds[b][t], bounds[b][t + 1])
            self._steps[key] = plan_steps(path, self.sizes[axis][a:b + 1], bounds[a:b + 1], t, out)
        return self._steps[key]

    def owned(self, position: int, device: int) -> Rect:
        """The region of map ``position`` (0 = input) that ``device`` owns."""
        t = self.tile(device)
        return tuple((self.bounds[ax][position][t[ax]], self.bounds[ax][position][t[ax] + 1]) for ax in (0, 1))

    def group_input(self, a: int, b: int, device: int) -> Rect:
        """The region of map ``a`` that ``device`` needs to run layers ``a..b-1``."""
        return self.steps(a, b, device, 0)[0].src, self.steps(a, b, device, 1)[0].src

    def halo_pieces(self, a: int, b: int, device: int) -> list[tuple[int, Rect]]:
        """``(owner, region)`` pieces of map ``a`` that ``device`` receives from other devices."""
        need = self.group_input(a, b, device)
        pieces = []
        for peer in range(self.devices):
            piece = intersect_rect(need, self.owned(a, peer))
            if peer != device and piece:
                pieces.append((peer, piece))
        return pieces

    def halo_elements(self, a: int, b: int, device: int) -> tuple[int, int]:
        """(pixels received, messages received) per sample and channel at the start of group ``a..b``."""
        pieces = self.halo_pieces(a, b, device)
        return sum(area(r) for _, r in pieces), len(pieces)

    def group_flops(self, a: int, b: int, device: int) -> float:
        """Forward FLOPs per sample ``device`` spends on layers ``a..b-1``, overlap included."""
        return _flops(self.units[a:b], self.steps(a, b, device, 0), self.steps(a, b, device, 1))

    def untiled_flops(self, a: int, b: int) -> float:
        """Forward FLOPs per sample of layers ``a..b-1`` on one device, without tiling."""
        total = 0.0
        for i in range(a, b):
            total += _unit_untiled_flops(self.units[i], self.sizes[0][i], self.sizes[1][i])
        return total


def _flops(units: list[Unit], rows: tuple[Step, ...], cols: tuple[Step, ...]) -> float:
    total = 0.0
    for u, r, c in zip(units, rows, cols):
        if isinstance(u, Block):
            total += _flops(u.main, r.main, c.main) + _flops(u.shortcut, r.shortcut, c.shortcut)
        total += u.flops_per_pixel * (r.dst[1] - r.dst[0]) * (c.dst[1] - c.dst[0])
    return total


def _unit_untiled_flops(u: Unit, h: int, w: int) -> float:
    if isinstance(u, Layer):
        return u.flops_per_pixel * u.windows[0].out_size(h) * u.windows[1].out_size(w)
    total = 0.0
    for path in (u.main, u.shortcut):
        hh, ww = h, w
        for layer in path:
            total += _unit_untiled_flops(layer, hh, ww)
            hh, ww = layer.windows[0].out_size(hh), layer.windows[1].out_size(ww)
    oh = path_sizes((u.node(0),), h)[-1]
    ow = path_sizes((u.node(1),), w)[-1]
    return total + u.flops_per_pixel * oh * ow
