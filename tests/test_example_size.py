"""A symbolic size's value before the step runs, asked the same way under every supported torch."""
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from fxmem.costmodel.example_size import known_size


def backed_size(value: int) -> torch.SymInt:
    env = ShapeEnv()
    source = ConstantSource("batch")
    symbol = env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(symbol, hint=value, source=source)


def test_a_backed_size_is_its_example_value():
    size = backed_size(7)
    assert isinstance(size, torch.SymInt)
    assert known_size(size * 4) == 28


def test_a_size_that_depends_on_the_data_is_not_known():
    assert known_size(ShapeEnv().create_unbacked_symint() * 4) is None


def test_a_plain_int_is_itself():
    assert known_size(12) == 12
