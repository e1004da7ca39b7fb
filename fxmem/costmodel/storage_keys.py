"""The keys a forward trace names storages by, and when the traced code let each storage go.

The trace keeps no storage alive: one is freed when the code it runs drops its last reference, as in the real run,
and the last op recorded before that is noted (`released`). That is when a value really dies: a composite op (the
CPU `aten.gru.input`, `aten.lstm.input`) holds temporaries it made itself (its input projection, its per-step
outputs) until it returns, long after their last use. A storage made later at a freed one's address gets a key of
its own.
"""
from __future__ import annotations

import weakref
from typing import Callable


class StorageKeys:
    """Storage -> key while the storage lives (its `_cdata`, or a key of its own when that address was used by a
    storage freed before); `released`: key -> index of the last record made before its storage was freed, noted
    until `stop`. `clock()` gives that index."""

    def __init__(self, clock: Callable[[], int]):
        self.clock = clock
        self.released: dict[int, int] = {}
        self._live: dict[int, int] = {}  # _cdata of a live storage -> its key
        self._seen: set[int] = set()  # every _cdata met
        self._address: dict[int, int] = {}  # key of its own -> the storage's _cdata
        self._next_own = -1
        self._finalizers: list[weakref.finalize] = []
        self._watching = True

    def key(self, storage) -> tuple[int, bool]:
        """(the storage's key, whether it is met for the first time)."""
        address = storage._cdata
        key = self._live.get(address)
        if key is not None:
            return key, False
        if address in self._seen:
            key, self._next_own = self._next_own, self._next_own - 1
            self._address[key] = address
        else:
            key = address
            self._seen.add(address)
        self._live[address] = key
        if self._watching:
            self._finalizers.append(weakref.finalize(storage, self._release, address, key))
        return key, True

    def known(self, storage) -> int | None:
        """The key of `storage` if it was met and lives, else None (nothing recorded)."""
        return self._live.get(storage._cdata)

    def alias(self, storage, key: int) -> None:
        """`storage` is the one under `key` (a real parameter, whose fake holds `key`): a composite op such as
        `aten.rnn_tanh_cell` dispatches a view of the real one before the fake mode converts it."""
        self._live[storage._cdata] = key

    def address(self, key: int) -> int:
        """The `_cdata` of the storage under `key` (what fxmem.nn.recast looks recipes up by)."""
        return self._address.get(key, key)

    def _release(self, address: int, key: int) -> None:
        if self._live.get(address) == key:
            del self._live[address]
        if self._watching:
            self.released[key] = self.clock()

    def stop(self) -> None:
        """The trace is over: what dies from here (its outputs, what autograd saved) is not noted."""
        self._watching = False
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
