"""Export writes the train flag of dropout, batch norm and the other mode-dependent ops as a literal: route each
flag that holds the capture mode to the module's own `training` flag, so `.train()` / `.eval()` work on the
captured GraphModule (`fxmem.nn.modes`)."""
from __future__ import annotations

import torch

from .nn.modes import ModeFlag, count_batch, tensor_at

# Ops whose train flag export bakes in as a literal. nn modules pass `self.training` to every one of them
# (Dropout/Dropout1d-3d/AlphaDropout/FeatureAlphaDropout, inplace or not, BatchNorm*/SyncBatchNorm, InstanceNorm*
# with running stats, RReLU, LSTM/GRU/RNN inter-layer dropout); the flag's position is read from the op schema.
_MODE_OP_NAMES = (
    "dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout",
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "instance_norm",
    "rrelu", "rrelu_", "rrelu_with_noise", "rrelu_with_noise_",
    "lstm", "gru", "rnn_tanh", "rnn_relu",
)
_FLAG_ARG_NAMES = ("train", "training", "use_input_stats")


def _flag_index(op) -> int | None:
    for index, argument in enumerate(op._schema.arguments):
        if argument.name in _FLAG_ARG_NAMES:
            return index
    return None


def _mode_ops() -> tuple[dict, dict]:
    args, stats = {}, {}
    for name in _MODE_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            arg_names = [a.name for a in op._schema.arguments]
            if "out" in overload:
                continue  # out= variants: export never emits them
            if ("norm" in name) != ("running_mean" in arg_names):
                continue  # a norm without running statistics (_native_batch_norm_legit.no_stats): batch stats only
            flag_position = _flag_index(op)
            if flag_position is not None:
                args[op] = flag_position
                if "running_mean" in arg_names:
                    stats[op] = arg_names.index("running_mean")
    return args, stats


# op -> position of its train flag (dropout*, batch/instance norm, rrelu*, lstm/gru/rnn)
# op -> position of running_mean: a norm without running stats (track_running_stats=False) uses batch statistics
# in eval too, so its flag is left alone
MODE_ARGS, _STATS_ARG = _mode_ops()


def make_mode_switchable(graph_module: torch.fx.GraphModule, training: bool) -> None:
    """Route literal train flags of dropout/batch-norm (every op in MODE_ARGS) that hold the capture mode
    (`training`) to the module's `training` flag. A flag holding the other value stays literal: it comes from a
    submodule the user left in the other mode (a batch norm frozen in eval inside a training model), which
    `model.train()` / `model.eval()` of the whole model never reached either."""
    users = [node for node in graph_module.graph.nodes if node.op == "call_function" and node.target in MODE_ARGS
             and _has_running_stats(node) and _captured_flag(node) is training]
    bn_counters = [node for node in graph_module.graph.nodes
                   if training and node.op == "call_function" and node.target == torch.ops.aten.add_.Tensor
                   and node.args[0].op == "get_attr" and str(node.args[0].target).endswith("num_batches_tracked")]
    if not users and not bn_counters:
        return
    graph_module.add_submodule("mode", ModeFlag())
    guard = next(node for node in graph_module.graph.nodes if node.op == "call_module" and node.target == "input_guard")
    with graph_module.graph.inserting_after(guard):
        flag = graph_module.graph.call_module("mode", ())
        flag.meta["fxmem_mode_flag"] = True
    for node in users:
        _set_flag_arg(node, MODE_ARGS[node.target], flag)
    counted = {str(node.args[0].target) for node in bn_counters}
    for node in bn_counters:
        with graph_module.graph.inserting_before(node):
            new = graph_module.graph.call_function(count_batch, (node.args[0], flag))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph_module.graph.erase_node(node)
    _count_eval_batch_norms(graph_module, flag, counted, routed=set(users))


def _count_eval_batch_norms(graph_module: torch.fx.GraphModule, flag: torch.fx.Node, counted: set[str],
                            routed: set[torch.fx.Node]) -> None:
    """A batch norm captured in eval mode has no `num_batches_tracked += 1` (nn.BatchNorm adds it in training
    only): give it the counter, so `.train()` counts batches as the model does. Only batch norms whose train flag
    follows the mode (`routed`): one the user froze in eval keeps its literal flag and counts nothing."""
    attrs = {str(node.target): node for node in graph_module.graph.nodes if node.op == "get_attr"}
    for node in list(graph_module.graph.nodes):
        if node not in routed or node.target not in _STATS_ARG or "batch_norm" not in node.target.name():
            continue
        stats = node.args[_STATS_ARG[node.target]] if _STATS_ARG[node.target] < len(node.args) else None
        if not isinstance(stats, torch.fx.Node) or stats.op != "get_attr" or \
                not str(stats.target).endswith("running_mean"):
            continue
        counter = str(stats.target)[:-len("running_mean")] + "num_batches_tracked"
        try:
            if counter in counted or not isinstance(tensor_at(graph_module, counter), torch.Tensor):
                continue
        except AttributeError:
            continue  # no counter (a batch norm without num_batches_tracked)
        counted.add(counter)
        with graph_module.graph.inserting_before(node):
            if counter not in attrs:
                attrs[counter] = graph_module.graph.get_attr(counter)
            graph_module.graph.call_function(count_batch, (attrs[counter], flag)).meta.update(node.meta)


def _has_running_stats(node: torch.fx.Node) -> bool:
    stats_position = _STATS_ARG.get(node.target)
    if stats_position is None:
        return True
    name = node.target._schema.arguments[stats_position].name
    value = node.args[stats_position] if stats_position < len(node.args) else node.kwargs.get(name)
    return value is not None


def _captured_flag(node: torch.fx.Node):
    """The train flag export wrote for `node` (the schema's default where it left the flag out)."""
    flag_position = MODE_ARGS[node.target]
    arg = node.target._schema.arguments[flag_position]
    if flag_position < len(node.args):
        return node.args[flag_position]
    if arg.name in node.kwargs:
        return node.kwargs[arg.name]
    return arg.default_value if arg.has_default_value() else None


def _set_flag_arg(node: torch.fx.Node, flag_position: int, flag: torch.fx.Node) -> None:
    """Set argument `flag_position` (the train flag) of `node` to `flag`, positionally or by keyword as export
    wrote it. An eval capture may omit a flag whose default is False (rrelu): the missing positions are filled with
    the defaults."""
    schema = node.target._schema.arguments
    name = schema[flag_position].name
    args = list(node.args)
    if flag_position < len(args):
        if isinstance(args[flag_position], bool):
            args[flag_position] = flag
            node.args = tuple(args)
    elif name in node.kwargs:
        if isinstance(node.kwargs[name], bool):
            node.kwargs = {**node.kwargs, name: flag}
    else:
        fill = []
        for position in range(len(args), flag_position):
            if schema[position].name in node.kwargs or not schema[position].has_default_value():
                node.kwargs = {**node.kwargs, name: flag}  # keep what export wrote; the flag goes by keyword
                return
            fill.append(schema[position].default_value)
        node.args = tuple(args + fill + [flag])
