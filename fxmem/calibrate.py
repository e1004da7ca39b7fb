"""Calibration: how the hidden units of a captured model behave on real data.

    stats = fxmem.calibrate(program, data, max_batches=16)      # data: an iterable of model inputs
                                                                 # program: a captured Program or an nn.Module
    stats.layers["h.0.mlp.c_proj"].freq                          # per-unit firing frequency, a tensor
    stats.histograms()                                           # coldness histograms for the report

One `LayerStats` (`freq`, `mean`, `mean_abs`, `var`, `count` per unit) for the input of every linear / convolution
whose weight is a parameter, keyed by the consuming module's path. The model runs in eval mode under no_grad.
Design: docs/design/pruning-gating.md, "Calibration".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import fx

from .capture import capture
from .depgroups import probe_nodes
from .errors import FxmemError
from .program import Program
from .userstate import keeps_model_state

__all__ = ["calibrate", "CalibrationStats", "LayerStats", "normalize_item"]


@dataclass
class LayerStats:
    layer: str  # module path of the consumer
    node: str  # graph node whose values are watched
    channel_dim: int
    count: int = 0  # positions per unit seen
    sum: torch.Tensor | None = None
    sum_sq: torch.Tensor | None = None
    sum_abs: torch.Tensor | None = None
    fired: torch.Tensor | None = None

    @property
    def units(self) -> int:
        return 0 if self.sum is None else int(self.sum.numel())

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / max(self.count, 1)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.sum_abs / max(self.count, 1)

    @property
    def var(self) -> torch.Tensor:
        mean = self.mean
        return (self.sum_sq / max(self.count, 1) - mean * mean).clamp_min(0)

    @property
    def freq(self) -> torch.Tensor:
        return self.fired / max(self.count, 1)

    def update(self, activation: torch.Tensor, eps: float) -> None:
        activation = activation.detach().to(torch.float64)
        dim = self.channel_dim if self.channel_dim >= 0 else activation.dim() + self.channel_dim
        flat = activation.movedim(dim, -1).reshape(-1, activation.shape[dim])
        scale = flat.abs().mean()
        fire = (flat.abs() > eps * scale).to(torch.float64) if eps > 0 else (flat != 0).to(torch.float64)
        if self.sum is None:
            zeros = torch.zeros(flat.shape[1], dtype=torch.float64)
            self.sum, self.sum_sq, self.sum_abs, self.fired = zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone()
        if flat.shape[1] != self.sum.numel():
            raise FxmemError(f"calibration: {self.layer} ({self.node}) has {flat.shape[1]} units in one batch and "
                             f"{self.sum.numel()} in another")
        self.count += flat.shape[0]
        self.sum += flat.sum(0)
        self.sum_sq += (flat * flat).sum(0)
        self.sum_abs += flat.abs().sum(0)
        self.fired += fire.sum(0)

    def to_dict(self) -> dict:
        freq = self.freq
        return {"layer": self.layer, "node": self.node, "units": self.units, "positions": self.count,
                "cold_units": int((freq < 0.05).sum()), "mean_freq": float(freq.mean()) if freq.numel() else 0.0,
                "mean_abs": float(self.mean_abs.mean()) if freq.numel() else 0.0}


@dataclass
class CalibrationStats:
    layers: dict = field(default_factory=dict)  # layer path -> LayerStats
    by_node: dict = field(default_factory=dict)  # node name -> LayerStats
    batches: int = 0
    eps: float = 0.01

    def __getitem__(self, key: str) -> LayerStats:
        if key in self.layers:
            return self.layers[key]
        return self.by_node[key]

    def histograms(self, bins: int = 10) -> dict:
        """{"bin_edges": [...], layer: counts} of the per-unit firing frequency (the report draws these)."""
        edges = torch.linspace(0, 1, bins + 1)
        out: dict[str, Any] = {"bin_edges": [round(float(e), 4) for e in edges]}
        for name, layer_stats in self.layers.items():
            if layer_stats.sum is None:
                continue
            counts = torch.histc(layer_stats.freq.float().clamp(0, 1), bins=bins, min=0.0, max=1.0)
            out[name] = [int(x) for x in counts.tolist()]
        return out

    def summary(self) -> dict:
        return {"batches": self.batches, "eps": self.eps,
                "layers": {k: v.to_dict() for k, v in self.layers.items()}}

    def plot(self, path_png=None, path_svg=None, bins: int = 20):
        """A figure with one coldness histogram per layer; saved to the given paths; returns the figure."""
        import matplotlib  # (heavy: loaded only to draw)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        names = [k for k, v in self.layers.items() if v.sum is not None]
        panels = max(len(names), 1)
        cols = min(4, panels)
        rows = (panels + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
        for axis, name in zip(axes.flat, names):
            axis.hist(self.layers[name].freq.numpy(), bins=bins, range=(0, 1), color="#4477aa")
            axis.set_title(name, fontsize=8)
            axis.set_xlabel("firing frequency", fontsize=7)
            axis.tick_params(labelsize=7)
        for axis in list(axes.flat)[len(names):]:
            axis.axis("off")
        fig.tight_layout()
        with matplotlib.rc_context({"svg.hashsalt": "fxmem-calibration"}):
            if path_png:
                fig.savefig(path_png, dpi=100, metadata={"Software": None})
            if path_svg:
                fig.savefig(path_svg, metadata={"Date": None})
        plt.close(fig)
        return fig


def normalize_item(item) -> tuple[tuple, dict]:
    """One calibration item -> (args, kwargs)."""
    if isinstance(item, dict):
        return (), dict(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple) and isinstance(item[1], dict):
        return item[0], dict(item[1])
    if isinstance(item, (tuple, list)):
        return tuple(item), {}
    return (item,), {}


class _Watcher(fx.Interpreter):
    def __init__(self, graph_module, watch: dict, eps: float):
        super().__init__(graph_module)
        self.watch, self.eps = watch, eps

    def run_node(self, node):
        out = super().run_node(node)
        layer_stats = self.watch.get(node.name)
        if layer_stats is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
            layer_stats.update(out, self.eps)
        return out


@keeps_model_state
def calibrate(program: Program, data: Iterable, *, max_batches: int | None = 16, eps: float = 0.01,
              nodes: dict | None = None, progress: bool = True, stats: CalibrationStats | None = None) \
        -> CalibrationStats:
    """Run `program` on up to `max_batches` items of `data` and collect per-unit statistics (see module doc).

    nodes: {node name: (layer label, channel dim)} to watch instead of every linear/conv input.
    """
    if data is None:
        raise FxmemError("calibrate: no data (pass an iterable of model inputs, e.g. the model file's "
                         "calibration_data())")
    if not isinstance(program, Program):
        if not isinstance(program, torch.nn.Module):
            raise FxmemError(f"calibrate: expected a Program or an nn.Module, got {type(program).__name__}")
        data = list(data)
        if not data:
            raise FxmemError("calibrate: the calibration data is empty")
        args, kwargs = normalize_item(data[0])
        program = capture(program, args, kwargs, mode="inference")
    graph_module = program.module
    watch_spec = nodes if nodes is not None else probe_nodes(graph_module)
    stats = stats or CalibrationStats(eps=eps)
    for name, (layer, cdim) in watch_spec.items():
        if name not in stats.by_node:
            label = layer if layer not in stats.layers else f"{layer}:{name}"
            layer_stats = LayerStats(layer=label, node=name, channel_dim=cdim)
            stats.by_node[name] = layer_stats
            stats.layers[label] = layer_stats
    watch = {n: stats.by_node[n] for n in watch_spec}
    items = []
    for index, item in enumerate(data):
        if max_batches is not None and index >= max_batches:
            break
        items.append(item)
    if not items:
        raise FxmemError("calibrate: the calibration data is empty")
    item_iter = items
    if progress:
        try:
            from tqdm.auto import tqdm
            item_iter = tqdm(items, desc="calibrating", unit="batch", leave=False)
        except ImportError:  # pragma: no cover
            pass
    was = graph_module.training
    graph_module.eval()
    try:
        with torch.no_grad():
            for item in item_iter:
                args, kwargs = normalize_item(item)
                flat = program.flat_inputs(args, kwargs)
                _Watcher(graph_module, watch, eps).run(*flat, enable_io_processing=False)
                stats.batches += 1
    finally:
        graph_module.train(was)
    return stats
