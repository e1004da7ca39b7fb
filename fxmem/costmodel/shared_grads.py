"""Gradients that are one buffer in the static backward walk: add hands its output's gradient to both inputs as it
is, and a chain of adds (Python's `sum` of a list of tensors) hands that one buffer on to every tensor it adds. The
walk counts the buffer's bytes under one member's key; when that member's gradient goes while others still hold
the buffer, the bytes pass to one of them (`leave`)."""
from __future__ import annotations


class SharedGrads:
    """Groups of storage keys whose gradients are one buffer, and the buffer's bytes."""

    def __init__(self):
        self.group_of: dict[int, int] = {}  # key -> its group's id
        self.members: dict[int, set[int]] = {}  # group id -> keys whose gradient is the buffer
        self.nbytes: dict[int, int] = {}  # group id -> the buffer's bytes

    def size(self, key: int) -> int | None:
        """The bytes of the buffer `key`'s gradient shares, or None where it shares none."""
        group = self.group_of.get(key)
        return None if group is None else self.nbytes[group]

    def share(self, holder: int, key: int, nbytes: int) -> None:
        """`key`'s gradient is the buffer `holder`'s is (`nbytes`, where `holder` shares none yet)."""
        group = self.group_of.get(holder)
        if group is None:
            group = self.group_of[holder] = holder
            self.members[group] = {holder}
            self.nbytes[group] = nbytes
        self.members[group].add(key)
        self.group_of[key] = group

    def replace(self, old: int, new: int) -> None:
        """`new`'s gradient is the one `old` had (handed on): it takes `old`'s place in its group."""
        group = self.group_of.pop(old, None)
        if group is None:
            return
        self.members[group].discard(old)
        self.members[group].add(new)
        self.group_of[new] = group

    def leave(self, key: int) -> int | None:
        """`key`'s gradient goes: a member still holding the buffer, or None where none does."""
        group = self.group_of.pop(key, None)
        if group is None:
            return None
        members = self.members[group]
        members.discard(key)
        if not members:
            del self.members[group], self.nbytes[group]
            return None
        if len(members) == 1:  # a buffer one gradient holds is that gradient's own
            (heir,) = members
            del self.members[group], self.nbytes[group], self.group_of[heir]
            return heir
        return min(members)
