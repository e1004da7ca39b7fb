"""The two helpers every graph reader shares: `node_value` (a node's example value, from the refreshed concrete
metadata or from export's symbolic one) and `op_name` (an op's or a node's op's name, in the form a caller matches
on). Each test pins a behaviour some caller depends on."""
from __future__ import annotations

import operator

import torch
from torch import fx, nn

import fxmem
from fxmem.nn.remat import op_named
from fxmem.node_value import EXPORT, SYMBOLIC, node_value
from fxmem.ops import OVERLOAD, PACKET, QUALIFIED, op_name

aten = torch.ops.aten


class Scores(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, tokens):
        return torch.softmax(self.proj(tokens), dim=-1)


def captured_graph(batch: int = 3):
    """Scores captured with a dynamic batch and refreshed, so nodes hold both export's and fxmem's values."""
    program = fxmem.capture(Scores(), (torch.randn(batch, 8),))
    program.refresh()
    return program.graph


def call_node(graph: fx.Graph, packet_name: str) -> fx.Node:
    return next(node for node in graph.nodes if node.op == "call_function" and op_name(node) == packet_name)


def hand_node(**meta) -> fx.Node:
    graph = fx.Graph()
    node = graph.placeholder("x")
    node.meta.update(meta)
    return node


# ------------------------------------------------------------------------------------------------- node_value
def test_the_refreshed_value_comes_first_and_has_the_example_sizes():
    graph = captured_graph(batch=3)
    linear = call_node(graph, "linear")
    value = node_value(linear)
    assert value is linear.meta["fxmem_val"]
    assert tuple(int(size) for size in value.shape) == (3, 8)


def test_without_a_refresh_the_export_value_stands_in():
    export_value = torch.empty(2, 4, device="meta")
    node = hand_node(val=export_value)
    assert node_value(node) is export_value


def test_the_symbolic_source_prefers_exports_value_and_falls_back_to_the_refreshed_one():
    export_value, refreshed = torch.empty(2, device="meta"), torch.empty(3, device="meta")
    assert node_value(hand_node(val=export_value, fxmem_val=refreshed), source=SYMBOLIC) is export_value
    assert node_value(hand_node(fxmem_val=refreshed), source=SYMBOLIC) is refreshed


def test_the_export_source_reads_exports_value_alone():
    refreshed = torch.empty(3, device="meta")
    assert node_value(hand_node(fxmem_val=refreshed), source=EXPORT) is None
    export_value = torch.empty(2, device="meta")
    assert node_value(hand_node(val=export_value, fxmem_val=refreshed), source=EXPORT) is export_value


def test_a_key_that_holds_none_falls_through_to_the_next():
    export_value = torch.empty(2, device="meta")
    assert node_value(hand_node(fxmem_val=None, val=export_value)) is export_value
    assert node_value(hand_node()) is None


def test_tensor_only_drops_scalars_and_tuples():
    assert node_value(hand_node(fxmem_val=7)) == 7
    assert node_value(hand_node(fxmem_val=7), tensor_only=True) is None
    pair = (torch.empty(1, device="meta"), torch.empty(1, device="meta"))
    assert node_value(hand_node(fxmem_val=pair)) is pair
    assert node_value(hand_node(fxmem_val=pair), tensor_only=True) is None


def test_a_literal_argument_is_its_own_value_only_when_asked():
    assert node_value(0.125) is None
    assert node_value(0.125, literals=True) == 0.125
    assert node_value(None, literals=True) is None


def test_the_symbolic_value_keeps_a_dynamic_batch_symbolic():
    graph = captured_graph(batch=3)
    linear = call_node(graph, "linear")
    symbolic_batch = str(node_value(linear, source=SYMBOLIC).shape[0])
    assert symbolic_batch != "3" and symbolic_batch == str(node_value(linear, source=EXPORT).shape[0])


# ---------------------------------------------------------------------------------------------------- op_name
def test_the_three_forms_of_an_aten_overload():
    assert op_name(aten.softmax.int, PACKET) == "softmax"
    assert op_name(aten.softmax.int, OVERLOAD) == "softmax.int"
    assert op_name(aten.softmax.int, QUALIFIED) == "aten.softmax.int"
    assert op_name(aten.softmax.int) == "softmax"  # the packet form is the default


def test_the_qualified_name_reads_back_as_the_op():
    for op in (aten.softmax.int, aten.linear.default, aten.add.Tensor):
        assert op_named(op_name(op, QUALIFIED)) is op


def test_a_packet_and_a_python_callable_are_named_by_their_own_name():
    assert op_name(aten.softmax, PACKET) == op_name(aten.softmax, OVERLOAD) == "softmax"
    assert op_name(operator.getitem) == op_name(operator.getitem, OVERLOAD) == "getitem"


def test_a_callable_without_a_name_is_named_by_str():
    class Nameless:
        def __call__(self):
            return None

        def __str__(self):
            return "nameless op"

    assert op_name(Nameless()) == "nameless op"


def test_a_node_is_named_by_the_op_it_calls():
    graph = captured_graph()
    softmax = call_node(graph, "softmax")
    assert softmax.target in (aten.softmax.int, aten._softmax.default)
    assert op_name(softmax, OVERLOAD) == softmax.target.__name__
    assert op_name(softmax, QUALIFIED) == str(softmax.target)


def test_a_node_that_calls_no_function_is_named_by_its_target_unless_calls_only():
    graph = fx.Graph()
    tokens = graph.placeholder("tokens")
    block = graph.call_module("layers.0", (tokens,))
    view = graph.call_method("view", (block, -1))
    for node, target in ((tokens, "tokens"), (block, "layers.0"), (view, "view")):
        assert op_name(node) == target
        assert op_name(node, calls_only=True) == ""
