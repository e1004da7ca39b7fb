"""The interpreters a forward trace runs a program with (`fxmem.costmodel.trace`).

`RecordingInterpreter` runs the program's graph node by node and keeps the trace's dispatch recorder told which
node, module path and region issue the ops it records, counting nodes as steps. A node whose output fxmem.nn.recast
registered as a recipe (remat, bool-mask dropout) has that output recorded as saved through the recipe. A
checkpoint or offload region (`fxmem.nn.regions`) runs its body, a graph under `_StepInterpreter`, whose nodes
count as steps while the ops keep the region's labels.
"""
from __future__ import annotations

import torch
from torch import fx

from ..nn.recast import active_scope as recast_active, aside as recast_aside, cast_param, group_of, recipe_tensors
from ..nn.regions import region_info
from ..program import module_path
from .graph_run import CodegenInterpreter


class RecordingInterpreter(CodegenInterpreter):
    """Runs the program node by node, telling `recorder` (the trace's `DispatchRecorder`) which node, module and
    region issue the ops it records, and which node outputs are saved as recipes."""

    def __init__(self, module, recorder):
        super().__init__(module)
        self.recorder = recorder

    def run_node(self, n):
        recorder = self.recorder
        recorder.node = n.name
        recorder.step += 1
        recorder.module = module_path(n)
        recorder.recast_node = n.op == "call_function" and n.target is cast_param
        first = len(recorder.records)
        out = super().run_node(n)
        recorder.settle_deferred()
        self._mark_value(out, recorder.records[first:])
        scope = recast_active()
        recipe = scope.recipe_for(out) if scope is not None and isinstance(out, torch.Tensor) else None
        if recipe is not None and recorder.recipe_of.get(recorder.key(out)[0]) is not recipe:
            # the node registered its output as a recipe (fxmem.nn.recast: remat, remat_call, bool-mask dropout),
            # or an in-place op re-registered a recipe's storage (relu_ after a batch norm): saved as the recipe,
            # which holds its arguments, and recomputed in backward (a view of a recipe's output is not new)
            self._as_recipe(recorder.key(out)[0], recipe, n, first)
            # a tensor of the op's own making it saves besides its output (max pooling's indices), a recipe too
            for record in recorder.records[first:]:
                for saved in list(record.saved):
                    other = scope.recipe_of_storage(recorder.storages.address(saved))
                    if other is not None and other is not recipe and recorder.recipe_of.get(saved) is not other:
                        self._as_recipe(saved, other, n, first)
        recorder.node_held = []
        return out

    def _mark_value(self, out, records: list) -> None:
        """On the last of `records` (a node's) whose outputs include the storage of a tensor of `out`, the node's
        value (one tensor, or tuples of them), mark that tensor's path and storage (`OpRecord.values_made`)."""
        for path, tensor in _tensor_items(out, ()):
            key = self.recorder.storages.known(tensor.untyped_storage())
            maker = next((r for r in reversed(records) if key is not None and key in r.out_keys), None)
            if maker is not None:
                maker.values_made[path] = key

    def _as_recipe(self, key: int, recipe, node, first: int) -> None:
        """Storage `key`, made by `node` (its records from `first` on), saved as `recipe`."""
        recorder = self.recorder
        recorder.recast_keys.add(key)
        recorder.recipe_holds[key] = list(dict.fromkeys(recorder.key(t)[0] for t in recipe_tensors(recipe)))
        recorder.recipe_at[key] = node.name
        recorder.recipe_of[key] = recipe
        group = group_of(recipe)
        if recipe.share or group is not None:
            recorder.recipe_shared.add(key)
        else:
            recorder.recipe_shared.discard(key)
        if group is not None:
            recorder.recipe_group[key] = id(group)
        for record in recorder.records[first:]:  # the op's own saves of it (ReLU's result, max pooling's indices)
            if record.region is None and key in record.saved:
                record.saved = [saved for saved in record.saved if saved != key]
                record.recast = list(record.recast) + [key]
                recorder.hold_recipe_args(record)

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        info = region_info(module)
        if info is None:
            return super().call_module(target, args, kwargs)
        enclosing = self.recorder.region
        self.recorder.region = target
        try:
            with recast_aside():  # as the region's forward does: its own hooks decide inside
                if isinstance(info.body, fx.GraphModule) and not kwargs:  # its nodes counted, as the program's
                    return _StepInterpreter(info.body, self.recorder).run(*args)
                return info.body(*args, **kwargs)  # the region's computation, recorded op by op
        finally:
            self.recorder.region = enclosing


class _StepInterpreter(CodegenInterpreter):
    """Runs a region's body node by node, counting its nodes as steps (labels stay the region's)."""

    def __init__(self, module, recorder):
        super().__init__(module)
        self.recorder = recorder

    def run_node(self, n):
        self.recorder.step += 1
        return super().run_node(n)


def _tensor_items(value, path: tuple):
    """(path of indices, tensor) for each tensor inside nested tuples and lists."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _tensor_items(item, path + (index,))
