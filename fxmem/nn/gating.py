"""GatedResidual: `x + g(x) * f(x)`, where a small learned gate lets easy inputs skip an expensive branch.

    gated = GatedResidual(body, x_index=0, features=d)   # body: the branch f as a GraphModule (its inputs)
    y = gated(x, w1, b1, ...)                            # the branch's inputs, x among them at x_index
    loss = task_loss + 1e-2 * fxmem.gating_loss(model)   # sparsity pressure on the gates (training)

g = min(1, 2 * sigmoid(u)) with the gate's last Linear zero at insertion, so g = 1 *exactly* and the module is
bit-identical to the original residual add. Training: soft gates, the branch always runs. Eval mode, real
tensors: hard gates with `threshold` (closed rows take x; no open row, no call). Counters: `skip_stats(model)`,
`reset_skip_stats(model)`; `force_open = True` computes `x + f(x)`.
Design: docs/design/pruning-gating.md, "GatedResidual".
"""
from __future__ import annotations

import torch
from torch import fx, nn

from ..errors import FxmemError

__all__ = ["GatedResidual", "gating_loss", "skip_stats", "reset_skip_stats", "gates"]


def _is_fake_or_tracing(value) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
        if is_fake(value):
            return True
    except ImportError:  # pragma: no cover
        pass
    if torch.compiler.is_compiling():
        return True
    return type(value) is not torch.Tensor and not isinstance(value, nn.Parameter)


class GatedResidual(nn.Module):
    # (ten parameters: the module's public options; saved results rebuild it from them, fxmem.module_configs)
    def __init__(self, body: nn.Module, x_index: int, features: int, *, feature_dim: int = -1,
                 reduction: int = 4, init_bias: float = 0.0, threshold: float = 0.5, per_sample: bool = True,
                 label: str = "", row_safe: bool = True):
        super().__init__()
        if init_bias < 0:
            raise ValueError(f"GatedResidual {label}: init_bias must be >= 0 so gates start open, got {init_bias}")
        hidden = max(1, features // max(1, reduction))
        self.body = body
        self.gate = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        with torch.no_grad():
            self.gate[2].weight.zero_()
            self.gate[2].bias.fill_(float(init_bias))
        self.x_index = int(x_index)
        self.features = int(features)
        self.reduction = int(reduction)  # (the gate's hidden width is features // reduction)
        self.feature_dim = int(feature_dim)
        self.threshold = float(threshold)
        self.per_sample = bool(per_sample)
        self.row_safe = bool(row_safe)  # the branch's only per-row input is x
        self.label = label
        self.force_open = False
        self._last_raw: torch.Tensor | None = None
        self.reset_stats()

    def __getstate__(self):
        # the last training forward's gate values are part of an autograd graph: never copied or pickled
        state = self.__dict__.copy()
        state["_last_raw"] = None
        return state

    # ------------------------------------------------------------------------------------------- stats
    def reset_stats(self) -> None:
        self.calls = 0
        self.calls_skipped = 0
        self.rows = 0
        self.rows_skipped = 0

    def stats(self) -> dict:
        return {"calls": self.calls, "calls_skipped": self.calls_skipped, "rows": self.rows,
                "rows_skipped": self.rows_skipped,
                "skip_rate": self.rows_skipped / self.rows if self.rows else 0.0}

    # ------------------------------------------------------------------------------------------- gate
    def summary(self, residual: torch.Tensor) -> torch.Tensor:
        """(B, d): the mean of `residual` over every dim except 0 and the feature dim."""
        feature_dim = self.feature_dim if self.feature_dim >= 0 else residual.dim() + self.feature_dim
        if residual.dim() == 1:
            return residual.unsqueeze(0)
        moved = residual.movedim(feature_dim, -1) if feature_dim != residual.dim() - 1 else residual
        if moved.dim() > 2:
            moved = moved.reshape(moved.shape[0], -1, moved.shape[-1]).mean(1)
        return moved

    def raw_gate(self, residual: torch.Tensor) -> torch.Tensor:
        """2 * sigmoid(u) per row, unclamped (what gating_loss penalises)."""
        logit = self.gate(self.summary(residual)).squeeze(-1)
        return 2.0 * torch.sigmoid(logit)

    def _bcast(self, gate: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return gate.reshape([gate.shape[0]] + [1] * (like.dim() - 1)).to(like.dtype)

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, *inputs):
        residual = inputs[self.x_index]
        if self.force_open:
            return residual + self.body(*inputs)
        raw = self.raw_gate(residual)
        gate = torch.clamp(raw, max=1.0)
        soft = self.training or torch.is_grad_enabled() and residual.requires_grad or _is_fake_or_tracing(residual)
        if soft:
            if self.training:
                self._last_raw = raw
            branch = self.body(*inputs)
            return residual + self._bcast(gate, branch) * branch
        # ---- hard gates (inference)
        open_ = gate >= self.threshold
        rows = int(open_.numel())
        n_open = int(open_.sum())
        self.calls += 1
        self.rows += rows
        if n_open == 0:
            self.calls_skipped += 1
            self.rows_skipped += rows
            return residual
        if n_open == rows:
            branch = self.body(*inputs)
            return residual + self._bcast(gate, branch) * branch
        if self.per_sample and self.row_safe:
            idx = open_.nonzero().squeeze(1)
            sub = list(inputs)
            open_rows = residual.index_select(0, idx)
            sub[self.x_index] = open_rows
            branch = self.body(*sub)
            self.rows_skipped += rows - n_open
            return residual.index_copy(0, idx, open_rows + self._bcast(gate.index_select(0, idx), branch) * branch)
        branch = self.body(*inputs)
        return residual + self._bcast(torch.where(open_, gate, torch.zeros_like(gate)), branch) * branch

    def extra_repr(self) -> str:
        return (f"label={self.label!r}, features={self.features}, threshold={self.threshold}, "
                f"per_sample={self.per_sample and self.row_safe}")


def gates(module: nn.Module) -> dict[str, GatedResidual]:
    return {name: m for name, m in module.named_modules() if isinstance(m, GatedResidual)}


def gating_loss(module: nn.Module) -> torch.Tensor:
    """Sparsity regulariser for the gates: the mean over gated branches of the mean (unclamped) gate value of the
    last training-mode forward. Add `lam * gating_loss(model)` to the task loss."""
    gated = gates(module)
    if not gated:
        raise FxmemError("gating_loss: the module has no GatedResidual (run the gating pass first)")
    vals = [m._last_raw.float().mean() for m in gated.values() if m._last_raw is not None]
    if not vals:
        raise FxmemError("gating_loss: no gate has run in training mode yet (call model.train() and run a "
                         "forward pass before computing the loss)")
    return torch.stack(vals).mean()


def skip_stats(module: nn.Module) -> dict[str, dict]:
    """{gate module name (label): counters and skip rate} for every GatedResidual in `module`."""
    return {(m.label or name): m.stats() for name, m in gates(module).items()}


def reset_skip_stats(module: nn.Module) -> None:
    for gate_module in gates(module).values():
        gate_module.reset_stats()


def _body_repr(body) -> str:  # pragma: no cover - debugging aid
    return body.code if isinstance(body, fx.GraphModule) else repr(body)
