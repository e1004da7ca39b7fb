"""Who holds what, until when, over a forward trace: the facts the static walk and the recompute walks share.

`SavePlan` says, for one trace, until which op's backward each saved tensor lives, what each recompute region
recomputes and holds while it does, what offload regions move off the device, and when recipes (fxmem.nn.recast)
are made again. `TraceLiveness` answers when a value dies in forward and what a recomputation holds at its highest.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..nn.regions import region_info
from ..program import Program
from .offload_times import OffloadTimes
from ..nn.dropout import DRAW_OPS
from .recipe_closure import recipe_high
from .trace import ForwardTrace


def creators(records: list) -> dict[int, int]:
    """Storage key -> index of the record that created it."""
    return {key: record.idx for record in records for key in record.new_keys}


def step_ends(records: list) -> dict[int, int]:
    """Graph node (step) -> index of the last op record it issued."""
    return {record.step: record.idx for record in records}


def first_unpack(records: list, first: int, last: int) -> int:
    """The record among first..last (a recompute region) whose backward runs the recomputation: non-reentrant checkpoint
    recomputes at the first unpack of anything the region saved (parameters too), in the backward of its last op
    that saves; the ops after it save nothing, their backward runs before (last when none saves)."""
    return max((record.idx for record in records[first:last + 1] if record.out_rg and record.saved), default=last)


def recomputed(record, stop: int) -> bool:
    """Whether the op of `record` runs again in its region's recomputation, which stops at record `stop` (the last
    op that saves): non-reentrant checkpoint stops once the last saved tensor is packed, and autograd packs an op's
    saved inputs before the op runs, its saved outputs after (an addmm last runs no more, a relu last does)."""
    return record.idx < stop or record.idx == stop and any(key in record.out_keys for key in record.saved)


def off_loss_path(records: list, loss_key: int | None) -> set[int]:
    """Records with a backward that the loss does not reach: `loss.backward()` never runs them (an auxiliary head
    whose output the loss ignores). Found backwards from the loss's storage through the storages ops read; storages
    (not tensor versions) make it a superset of the true path, which errs towards running a backward."""
    if loss_key is None:
        return set()
    needed = {loss_key}
    off: set[int] = set()
    for record in reversed(records):
        if not record.out_rg:
            continue
        if any(key is not None and key in needed for key in record.out_keys):
            needed.update(key for key, rg in zip(record.in_keys, record.in_rg) if rg and key is not None)
            needed.update(record.list_keys)
        else:
            off.add(record.idx)
    return off


def seed_gradient(records: list, loss_key: int | None) -> tuple[int | None, int]:
    """(the loss's storage, bytes of the gradient `loss.backward()` seeds it with): `torch.autograd.backward` makes
    it (ones_like) and holds it in its frame until the whole backward has run; views of it (a sum's expanded
    gradient) add nothing."""
    made = next((nbytes for record in reversed(records) for key, nbytes in zip(record.out_keys, record.out_bytes)
                 if key == loss_key), 0)
    return (loss_key, made) if loss_key is not None else (None, 0)


@dataclass
class TraceLiveness:
    """The facts of one trace every liveness walk reads: its records, storage bytes, the storages that exist
    before the step (`base_keys`), per graph node its last record (`step_end`), per storage the last record
    reading or making it (`last_use`), and the record after which the traced code freed it (`released`: not for
    what autograd held to the trace's end)."""
    records: list
    storage_bytes: dict
    base_keys: dict
    step_end: dict
    last_use: dict
    released: dict

    @classmethod
    def of(cls, traced: ForwardTrace) -> "TraceLiveness":
        recorder = traced.recorder
        records = recorder.records
        last_use = {key: record.idx for record in records for key in record.in_keys + record.out_keys
                    + record.list_keys if key is not None}
        # (the recorder keeps every recipe it met, and the tensors those hold, longer than the step does)
        held = {key for keys in recorder.recipe_holds.values() for key in keys}
        released = {key: at for key, at in recorder.storages.released.items() if key not in held}
        return cls(records, recorder.storage_bytes, traced.base_keys, step_ends(records), last_use, released)

    def dies_at(self, key: int, last: int, made: int) -> int:
        """The record after which storage `key`, made at record `made` and last used at record `last`, is freed
        when nothing saves it: where the trace freed it (a composite op holds what it made until it returns);
        else (autograd saved it in the trace, what a plan may not: a recomputed region's) a value an earlier node
        made is referenced by the graph until the node using it last returns, and a temporary a node makes itself
        dies at its last use."""
        if key in self.released:
            return max(self.released[key], last)
        if self.records[made].step == self.records[last].step:
            return last
        return self.step_end.get(self.records[last].step, last)

    def recompute_high(self, first: int, last: int, keeps, saved: dict, made_again: dict) -> int:
        """The most bytes a recompute region's recomputation (records first..last run again in backward) holds at once.

        It makes each op's new storages again, except the outputs of ops the region keeps (`keeps.keeps(func)`:
        cached or held since the forward); what no op in it saves is dropped after its last use there, what one
        saves (`saved`) stays for the backward. Region inputs made again (`made_again`, recipes) are held while it
        runs. Non-reentrant checkpoint stops the recomputation once the last saved tensor is packed (early stop),
        so ops after the last saving op do not run, nor that op when it saves only its inputs (`recomputed`). The
        body runs as graph code: a value is dropped as `dies_at` says, and one the body uses after the stop (the
        region's output, the residual of an add after it) stays until the stop, as the body's frame holds it."""
        records, storage_bytes = self.records, self.storage_bytes
        stop = first_unpack(records, first, last)
        drop_at: dict[int, list[int]] = defaultdict(list)
        made_here = {key for record in records[first:stop + 1] for key in record.new_keys}
        # inputs made again
        live = sum(made_again.values()) + sum(storage_bytes[key] for key in saved if key not in made_here)
        high = live
        for record in records[first:stop + 1]:
            if not keeps.keeps(record.func) and recomputed(record, stop):
                for key in record.new_keys:
                    if self.base_keys.get(key) is None:
                        live += storage_bytes[key]
                        if key not in saved:
                            dies = self.dies_at(key, self.last_use.get(key, record.idx), record.idx)
                            drop_at[min(stop, dies)].append(key)
            high = max(high, live)
            for key in drop_at.pop(record.idx, ()):
                live -= storage_bytes[key]
        return high


def shared_spans(records: list, shared: set, nesting: dict, created_in: dict, groups: dict,
                 members: dict) -> dict[int, tuple[int, int]]:
    """Shared recipe output -> (lowest, highest) record index of its uses in backward, which runs from high to
    low: made at the highest, held until the lowest. A use is a save of it outside regions (an unpack), or a
    recomputation of a recipe holding it nested through its shared value; a group's output (a pick of one shared
    run) nested either way, since recomputing the pick makes the group's run. A recipe is recomputed at each of its
    unpacks and at each recomputation of a recipe holding it otherwise (nested, made again with it); a shared one
    once for its uses, at the first. Outputs of one shared run (`groups`) are made together and held together,
    from the first use of any to the last (`members`: group -> its outputs). A region's input saved as a recipe is
    made again for the region alone."""
    unpacks: dict[int, list[int]] = defaultdict(list)
    for record in records:
        for key in record.recast:
            unpacks[key].append(record.idx)
    made: dict[int, list[int]] = {}  # recipe output -> record indices where backward recomputes it
    spans: dict[int, tuple[int, int]] = {}

    def uses_of(key: int) -> tuple[list[int], list[int]]:
        uses = list(unpacks.get(key, ()))
        private: list[int] = []
        for holder, through_shared in nesting.get(key, {}).items():
            (uses if (through_shared or key in groups) and key in shared else private).extend(made.get(holder, ()))
        return uses, private
    # holders were created after what they hold: latest first, a holder's recomputations are known before
    for key in sorted(set(unpacks) | set(nesting) | set(groups), key=lambda k: -created_in.get(k, -1)):
        if key in made:
            continue  # (a group member, done with the group)
        group = members[groups[key]] if key in groups else [key]
        both = [uses_of(member) for member in group]
        uses = [i for used, _ in both for i in used]
        for member, (_, private) in zip(group, both):
            if member in shared and uses:
                spans[member] = (min(uses), max(uses))
                made[member] = [max(uses)] + private
            else:
                made[member] = uses + private
    return spans


class SavePlan:
    """Who saves what, until when, in one trace of `program`.

    saved_until: storage -> the record whose backward frees it (its earliest saver, or the region holding it);
    recompute_bytes / recompute_keys: per recompute region, what its recomputation leaves for the backward (bytes;
    storage -> the record whose backward frees it); recompute_over: what it holds above that while it runs;
    offloaded: per offload region, the storages off the device from its end until its backward; recast_at: bytes a
    record's backward makes again (parameter casts, unshared recipes); held_from / held_until: shared recipes, made
    at one record's backward and freed at another's."""

    def __init__(self, program: Program, traced: ForwardTrace):
        self.liveness = TraceLiveness.of(traced)
        self.recorder = traced.recorder
        self.records = records = traced.recorder.records
        self.storage_bytes = traced.recorder.storage_bytes
        self.base_keys, self.out_keys = traced.base_keys, traced.out_keys
        self.regions, self.region_first, self.region_last = _region_spans(program, records)
        self.created_in = creators(records)
        self.recast_at: dict[int, int] = defaultdict(int)
        self.held_from: dict[int, int] = defaultdict(int)
        self.held_until: dict[int, int] = defaultdict(int)
        self.group_members: dict[int, list[int]] = defaultdict(list)  # a group of one shared run -> its outputs
        self._plan_recipes()
        self.last_use = self.liveness.last_use
        self.saved_until: dict[int, int] = {}  # key -> record index whose backward frees it (the earliest saver)
        self.recompute_bytes: dict[str, int] = defaultdict(int)  # region -> bytes recomputed at its backward
        self.recompute_keys: dict[str, dict[int, int]] = defaultdict(dict)  # region -> {key: earliest saver}
        # region -> {key: bytes} live while it reruns
        self.recompute_transient: dict[str, dict[int, int]] = defaultdict(dict)
        self.offloaded: dict[str, set] = defaultdict(set)
        self.recipe_holds = {key: held for key, held in self.recorder.recipe_holds.items()
                             if self.base_keys.get(key) is None}
        self._plan_saves()
        self._plan_selective_caches()
        self._plan_region_inputs()
        self.recompute_over = self._recompute_overs()
        self.offload_times = OffloadTimes(self)

    def _plan_recipes(self) -> None:
        """Parameter casts and recipes under fxmem.nn.recast are not saved: backward casts the parameter again or
        recomputes the recipe, a transient of the op's backward; a shared recipe is made once, at its first use in
        backward, and held until its last (uses: its saves, and recomputations of recipes using it nested)."""
        recorder, storage_bytes = self.recorder, self.storage_bytes
        for record in self.records:
            for key in record.recast:
                if key not in recorder.recipe_shared:
                    self.recast_at[record.idx] += storage_bytes[key]
        for key, group in recorder.recipe_group.items():
            self.group_members[group].append(key)
        spans = shared_spans(self.records, recorder.recipe_shared, recorder.nesting(), self.created_in,
                             recorder.recipe_group, self.group_members)
        for key, (first, last) in spans.items():
            self.held_from[last] += storage_bytes[key]
            self.held_until[first] += storage_bytes[key]

    def _plan_saves(self) -> None:
        """Each saved tensor: until its earliest saver's backward, recomputed by its recompute region, held by
        a region keeping its producer, or moved off the device by its offload region."""
        records, created_in, region_first = self.records, self.created_in, self.region_first
        for record in records:
            if not record.out_rg:
                continue
            info = self.regions.get(record.region) if record.region else None
            recomputing = info is not None and info.kind == "recompute"
            for key in record.saved:
                if self.base_keys.get(key) in ("param", "buffer", "input"):
                    continue
                inside = info is not None and created_in.get(key, -1) >= region_first[record.region]
                if recomputing and not inside and key in self.recipe_holds:
                    continue  # a recipe's output entering the region: made again for the recomputation (below)
                # selective regions keep the outputs of their keep ops (what SAC caches), whoever saves them; what
                # an op keeps on its autograd context (`OpRecord.held`) no saved-tensor hook sees: the region's
                # forward keeps it as the op does anywhere
                producer = records[created_in[key]].func if key in created_in else record.func
                if recomputing and inside and not info.keeps(producer) and key not in record.held:
                    recomputed = self.recompute_keys[record.region]
                    if key not in recomputed:
                        self.recompute_bytes[record.region] += self.storage_bytes[key]  # once per tensor
                    recomputed[key] = min(recomputed.get(key, record.idx), record.idx)
                    continue
                if recomputing and inside and info.holds(producer):
                    self.saved_until[key] = region_first[record.region]  # held until the region's backward is done
                    continue
                if info is not None and info.kind == "offload" and inside:
                    self.offloaded[record.region].add(key)
                first = self.saved_until.get(key)
                self.saved_until[key] = record.idx if first is None else min(first, record.idx)

    def _plan_selective_caches(self) -> None:
        """Selective regions cache every output of their keep ops, saved or not, until the recomputation takes it
        from the cache (at the region's first unpack); what keep ops the recomputation never runs cached stays in
        the cache until the region's backward is done, as outputs the region holds (a draw tape's masks) do;
        whoever else saves it (an op after the region) may hold it longer."""
        for name, info in self.regions.items():
            if info is None or info.kind != "recompute" or not info.keep_ops:
                continue
            first, last = self.region_first[name], self.region_last[name]
            unpack = first_unpack(self.records, first, last)
            for record in self.records[first:last + 1]:
                if info.keeps(record.func):
                    for key in record.new_keys:
                        if self.base_keys.get(key) is None and key not in self.out_keys:
                            cached = unpack if recomputed(record, unpack) and not info.holds(record.func) else first
                            self.saved_until[key] = min(self.saved_until.get(key, cached), cached)

    def _persisting_savers(self) -> dict[int, list[int]]:
        """Key -> records saving it in a way that persists (a recompute region's own saves are recomputed); only
        needed when a region offloads its inputs."""
        savers: dict[int, list[int]] = defaultdict(list)
        if any(getattr(info, "offload_inputs", False) for info in self.regions.values()):
            for record in self.records:
                info = self.regions.get(record.region) if record.region else None
                if record.out_rg and not (info is not None and info.kind == "recompute"
                                          and not info.keeps(record.func)):
                    for key in record.saved:
                        savers[key].append(record.idx)
        return savers

    def _plan_region_inputs(self) -> None:
        """Inputs of a recompute region are held by the region until its backward."""
        savers = self._persisting_savers()
        for name, info in self.regions.items():
            if info is None or info.kind != "recompute":
                continue
            first, last = self.region_first[name], self.region_last[name]
            for record in self.records[first:last + 1]:
                for key in record.in_keys + record.list_keys:  # (every tensor of a cat's list, not only the first)
                    if key in self.recipe_holds and self.created_in.get(key, -1) < first and key not in self.out_keys:
                        self._remake_recipe_input(name, key, first, last)
                        continue
                    if key is not None and self.created_in.get(key, -1) < first and self.base_keys.get(key) is None:
                        self.saved_until[key] = min(self.saved_until.get(key, first), first)
                        if getattr(info, "offload_inputs", False) and key in self.created_in \
                                and not any(not first <= i <= last for i in savers.get(key, ())):
                            # an activation nobody else saves: off the device from the region's end until its
                            # backward
                            self.offloaded[name].add(key)

    def _remake_recipe_input(self, name: str, key: int, first: int, last: int) -> None:
        """Non-reentrant checkpoint saves its inputs through the saved-tensor hooks outside it: an input that is a
        recipe's output is kept as the recipe (its arguments) and made again for the recomputation, held until the
        backward of the region's first op that saves it, or only while the recomputation runs when none does."""
        storage_bytes = self.storage_bytes
        if key not in self.recompute_keys[name] and key not in self.recompute_transient[name]:
            inner = [record.idx for record in self.records[first:last + 1] if record.out_rg and key in record.saved]
            if inner:
                self.recompute_keys[name][key] = min(inner)
                self.recompute_bytes[name] += storage_bytes[key]
            else:
                self.recompute_transient[name][key] = storage_bytes[key]
            for member in self.group_members.get(self.recorder.recipe_group.get(key), ()):
                if member != key:  # made with it by the group's run, dropped at once
                    self.recompute_transient[name][member] = storage_bytes[member]
        for held in self.recipe_holds[key]:
            if held != key and self.created_in.get(held, -1) < first and self.base_keys.get(held) is None:
                self.saved_until[held] = min(self.saved_until.get(held, first), first)

    def _recompute_overs(self) -> dict[str, int]:
        """What each recompute region's recomputation holds at its highest, above what it leaves for the
        backward."""
        over: dict[str, int] = {}
        for name, info in self.regions.items():
            if info is not None and info.kind == "recompute" and getattr(info, "as_recipes", False):
                high = recipe_high(self.liveness, self.region_first[name], self.region_last[name],
                                   self.recompute_keys[name], self.recompute_transient[name],
                                   draws_again=not info.keep_ops & DRAW_OPS)
            elif info is not None and info.kind == "recompute":
                high = self.liveness.recompute_high(self.region_first[name], self.region_last[name], info,
                                                    self.recompute_keys[name], self.recompute_transient[name])
                over[name] = max(0, high - self.recompute_bytes[name])
        return over


def _region_spans(program: Program, records: list) -> tuple[dict, dict, dict]:
    """(region name -> its RegionInfo, -> its first record, -> its last record), for the regions the trace ran."""
    regions: dict[str, object] = {}
    for record in records:
        if record.region and record.region not in regions:
            regions[record.region] = region_info(program.module.get_submodule(record.region))
    region_first: dict[str, int] = {}
    region_last: dict[str, int] = {}
    for record in records:
        if record.region:
            region_first.setdefault(record.region, record.idx)
            region_last[record.region] = record.idx
    return regions, region_first, region_last
