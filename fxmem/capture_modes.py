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
    for i, a in enumerate(op._schema.arguments):
        if a.name in _FLAG_ARG_NAMES:
            return i
    return None


def _mode_ops() -> tuple[dict, dict]:
    args, stats = {}, {}
    for name in _MODE_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            arg_names = [a.name for a in op._schema.arguments]
            if "out" in ov:
                continue  # out= variants: export never emits them
            if ("norm" in name) != ("running_mean" in arg_names):
                continue  # a norm without running statistics (_native_batch_norm_legit.no_stats): batch stats only
            i = _flag_index(op)
            if i is not None:
                args[op] = i
                if "running_mean" in arg_names:
                    stats[op] = arg_names.index("running_mean")
    return args, stats


# op -> position of its train flag (dropout*, batch/instance norm, rrelu*, lstm/gru/rnn)
# op -> position of running_mean: a norm without running stats (track_running_stats=False) uses batch statistics
# in eval too, so its flag is left alone
MODE_ARGS, _STATS_ARG = _mode_ops()


def make_mode_switchable(gm: torch.fx.GraphModule, training: bool) -> None:
    """Route literal train flags of dropout/batch-norm (every op in MODE_ARGS) that hold the capture mode
    (`training`) to the module's `training` flag. A flag holding the other value stays literal: it comes from a
    submodule the user left in the other mode (a batch norm frozen in eval inside a training model), which
    `model.train()` / `model.eval()` of the whole model never reached either."""
    users = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in MODE_ARGS
             and _has_running_stats(n) and _captured_flag(n) is training]
    bn_counters = [n for n in gm.graph.nodes
                   if training and n.op == "call_function" and n.target == torch.ops.aten.add_.Tensor
                   and n.args[0].op == "get_attr" and str(n.args[0].target).endswith("num_batches_tracked")]
    if not users and not bn_counters:
        return
    gm.add_submodule("mode", ModeFlag())
    guard = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "input_guard")
    with gm.graph.inserting_after(guard):
        flag = gm.graph.call_module("mode", ())
        flag.meta["fxmem_mode_flag"] = True
    for n in users:
        _set_flag_arg(n, MODE_ARGS[n.target], flag)
    counted = {str(n.args[0].target) for n in bn_counters}
    for n in bn_counters:
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(count_batch, (n.args[0], flag))
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    _count_eval_batch_norms(gm, flag, counted, routed=set(users))


def _count_eval_batch_norms(gm: torch.fx.GraphModule, flag: torch.fx.Node, counted: set[str],
                            routed: set[torch.fx.Node]) -> None:
    """A batch norm captured in eval mode has no `num_batches_tracked += 1` (nn.BatchNorm adds it in training
    only): give it the counter, so `.train()` counts batches as the model does. Only batch norms whose train flag
    follows the mode (`routed`): one the user froze in eval keeps its literal flag and counts nothing."""
    attrs = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    for n in list(gm.graph.nodes):
        if n not in routed or n.target not in _STATS_ARG or "batch_norm" not in n.target.name():
            continue
        stats = n.args[_STATS_ARG[n.target]] if _STATS_ARG[n.target] < len(n.args) else None
        if not isinstance(stats, torch.fx.Node) or stats.op != "get_attr" or \
                not str(stats.target).endswith("running_mean"):
            continue
        counter = str(stats.target)[:-len("running_mean")] + "num_batches_tracked"
        try:
            if counter in counted or not isinstance(tensor_at(gm, counter), torch.Tensor):
                continue
        except AttributeError:
            continue  # no counter (a batch norm without num_batches_tracked)
        counted.add(counter)
        with gm.graph.inserting_before(n):
            if counter not in attrs:
                attrs[counter] = gm.graph.get_attr(counter)
            gm.graph.call_function(count_batch, (attrs[counter], flag)).meta.update(n.meta)


def _has_running_stats(n: torch.fx.Node) -> bool:
    i = _STATS_ARG.get(n.target)
    if i is None:
        return True
    name = n.target._schema.arguments[i].name
    v = n.args[i] if i < len(n.args) else n.kwargs.get(name)
    return v is not None


def _captured_flag(n: torch.fx.Node):
    """The train flag export wrote for `n` (the schema's default where it left the flag out)."""
    i = MODE_ARGS[n.target]
    arg = n.target._schema.arguments[i]
    if i < len(n.args):
        return n.args[i]
    if arg.name in n.kwargs:
        return n.kwargs[arg.name]
    return arg.default_value if arg.has_default_value() else None


def _set_flag_arg(n: torch.fx.Node, i: int, flag: torch.fx.Node) -> None:
    """Set argument i (the train flag) of n to `flag`, positionally or by keyword as export wrote it. An eval
    capture may omit a flag whose default is False (rrelu): the missing positions are filled with the defaults."""
    schema = n.target._schema.arguments
    name = schema[i].name
    a = list(n.args)
    if i < len(a):
        if isinstance(a[i], bool):
            a[i] = flag
            n.args = tuple(a)
    elif name in n.kwargs:
        if isinstance(n.kwargs[name], bool):
            n.kwargs = {**n.kwargs, name: flag}
    else:
        fill = []
        for j in range(len(a), i):
            if schema[j].name in n.kwargs or not schema[j].has_default_value():
                n.kwargs = {**n.kwargs, name: flag}  # keep what export wrote; the flag goes by keyword
                return
            fill.append(schema[j].default_value)
        n.args = tuple(a + fill + [flag])
