"""Real parameter subclasses reach fake-mode ops as plain aliases (torch < 2.13 refuses them there)."""
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.kernel_layouts import CpuKernelLayouts
from fxmem.parameter_subclasses import has_parameter_subclass, plain_parameters


class TaggedParameter(nn.Parameter):
    """A parameter subclass that only adds an attribute, as bitsandbytes' Params4bit does."""


def test_a_parameter_subclass_becomes_a_plain_alias_of_its_storage():
    tagged = TaggedParameter(torch.randn(3, 4), requires_grad=False)
    (plain, listed), kwargs = plain_parameters((tagged, [tagged]), {"other": tagged})
    for value in (plain, listed[0], kwargs["other"]):
        assert type(value) is torch.Tensor
        assert value.untyped_storage().data_ptr() == tagged.untyped_storage().data_ptr()
        assert torch.equal(value, tagged) and value.stride() == tagged.stride()
    assert has_parameter_subclass((1, [tagged]), {}) and has_parameter_subclass((), {"w": tagged})


def test_plain_parameters_and_fakes_of_parameters_are_left_alone():
    """A fake of a parameter passes `isinstance(x, nn.Parameter)`; aliasing it inside the fake mode would loop."""
    param = nn.Parameter(torch.randn(2, 2))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(param)
    assert isinstance(fake, nn.Parameter) and not has_parameter_subclass((param, fake), {})
    assert plain_parameters((param, fake), {})[0][1] is fake


@pytest.mark.parametrize("op", ["linear", "t"])
def test_fake_runs_take_a_real_parameter_subclass(op):
    tagged = TaggedParameter(torch.randn(3, 4), requires_grad=False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, CpuKernelLayouts():
        x = mode.from_tensor(torch.randn(2, 4))
        out = torch.nn.functional.linear(x, tagged) if op == "linear" else tagged.t()
    assert tuple(out.shape) == ((2, 3) if op == "linear" else (4, 3))
