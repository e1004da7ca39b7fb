"""Frozen weights streamed from a slow tier: `WeightStreamer` keeps blocks' weights on CPU or in a scratch
safetensors file and loads each block just before it runs, the next one ahead."""
from __future__ import annotations

import os
import tempfile
import weakref
from concurrent.futures import Future

import torch
from torch import nn

from .scratch import SCRATCH_PREFIX, TIERS, cleanup_files, executor


class WeightStreamer(nn.Module):
    """Frozen weights of blocks kept on a slow tier; `streamer(i)` returns block i's weights, loaded just in time.

        ws = WeightStreamer({"teacher.convs.0": [("teacher.convs.0.lin.weight", w), ...], ...}, tier="disk")
        w0, b0 = ws(0)      # block 0's tensors (fresh tensors on `device`); starts loading block 1 (prefetch)

    The graph calls `ws(i)` right before block i's first use and reads the tensors with getitem; they are freed
    after their last use, like any intermediate value. Tiers: "disk" — one safetensors file in a scratch
    directory of our own, opened memory-mapped, copied into fresh tensors when fetched; "cpu" — host tensors
    (pinned when CUDA is available) copied to `device`. Prefetch: fetching block i allocates block i+1 ..
    i+prefetch (on the calling thread, so fxmem.measure counts them) and fills them on a background thread.

    Only frozen tensors (requires_grad False: a distillation teacher, or any weight at inference) are accepted:
    the fetched copies do not carry gradients. Under FakeTensorMode (the cost model, shape propagation) the
    call returns empty tensors of the right shapes, so the static estimate sees each block's weights created at
    its fetch (and the next block's at the same point, for the prefetch) and freed after their last use.
    `state_dict_entries()` gives the original names and values (used by the owning module's state_dict hook).
    """

    def __init__(self, blocks: dict[str, list[tuple[str, torch.Tensor]]], tier: str = "disk", prefetch: int = 1,
                 device: torch.device | str | None = None, scratch_root: str | None = None, unlink_early: bool = True):
        super().__init__()
        # disk: the scratch file is removed as soon as it is mapped (the mapping keeps the data), so no copy of the
        # weights is left on disk, even after a hard exit; False keeps it visible until the streamer goes
        self.unlink_early = bool(unlink_early)
        if tier not in TIERS:
            raise ValueError(f"weight offload tier must be one of {TIERS}, got {tier!r}")
        self.tier, self.prefetch = tier, int(prefetch)
        self.names = list(blocks)
        self.spec: list[list[tuple[str, tuple, torch.dtype]]] = []
        flat: dict[str, torch.Tensor] = {}
        for bname in self.names:
            row = []
            for param_name, tensor in blocks[bname]:
                if tensor.requires_grad:
                    raise ValueError(f"weight offload: parameter {param_name!r} of block {bname!r} requires grad; only "
                                     f"frozen (requires_grad=False) or inference-time weights can be streamed")
                row.append((param_name, tuple(tensor.shape), tensor.dtype))
                flat[param_name] = tensor.detach()
            self.spec.append(row)
        first = next(iter(flat.values()), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None
                                                                         else torch.device("cpu"))
        self.bytes_offloaded = sum(tensor.numel() * tensor.element_size() for tensor in flat.values())
        self.scratch_root = scratch_root
        self._dir: str | None = None
        self._path: str | None = None
        self._file = None
        self._host: dict[str, torch.Tensor] = {}
        self._pending: dict[int, tuple[list, Future | None]] = {}
        self._fake_next: dict[int, tuple] = {}
        self._finalizer = None
        self._stash(flat)

    def _stash(self, flat: dict[str, torch.Tensor]) -> None:
        if self.tier == "disk":
            from safetensors.torch import save_file
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix=SCRATCH_PREFIX + "weights-", dir=self.scratch_root)
                self._path = os.path.join(self._dir, "weights.safetensors")
                self._finalizer = weakref.finalize(self, cleanup_files, [None], self._path, self._dir)
            self._file = None
            save_file({name: tensor.detach().cpu().contiguous() for name, tensor in flat.items()}, self._path)
            self._open()
            if self.unlink_early:
                try:
                    os.unlink(self._path)
                    os.rmdir(self._dir)
                    self._dir = None  # (a later stash, load_state_dict's, makes a new one and unlinks it again)
                except OSError:  # platforms that cannot unlink a mapped file: removed when the streamer goes
                    pass
        else:
            pin = torch.cuda.is_available()
            for name, tensor in flat.items():
                host_copy = tensor.detach().to("cpu", copy=True)
                self._host[name] = host_copy.pin_memory() if pin else host_copy

    def _open(self):
        from safetensors import safe_open
        self._file = safe_open(self._path, framework="pt", device="cpu")  # memory-mapped

    def __deepcopy__(self, memo):
        vals = self.state_dict_entries()
        blocks = {b: [(qn, vals[qn]) for qn, _, _ in row] for b, row in zip(self.names, self.spec)}
        new = WeightStreamer(blocks, tier=self.tier, prefetch=self.prefetch, device=self.device,
                             scratch_root=self.scratch_root, unlink_early=self.unlink_early)
        new.train(self.training)
        memo[id(self)] = new
        return new

    def __getstate__(self):
        raise TypeError("a WeightStreamer (fxmem weight offload) cannot be pickled: its weights live in a scratch "
                        "file; save the model's state_dict instead")

    def _source(self, name: str) -> torch.Tensor:
        return self._file.get_tensor(name) if self.tier == "disk" else self._host[name]

    def _alloc(self, block: int) -> list:
        return [torch.empty(shape, dtype=dt, device=self.device) for _, shape, dt in self.spec[block]]

    def _fill(self, block: int, dst: list) -> list:
        with torch.no_grad():
            for (name, _, _), target in zip(self.spec[block], dst):
                target.copy_(self._source(name), non_blocking=self.device.type == "cuda")
        return dst

    def _fill_from_box(self, block: int, box: list) -> None:
        """`_fill` on the I/O thread, which then holds nothing of block i's tensors (its executor keeps a task's
        arguments until after the result is set: the block would outlive its last use while that thread waits)."""
        self._fill(block, box.pop())

    def fetch(self, block: int) -> tuple:
        if not 0 <= block < len(self.spec):
            raise IndexError(f"WeightStreamer: block {block} out of range (have {len(self.spec)})")
        got = self._pending.pop(block, None)
        if got is None:
            out = self._fill(block, self._alloc(block))
        else:
            out, fut = got
            if fut is not None:
                fut.result()
        for ahead in range(block + 1, min(len(self.spec), block + 1 + self.prefetch)):
            if ahead not in self._pending:
                dst = self._alloc(ahead)  # allocated here, on the calling thread: counted by fxmem.measure
                self._pending[ahead] = (dst, executor("weights").submit(self._fill_from_box, ahead, [dst]))
        if block == 0:
            # a new step: drop prefetches the last step left behind for blocks before this one
            pass
        return tuple(out)

    def forward(self, block: int) -> tuple:
        from torch._guards import detect_fake_mode
        if detect_fake_mode() is not None or torch.compiler.is_compiling():
            if block == 0:
                self._fake_next.clear()
            out = self._fake_next.pop(block, None) or tuple(self._alloc(block))
            for ahead in range(block + 1, min(len(self.spec), block + 1 + self.prefetch)):
                if ahead not in self._fake_next:
                    self._fake_next[ahead] = tuple(self._alloc(ahead))
            if block == len(self.spec) - 1:
                self._fake_next.clear()
            return out
        return self.fetch(block)

    def state_dict_entries(self) -> dict[str, torch.Tensor]:
        return {qn: self._source(qn).clone() for row in self.spec for qn, _, _ in row}

    def update(self, values: dict[str, torch.Tensor]) -> None:
        """Replace stored weights (load_state_dict)."""
        known = {qn: (shape, dt) for row in self.spec for qn, shape, dt in row}
        for name, value in values.items():
            if name not in known:
                raise KeyError(f"WeightStreamer: no streamed weight named {name!r}")
            if tuple(value.shape) != known[name][0]:
                raise ValueError(f"WeightStreamer: {name!r} has shape {tuple(value.shape)}, expected {known[name][0]}")
        flat = {qn: (values[qn] if qn in values else self._source(qn)).detach().to(known[qn][1]).cpu().clone()
                for qn in known}
        self._pending.clear()
        self._stash(flat)

    def install_state_dict_hooks(self, owner: nn.Module, attr: str) -> None:
        """Make `owner.state_dict()` / `load_state_dict()` see the streamed weights under their original names."""
        # the hooks find the streamer by attribute on the module they run for, so deep copies use their own
        def save_hook(module, state_dict, prefix, local_metadata):
            streamer = getattr(module, attr, None)
            if isinstance(streamer, WeightStreamer):
                for name, value in streamer.state_dict_entries().items():
                    state_dict[prefix + name] = value
            return state_dict

        def load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs):
            streamer = getattr(module, attr, None)
            if not isinstance(streamer, WeightStreamer):
                return
            names = [qn for row in streamer.spec for qn, _, _ in row]
            vals = {qn: state_dict.pop(prefix + qn) for qn in names if prefix + qn in state_dict}
            if vals:
                streamer.update(vals)
            if strict:
                missing_keys.extend(prefix + qn for qn in names if qn not in vals)

        owner._register_state_dict_hook(save_hook)
        owner._register_load_state_dict_pre_hook(load_hook, with_module=True)

    def close(self) -> None:
        self._file = None
        self._pending.clear()
        if self._finalizer is not None:
            self._finalizer()

    def extra_repr(self) -> str:
        return f"tier={self.tier!r}, blocks={self.names}, prefetch={self.prefetch}"
