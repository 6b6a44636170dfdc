# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The timing wheel's adds in bulk, compiled (`TimingWheel._add_many_py` in
delayserver/wheel/timingwheel.py is the reference this must equal: tests/test_native.py holds the
two wheels to the same slots, heap and order of firing)."""
from cpython cimport array
from libc.string cimport memmove

cdef long long MAX_REF = 0x7FFFFFFFFFFFFFFF


def add_many(wheel, list items, long long now):
    """`TimingWheel.add` of each ``(due_ms, ref)`` of `items` (ints), in order; returns the refs it
    refused, already due at `now`, in order. Raises as `add` does (ValueError for a ref outside
    0..MAX_REF, OverflowError for a due time outside 64 bits), the items before it added."""
    cdef list slot_entries = wheel._slot_entries
    cdef long long start = wheel.start_ms, tick = wheel.tick_ms, due, ref
    cdef Py_ssize_t mask = wheel._mask, slot, k, i, lo, hi
    cdef int shift = wheel._shift
    cdef list refused = []
    cdef array.array entries
    cdef long long *data
    cdef object item, entry_obj
    cdef Py_ssize_t added = 0
    try:
        for item in items:
            if item[0] <= now:  # (compared as Python ints: any due time in the past is refused)
                refused.append(item[1])
                continue
            if item[1] < 0 or item[1] > MAX_REF:
                raise ValueError(f"ref must be in 0..2**63-1, got {item[1]}")
            ref = item[1]
            due = item[0]
            slot = ((due - start) // tick) & mask  # floored, as Python divides (cdivision is off here)
            entry_obj = slot_entries[slot]
            if entry_obj is None:
                slot_entries[slot] = array.array("q", (due, ref))
                wheel._nonempty += 1
                wheel._push((<object>due << shift) | slot)
            else:
                entries = <array.array>entry_obj
                k = len(entries) >> 1  # (a slot's array is never empty: an emptied slot is None)
                array.resize_smart(entries, 2 * k + 2)
                data = entries.data.as_longlongs
                if due >= data[k - 1]:  # the usual case within one round: at the end
                    data[2 * k + 1] = ref
                    memmove(&data[k + 1], &data[k], k * sizeof(long long))
                    data[k] = due
                else:  # after the due times equal to it (insertion order), as bisect_right puts it
                    lo, hi = 0, k
                    while lo < hi:
                        i = (lo + hi) >> 1
                        if due < data[i]:
                            hi = i
                        else:
                            lo = i + 1
                    i = lo
                    memmove(&data[k + 2 + i], &data[k + i], (k - i) * sizeof(long long))
                    data[k + 1 + i] = ref
                    memmove(&data[k + 1], &data[k], i * sizeof(long long))
                    memmove(&data[i + 1], &data[i], (k - i) * sizeof(long long))
                    data[i] = due
                    if i == 0:
                        wheel._push((<object>due << shift) | slot)
            added += 1
    finally:
        wheel._len += added
    return refused
