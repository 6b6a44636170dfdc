"""The hashed timing wheel: which loaded entries are due, pure and synchronous, time injected.

Rules:

- An entry is a pair ``(due_ms, ref)``: an epoch-millisecond due time and a caller-chosen
  non-negative 63-bit int naming the message (the caller packs bucket and file offset into it).
  Refs are meant to be unique among stored entries.
- Ticks are counted from a fixed start, so nothing drifts: tick n covers
  ``[start_ms + n * tick_ms, start_ms + (n + 1) * tick_ms)``, and every entry due in tick n lives
  in slot ``n % slots``. One revolution is ``slots * tick_ms`` ms (65536 * 10 ms: about 11 min).
- An entry due more than a revolution ahead stays in its slot next to entries of earlier rounds.
  Its remaining rounds are not stored: they follow from its due time. Each slot keeps its
  entries sorted by due time (ties in insertion order), so draining a slot takes exactly the
  prefix that is due and leaves later rounds in place.
- ``add(due_ms, ref, now)`` refuses (returns False) an entry already due at ``now``: the caller
  fires it at once.
- ``advance(now)`` returns every stored entry with ``due_ms <= now``, in due order, ties in
  insertion order, each once, and removes them. Nothing is ever returned before its due time;
  ``now`` may jump far ahead or step back (a clock step), the rule stays the same.
- A small min-heap holds, for each non-empty slot, the due time of its earliest entry. It makes
  ``next_due()`` exact and cheap and lets ``advance`` visit only the slots that hold something
  due, each at most once per call: no spinning through empty ticks, however far ``now`` jumps.

Memory: a slot is one ``array('q')`` of its k entries' due times and refs in pairs, about 16 bytes
per entry plus array growth, plus one heap key per non-empty slot. No Python object is kept per
entry. An add in due order (the usual case: one delay, or times rising within a tick) appends a
pair; one out of order moves the pairs after its place.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from heapq import heapify, heappop, heappush
from operator import itemgetter

import attrs

try:  # the compiled adds and advance (delayserver/native/wheel.pyx), when the install built it
    from delayserver.native.wheel import add as _native_add
    from delayserver.native.wheel import add_entries as _native_add_entries
    from delayserver.native.wheel import advance as _native_advance
except ImportError:
    _native_add = _native_add_entries = _native_advance = None

MAX_REF = (1 << 63) - 1

#: Stale heap keys (left by adds in front of a slot, cancels and emptied slots) are dropped once
#: the heap outgrows twice the non-empty slots by this much: memory stays bounded, the rebuild
#: cost is paid back by the pushes that made it necessary.
_HEAP_SLACK = 64

_due_of = itemgetter(0)


def _power_of_two(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{attribute.name} must be a power of two, got {value}")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


# attrs' default on_setattr would route every assignment (``self._len += 1``) through a Python
# __setattr__ that runs the validators: it halved add's throughput. Validators run at init only.
@attrs.define(eq=False, kw_only=True, on_setattr=attrs.setters.NO_OP)
class TimingWheel:
    """A hashed timing wheel of ``(due_ms, ref)`` entries; see the module docstring for the rules.

    Raises ValueError when ``slots`` is not a power of two or ``tick_ms`` is not positive.
    """

    start_ms: int
    tick_ms: int = attrs.field(default=10, validator=_positive)
    slots: int = attrs.field(default=65536, validator=_power_of_two)

    # Per slot: None when empty, else one array('q') holding k pairs (due time, ref), sorted by
    # due time, ties in insertion order: [due0, ref0, due1, ref1, ...]. One object per slot rather
    # than two: half the headers, and add touches one object and one buffer (it is memory-bound;
    # this doubled it). Pairs rather than the k due times then the k refs: an add at the end
    # appends, where that layout moved every ref along by one.
    _slot_entries: list[array | None] = attrs.field(init=False)
    # Keys ``due << _shift | slot``: one int orders by due time and names the slot. A key is
    # valid while its slot's first due time equals its due; every non-empty slot has a valid key.
    _heap: list[int] = attrs.field(init=False, factory=list)
    _mask: int = attrs.field(init=False)
    _shift: int = attrs.field(init=False)
    _nonempty: int = attrs.field(init=False, default=0)
    _len: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._slot_entries = [None] * self.slots
        self._mask = self.slots - 1
        self._shift = self.slots.bit_length() - 1

    def add_entries(self, entries: list[tuple[int, int]], base: int, now: int,
                    min_offset: int = 0) -> tuple[list[int], int, int | None]:
        """`add(schedule_time, base | offset, now)` of each ``(offset, schedule_time)`` of
        `entries` at or past `min_offset`, in order (a bucket's replayed records: `base` its refs'
        bucket part). Returns the refs refused (already due), how many entries were at or past
        `min_offset`, and the earliest due time added (None if none). Raises as `add` does, the
        entries before the one that raised added.
        The compiled kernel when built, else `_add_entries_py`."""
        if _native_add_entries is None:
            return self._add_entries_py(entries, base, now, min_offset)
        return _native_add_entries(self, entries, base, now, min_offset)

    def _add_entries_py(self, entries: list[tuple[int, int]], base: int, now: int,
                        min_offset: int = 0) -> tuple[list[int], int, int | None]:
        """`add_entries` in Python: the compiled kernel's reference."""
        add = self._add_py
        refused, taken, earliest = [], 0, None
        for offset, due_ms in entries:
            if offset < min_offset:
                continue
            taken += 1
            if not add(due_ms, base | offset, now):
                refused.append(base | offset)
            elif earliest is None or due_ms < earliest:
                earliest = due_ms
        return refused, taken, earliest

    def add(self, due_ms: int, ref: int, now: int) -> bool:
        """Store the entry and return True, or return False when it is already due at ``now``.

        Raises ValueError when ``ref`` is outside ``0..MAX_REF`` and OverflowError when ``due_ms``
        does not fit 64 bits; the wheel is unchanged then.
        The compiled kernel when built (a bucket loading adds its records one at a time), else
        `_add_py`.
        """
        if _native_add is None:
            return self._add_py(due_ms, ref, now)
        return _native_add(self, due_ms, ref, now)

    def _add_py(self, due_ms: int, ref: int, now: int) -> bool:
        """`add` in Python: the compiled kernel's reference."""
        if due_ms <= now:
            return False
        if ref >> 63:  # negative or over 63 bits, in one operation
            raise ValueError(f"ref must be in 0..2**63-1, got {ref}")
        slot = ((due_ms - self.start_ms) // self.tick_ms) & self._mask
        entries = self._slot_entries[slot]
        if entries is None:
            self._slot_entries[slot] = array("q", (due_ms, ref))
            self._nonempty += 1
            self._push((due_ms << self._shift) | slot)
        elif due_ms >= entries[-2]:
            # The usual case within one round; bisect_right below would give the same place.
            entries.append(due_ms)
            entries.append(ref)
        else:
            # bisect_right: an equal due time goes after those already there (insertion order).
            i = bisect_right(entries[::2], due_ms)
            entries[2 * i : 2 * i] = array("q", (due_ms, ref))
            if not i:
                self._push((due_ms << self._shift) | slot)
        self._len += 1
        return True

    def advance(self, now: int) -> list[tuple[int, int]]:
        """Remove and return the entries due by ``now``: by due time, ties in insertion order.

        An entry is due when ``due_ms <= now``. ``now`` may be far ahead (each slot is visited at
        most once) or behind an earlier call (only entries due by this ``now`` come out, usually
        none). The compiled kernel when built (it searches a slot drained in part in place, where
        this copies its due times), else `_advance_py`.
        """
        if _native_advance is None:
            return self._advance_py(now)
        return _native_advance(self, now)

    def _advance_py(self, now: int) -> list[tuple[int, int]]:
        """`advance` in Python: the compiled kernel's reference."""
        heap = self._heap
        limit = (now << self._shift) | self._mask  # key <= limit exactly when its due <= now
        if not heap or heap[0] > limit:
            return []
        slot_entries = self._slot_entries
        mask, shift = self._mask, self._shift
        fired: list[tuple[int, int]] = []
        extend = fired.extend
        # Slots come out of the heap by their first due time. Their runs are already in global
        # order unless one run reaches past the start of the next: only a jump of over a
        # revolution (several rounds of one slot due at once) does that, and then we sort.
        latest = heap[0] >> shift
        in_order = True
        while heap and heap[0] <= limit:
            key = heappop(heap)
            slot = key & mask
            entries = slot_entries[slot]
            head = key >> shift
            if entries is None or entries[0] != head:
                continue  # stale key
            if entries[-2] <= now:
                tail = entries[-2]
                extend(zip(entries[::2], entries[1::2]))
                slot_entries[slot] = None
                self._nonempty -= 1
            else:
                dues = entries[::2]
                j = bisect_right(dues, now)
                tail = dues[j - 1]
                extend(zip(dues[:j], entries[1 : 2 * j : 2]))
                del entries[: 2 * j]
                heappush(heap, (entries[0] << shift) | slot)
            if head < latest:
                in_order = False
            if tail > latest:
                latest = tail
        if not in_order:
            # Stable: equal due times share a tick, hence a slot, whose order is insertion order.
            fired.sort(key=_due_of)
        self._len -= len(fired)
        return fired

    def refs_due_between(self, start_ms: int, end_ms: int) -> list[int]:
        """The refs of the entries due in [start_ms, end_ms), slot by slot (not in due order); the
        wheel is unchanged. Costs one bisection per slot the span covers (at most `slots`)."""
        out: list[int] = []
        if end_ms <= start_ms:
            return out
        slot_entries, mask = self._slot_entries, self._mask
        first = (start_ms - self.start_ms) // self.tick_ms
        last = (end_ms - 1 - self.start_ms) // self.tick_ms
        for tick in range(first, min(last, first + self.slots - 1) + 1):
            entries = slot_entries[tick & mask]
            if entries is None:
                continue
            dues = entries[::2]
            i = bisect_left(dues, start_ms)
            j = bisect_left(dues, end_ms, i)
            if i < j:
                out.extend(entries[2 * i + 1 : 2 * j : 2])
        return out

    def next_due(self) -> int | None:
        """The due time of the earliest stored entry (exact), or None when the wheel is empty.

        ``advance(t)`` returns something exactly when ``t >= next_due()``. The result may be in
        the past (an entry added before a clock step back): then advance at once.
        """
        heap = self._heap
        while heap:
            key = heap[0]
            due = key >> self._shift
            entries = self._slot_entries[key & self._mask]
            if entries is not None and entries[0] == due:
                return due
            heappop(heap)  # stale key
        assert self._len == 0, "test_model_agrees: an entry left without a heap key"
        return None

    def holds_due_by(self, t: int) -> bool:
        """Whether an entry stored falls due by `t`: `advance(t)` would return something."""
        due = self.next_due()
        return due is not None and due <= t

    def cancel(self, ref: int, due_ms: int | None = None) -> bool:
        """Remove the stored entry with this ref and return True, or return False if there is none.

        With ``due_ms`` (the schedule time a cancel handle carries) only the entry ``(due_ms, ref)``
        is looked for, in its one slot. Without it every slot is searched: O(entries), meant for
        tools and tests. If a ref was stored twice, each call removes one.
        """
        if due_ms is not None:
            slot = ((due_ms - self.start_ms) // self.tick_ms) & self._mask
            entries = self._slot_entries[slot]
            if entries is None:
                return False
            dues = entries[::2]
            lo, hi = bisect_left(dues, due_ms), bisect_right(dues, due_ms)
            try:
                i = lo + entries[2 * lo + 1 : 2 * hi : 2].index(ref)
            except ValueError:
                return False
            self._remove(slot, i)
            return True
        for slot, entries in enumerate(self._slot_entries):
            if entries is not None and ref in entries:  # a cheap filter: it may be a due time
                try:
                    i = entries[1::2].index(ref)
                except ValueError:
                    continue
                self._remove(slot, i)
                return True
        return False

    def __len__(self) -> int:
        return self._len

    def __contains__(self, ref: object) -> bool:
        return any(ref in entries[1::2] for entries in self._slot_entries if entries)

    def _remove(self, slot: int, i: int) -> None:
        entries = self._slot_entries[slot]
        del entries[2 * i : 2 * i + 2]
        self._len -= 1
        if not entries:
            self._slot_entries[slot] = None
            self._nonempty -= 1
        elif not i:
            self._push((entries[0] << self._shift) | slot)

    def _push(self, key: int) -> None:
        heap = self._heap
        heappush(heap, key)
        if len(heap) > 2 * self._nonempty + _HEAP_SLACK:
            self._drop_stale_keys()

    def _drop_stale_keys(self) -> None:
        shift, mask, slot_entries = self._shift, self._mask, self._slot_entries
        valid = [
            key
            for key in set(self._heap)
            if (entries := slot_entries[key & mask]) is not None and entries[0] == key >> shift
        ]
        # Exactly one valid key per non-empty slot survives the set: nothing due can be lost.
        assert len(valid) == self._nonempty, "test_heap_stays_bounded_under_descending_adds"
        heapify(valid)
        self._heap[:] = valid
