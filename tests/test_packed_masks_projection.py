"""benchmarks/packed_masks_projection.py: dropout masks priced at one bit per element, in the cost model's trace
while asked and in a copy of the floor, and nowhere else."""
from __future__ import annotations

import pytest

import fxmem
from benchmarks.eager_floor import EagerFloor, RecomputeGraph
from benchmarks.packed_masks_projection import floor_with_bit_masks, masks_priced_as_bits
from fxmem.costmodel import trace as trace_module
from fxmem.costmodel import trace_forward
from fxmem.nn.dropout import DRAW_OPS
from fxmem.ops import packet
from fxmem.pipeline import pass_module

from .conftest import example


def _mask_bytes(program, loss_fn) -> list[tuple[int, int]]:
    """(bytes the trace records for its storage, bytes of the tensor: one per element) of each bool Bernoulli draw
    in a forward trace of `program`."""
    recorder = trace_forward(program, program.example_args, program.example_kwargs, "train", loss_fn).recorder
    return [(recorder.storage_bytes[record.new_keys[0]], record.out_bytes[0]) for record in recorder.records
            if packet(record.func) in DRAW_OPS and record.region is None]


def test_the_trace_records_masks_at_an_eighth_only_while_asked():
    model, args, kwargs, loss_fn = example("gpt")
    program = fxmem.capture(model, args, kwargs)
    program.refresh()
    assert pass_module("checkpoint").compact_dropout(program)  # (bool masks, drawn by Bernoulli)
    program.refresh()
    original = trace_module.DispatchRecorder.__torch_dispatch__
    as_bytes = _mask_bytes(program, loss_fn)
    with masks_priced_as_bits():
        as_bits = _mask_bytes(program, loss_fn)
    assert trace_module.DispatchRecorder.__torch_dispatch__ is original
    assert as_bytes and len(as_bits) == len(as_bytes)
    for (stored, elements), (packed, _) in zip(as_bytes, as_bits):
        assert stored == elements  # a bool per element
        assert packed == (elements + 7) // 8
    assert _mask_bytes(program, loss_fn) == as_bytes


def test_the_floor_keeps_masks_at_an_eighth_and_the_original_as_it_was():
    graph = RecomputeGraph()
    graph._add("linear", 2.0, 80, 80, False, [])
    graph._add("dropout.mask", 1.0, 20, 20, False, [])
    graph._add("dropout", 0.5, 60, 60, False, [0, 1])
    graph.total = 160
    floor = EagerFloor([], 0, graph)
    bits = floor_with_bit_masks(floor)
    assert bits.graph.keep_bytes == [80, 3, 60]
    assert floor.graph.keep_bytes == [80, 20, 60]
    # at 83 bytes kept: as bytes the mask is drawn again (the linear kept, 80 bytes: 1.0 + 0.5 s); as bits it is
    # kept beside the linear (83 bytes) and only the dropout's output is made again (0.5 s)
    assert floor.seconds(160 - 83) == pytest.approx(1.5)
    assert bits.seconds(160 - 83) == pytest.approx(0.5)
