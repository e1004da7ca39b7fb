"""Capture is faithful where torch.export is not on its own: a custom autograd.Function's backward (export inlines
the forward and drops the backward: capture compares gradients and refuses a difference), and every train-flag
op export emits (in-place dropout, feature/alpha dropout, batch norm without running stats, instance norm, rrelu,
RNN dropout) follows `.train()` / `.eval()` of the captured module."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxmem
from fxmem.errors import CaptureError


class HalfGrad(torch.autograd.Function):
    """Identity forward, custom backward that halves the gradient (autograd's derivative would not)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class Square(torch.autograd.Function):
    """x * x with the backward autograd would compute too."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class TanhGelu(torch.autograd.Function):
    """BLOOM's training GELU: the tanh approximation, with a backward written out by hand (the same derivative as
    autograd's of the forward, rounded differently)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * g


class _Act(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x)


class _FnNet(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), _Act(fn))
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(self.block(self.fc(x)))


def _grads(module, x, w):
    x = x.clone().requires_grad_(True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        out = module(x)
    params = [p for _, p in module.named_parameters()]
    g = torch.autograd.grad((out * w).sum(), params + [x])
    return out.detach(), dict(zip([n for n, _ in module.named_parameters()] + ["x"], g))


def test_custom_function_with_other_backward_is_refused():
    torch.manual_seed(0)
    model, x = _FnNet(HalfGrad), torch.randn(4, 8)
    with pytest.raises(CaptureError) as e:
        fxmem.capture(model, (x,))
    msg = str(e.value)
    assert f"{HalfGrad.__module__}.HalfGrad" in msg
    assert "module 'block.1'" in msg  # the _Act module the Function was called in
    assert "parameter 'fc.weight'" in msg  # the first parameter whose gradient differs
    assert "custom_op" in msg and "register_autograd" in msg
    assert model.training and model.fc.weight.grad is None  # the user's model is left as it was


def test_custom_function_with_autograd_backward_captures_with_note():
    torch.manual_seed(0)
    model, x = _FnNet(Square), torch.randn(4, 8)
    program = fxmem.capture(copy.deepcopy(model), (x,))
    assert any("Square" in n and "'block.1'" in n and "inlined" in n for n in program.notes), program.notes
    w = torch.randn(4, 8)
    for train in (True, False):
        model.train(train)
        program.module.train(train)
        ref_out, ref_g = _grads(model, x, w)
        out, g = _grads(program.module, x, w)
        torch.testing.assert_close(out, ref_out)
        assert set(g) == set(ref_g)
        for n in ref_g:
            torch.testing.assert_close(g[n], ref_g[n], msg=f"grad of {n}")


def test_a_note_says_when_the_inlined_gradients_are_close_but_not_the_same():
    """Within the tolerance, the capture is kept; its note says whether the gradients are bit-identical (Square's)
    or only close, with the largest difference (a hand-written GELU backward's)."""
    torch.manual_seed(0)
    notes = {fn.__name__: fxmem.capture(_FnNet(fn), (torch.randn(64, 8),)).notes for fn in (Square, TanhGelu)}
    square = next(n for n in notes["Square"] if "inlined" in n)
    gelu = next(n for n in notes["TanhGelu"] if "inlined" in n)
    assert "gives the same gradients" in square and "not bit-identical" not in square, square
    assert "not bit-identical (max abs diff " in gelu, gelu


class _HookNet(nn.Module):
    """A gradient hook registered on an activation in forward: export drops it."""

    def __init__(self, hook):
        super().__init__()
        self.fc, self.fc2, self.hook = nn.Linear(8, 8), nn.Linear(8, 8), hook

    def forward(self, x):
        h = self.fc(x)
        if h.requires_grad:
            h.register_hook(self.hook)
        return self.fc2(h)


def test_gradient_hook_changing_gradients_is_refused():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"Tensor\.register_hook.*parameter 'fc\.(weight|bias)'|"
                                           r"parameter 'fc\.(weight|bias)'.*Tensor\.register_hook"):
        fxmem.capture(_HookNet(lambda g: g * 0.5), (torch.randn(4, 8),))


def test_gradient_hook_that_only_observes_captures_with_note():
    torch.manual_seed(0)
    seen = []
    hook, apply = torch.Tensor.__dict__["register_hook"], torch.autograd.Function.__dict__["apply"]
    program = fxmem.capture(_HookNet(lambda g: seen.append(g.shape)), (torch.randn(4, 8),))
    assert any("register_hook" in n for n in program.notes), program.notes
    # the originals are put back after capture
    assert torch.Tensor.__dict__["register_hook"] is hook and torch.autograd.Function.__dict__["apply"] is apply


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_is_refused():
    """Reentrant checkpoint is a Function whose forward runs under no_grad: export keeps the no_grad and drops the
    backward, so the captured module would give no gradient through the checkpointed part."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(8, 8)
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return checkpoint(self.fc, self.emb(x), use_reentrant=True)

    with pytest.raises(CaptureError, match="CheckpointFunction.*use_reentrant=False"):
        fxmem.capture(Net(), (torch.randn(4, 8),))


@torch.library.custom_op("fxmem_test_faithful::half_grad", mutates_args=())
def _half_grad_op(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


@_half_grad_op.register_fake
def _(x):
    return torch.empty_like(x)


_half_grad_op.register_autograd(lambda ctx, g: g * 0.5)


def test_custom_op_with_register_autograd_keeps_its_backward():
    """The hint capture gives: a custom op keeps its backward through export (no error, no note)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return _half_grad_op(self.fc(x))

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    program = fxmem.capture(copy.deepcopy(model), (x,))
    assert program.notes == []
    w = torch.randn(4, 8)
    _, ref_g = _grads(model, x, w)
    _, g = _grads(program.module, x, w)
    for n in ref_g:
        torch.testing.assert_close(g[n], ref_g[n], msg=f"grad of {n}")


# ------------------------------------------------------------------------------------------ train-flag ops

DROPOUTS = [
    (nn.Dropout, (4, 8)),
    (nn.Dropout1d, (2, 4, 8)),
    (nn.Dropout2d, (2, 4, 3, 3)),
    (nn.Dropout3d, (2, 4, 2, 2, 2)),
    (nn.AlphaDropout, (4, 8)),
    (nn.FeatureAlphaDropout, (2, 4, 3, 3)),
]


class _Wrap(nn.Module):
    def __init__(self, layer, inplace_result=False):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.layer = layer
        self.inplace_result = inplace_result

    def forward(self, x):
        y = x * self.scale
        if self.inplace_result:  # the dogfood repro: the in-place result is read through `y`
            self.layer(y)
            return y
        out = self.layer(y)
        return out[0] if isinstance(out, tuple) else out


def _assert_modes_follow(model, program, x):
    """eval, train (same RNG seed), eval again: the captured module computes what the model computes."""
    for train in (False, True, False, True):
        model.train(train)
        program.module.train(train)
        with torch.no_grad():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(3)
                ref = model(x)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(3)
                got = program.module(x)
        torch.testing.assert_close(got, ref, msg=f"{'train' if train else 'eval'} mode output differs")


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("cls,shape", DROPOUTS, ids=[c.__name__ for c, _ in DROPOUTS])
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_dropout_follows_train_eval(cls, shape, inplace, mode):
    # export emits dropout_ / feature_dropout_ for inplace Dropout*, and alpha_dropout / feature_alpha_dropout
    # for the alpha variants either way (their forward does not pass `inplace` on, so eager does not mutate)
    torch.manual_seed(0)
    ignores_inplace = cls in (nn.AlphaDropout, nn.FeatureAlphaDropout)
    model = _Wrap(cls(0.5, inplace=inplace), inplace_result=inplace and not ignores_inplace)
    x = torch.randn(*shape)
    program = fxmem.capture(copy.deepcopy(model), (x,), mode=mode)
    assert program.notes == []
    _assert_modes_follow(model, program, x)
    model.train()
    program.module.train()
    with torch.no_grad():
        assert not torch.equal(program.module(x), model.eval()(x)), "train mode must drop out"


@pytest.mark.parametrize("name", ["batchnorm_no_running_stats", "instancenorm_running_stats", "rrelu",
                                  "rrelu_inplace", "lstm_dropout"])
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_other_train_flag_ops_follow_train_eval(name, mode):
    layer, shape = {
        "batchnorm_no_running_stats": (nn.BatchNorm1d(8, track_running_stats=False), (4, 8)),
        "instancenorm_running_stats": (nn.Sequential(nn.Unflatten(1, (2, 4)),
                                                     nn.InstanceNorm1d(2, track_running_stats=True)), (4, 8)),
        "rrelu": (nn.RReLU(), (4, 8)),
        "rrelu_inplace": (nn.RReLU(inplace=True), (4, 8)),
        "lstm_dropout": (nn.LSTM(8, 8, num_layers=2, dropout=0.5), (3, 8)),
    }[name]
    torch.manual_seed(0)
    model, x = _Wrap(layer), torch.randn(*shape)
    program = fxmem.capture(copy.deepcopy(model), (x,), mode=mode)
    assert program.notes == []
    _assert_modes_follow(model, program, x)


def test_python_branch_on_training_gets_a_graph_per_mode_and_a_note():
    """A python-level `self.training` branch (beside an in-place dropout, whose flag follows the mode anyway): the
    eval mode is captured too, so the captured module's eval() computes the model's eval(), and a note says why."""
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.5, inplace=True)

        def forward(self, x):
            y = self.fc(x)
            self.drop(y)
            return y * 2 if self.training else y

    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4, 8)
    program = fxmem.capture(copy.deepcopy(model), (x,))
    assert len(program.notes) == 1 and "self.training" in program.notes[0]
    assert "return y * 2 if self.training else y" in program.notes[0] and "captured eval mode too" in program.notes[0]
    _assert_modes_follow(model, program, x)


def test_meta_device_model_or_inputs_are_refused_clearly():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(CaptureError, match="parameter 'weight' is on the meta device"):
        fxmem.capture(model, (torch.randn(2, 4),))
    with pytest.raises(CaptureError, match="example input 0 .* meta device"):
        fxmem.capture(nn.Linear(4, 4), (torch.randn(2, 4, device="meta"),))
