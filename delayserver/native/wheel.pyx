# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The timing wheel's adds (one at a time and in bulk) and its advance, compiled, and the sender's
passes over a batch of due messages. `TimingWheel._add_py`, `_add_entries_py` and `_advance_py` in
delayserver/wheel/timingwheel.py are the references these must equal (tests/test_native.py holds
the two wheels to the same slots, heap and order of firing); the sender's, beside each below."""
from cpython cimport array
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.string cimport memmove

from heapq import heappop, heappush
from operator import itemgetter

from delayserver.native.tuples cimport PyObject_GC_IsTracked, PyObject_GC_UnTrack, new_tuple_of, set_item

cdef long long MAX_REF = 0x7FFFFFFFFFFFFFFF


cdef inline Py_ssize_t _after(const long long *data, Py_ssize_t pairs, long long due) noexcept:
    """The first of a slot's `pairs` (due, ref), sorted by due, due after `due` (bisect_right)."""
    cdef Py_ssize_t lo = 0, hi = pairs, i
    while lo < hi:
        i = (lo + hi) >> 1
        if due < data[2 * i]:
            hi = i
        else:
            lo = i + 1
    return lo


cdef inline void _insert(wheel, list slot_entries, long long start, long long tick, Py_ssize_t mask, int shift,
                         long long due, long long ref) except *:
    """`TimingWheel.add`'s storing of one entry due after now (the caller checked the ref)."""
    cdef Py_ssize_t slot, n, i
    cdef array.array entries
    cdef long long *data
    cdef object entry_obj
    slot = ((due - start) // tick) & mask  # floored, as Python divides (cdivision is off here)
    entry_obj = slot_entries[slot]
    if entry_obj is None:
        slot_entries[slot] = array.array("q", (due, ref))
        wheel._nonempty += 1
        wheel._push((<object>due << shift) | slot)
        return
    entries = <array.array>entry_obj
    n = len(entries)  # 2k: k pairs (due, ref), sorted by due (a slot's array is never empty)
    array.resize_smart(entries, n + 2)
    data = entries.data.as_longlongs
    if due >= data[n - 2]:  # the usual case within one round: appended
        data[n] = due
        data[n + 1] = ref
    else:  # after the due times equal to it (insertion order), as bisect_right puts it
        i = _after(data, n >> 1, due)
        memmove(&data[2 * i + 2], &data[2 * i], (n - 2 * i) * sizeof(long long))
        data[2 * i] = due
        data[2 * i + 1] = ref
        if i == 0:
            wheel._push((<object>due << shift) | slot)


def add(wheel, object due_ms, object ref, object now):
    """`TimingWheel.add`: the entry stored and True, or False when it is due at `now`. Raises as
    the reference does (ValueError for a ref outside 0..MAX_REF, OverflowError for a due time
    outside 64 bits), the wheel unchanged."""
    if due_ms <= now:
        return False
    if ref < 0 or ref > MAX_REF:
        raise ValueError(f"ref must be in 0..2**63-1, got {ref}")
    _insert(wheel, wheel._slot_entries, wheel.start_ms, wheel.tick_ms, wheel._mask, wheel._shift, due_ms, ref)
    wheel._len += 1
    return True


def add_entries(wheel, list entries, object base, long long now, object min_offset):
    """`TimingWheel.add_entries`: ``add(schedule_time, base | offset)`` of each ``(offset,
    schedule_time)`` of `entries` at or past `min_offset`, in order; returns the refs refused,
    how many entries were at or past `min_offset`, and the earliest due time added (None if none).
    Raises as `add` does (ValueError for a ref outside 0..MAX_REF, OverflowError for a due time
    outside 64 bits), the entries before it added."""
    cdef list slot_entries = wheel._slot_entries
    cdef long long start = wheel.start_ms, tick = wheel.tick_ms
    cdef Py_ssize_t mask = wheel._mask
    cdef int shift = wheel._shift
    cdef list refused = []
    cdef object entry, ref, earliest = None
    cdef Py_ssize_t added = 0, taken = 0
    try:
        for entry in entries:
            if entry[0] < min_offset:
                continue
            taken += 1
            ref = base | entry[0]
            if entry[1] <= now:
                refused.append(ref)
                continue
            if ref < 0 or ref > MAX_REF:
                raise ValueError(f"ref must be in 0..2**63-1, got {ref}")
            _insert(wheel, slot_entries, start, tick, mask, shift, entry[1], ref)
            added += 1
            if earliest is None or entry[1] < earliest:
                earliest = entry[1]
    finally:
        wheel._len += added
    return refused, taken, earliest


cdef object _ONE = 1
cdef tuple _NONE_TRIED = ()


cdef class Due:
    """One due message the sender holds (`due_queue.Due` where this is built): the attrs class
    `due_queue.DueReference` is what this must equal (the same fields, defaults and identity,
    tests/test_native.py), made in C: one is made per due message taken, and the attrs class's
    Python-level `__init__` cost 0.3 us of each (`dues_of` makes them)."""

    cdef public object ref, bucket, schedule_offset, message, generation, attempt, tried, group, suspect
    cdef public object message_log_offset
    cdef object __weakref__

    def __init__(self, ref, bucket, schedule_offset, message, generation=0, attempt=1, tried=(), group=None,
                 suspect=False, message_log_offset=-1):
        self.ref = ref
        self.bucket = bucket
        self.schedule_offset = schedule_offset
        self.message = message
        self.generation = generation
        self.attempt = attempt
        self.tried = tried
        self.group = group
        self.suspect = suspect
        self.message_log_offset = message_log_offset

    def __repr__(self):
        return (f"Due(ref={self.ref!r}, bucket={self.bucket!r}, schedule_offset={self.schedule_offset!r}, "
                f"message={self.message!r}, generation={self.generation!r}, attempt={self.attempt!r}, "
                f"tried={self.tried!r}, group={self.group!r}, suspect={self.suspect!r}, "
                f"message_log_offset={self.message_log_offset!r})")


def dues_of(list refs, list reads, object generation):
    """`DueQueue.take`'s dues: per ref whose read (bucket, offset, message_log offset, message) is
    not None, in order, ``Due(ref, bucket, offset, message, generation, message_log_offset=...)``."""
    cdef Py_ssize_t k, n = len(refs)
    cdef list out = []
    cdef Due d
    cdef object read
    if len(reads) != n:
        raise ValueError("a read per ref")
    for k in range(n):
        read = reads[k]
        if read is None:
            continue
        d = Due.__new__(Due)
        d.ref = refs[k]
        d.bucket = read[0]
        d.schedule_offset = read[1]
        d.message = read[3]
        d.generation = generation
        d.attempt = _ONE
        d.tried = _NONE_TRIED
        d.group = None
        d.suspect = False
        d.message_log_offset = read[2]
        out.append(d)
    return out


def outbound_of(list batch, object now, object outbound_type, object message_type):
    """`Sender._send`'s messages of `batch` (Dues holding their message): per due, in order,
    ``outbound_type(message_id, subject, body, headers, schedule_time, now, attempt)``, each made
    as its named tuple's own `__new__` makes it, from the message's fields by position where it is
    a `message_type` (storage.record.Message). None when one is not a compiled Due, or the types
    are not the named tuples of 7 fields and at least 5 this expects (the caller makes them)."""
    cdef list out = []
    cdef object item, m, t
    cdef Due d
    if (not isinstance(outbound_type, type) or (<type>outbound_type).__base__ is not tuple
            or len(outbound_type._fields) != 7 or (<type>message_type).__base__ is not tuple
            or tuple(message_type._fields[:5]) != ("message_id", "subject", "body", "schedule_time", "headers")):
        return None
    for item in batch:
        if type(item) is not Due:
            return None
        d = <Due>item
        m = d.message
        if type(m) is not message_type or len(<tuple>m) < 5:
            return None
        t = new_tuple_of(outbound_type, 7)
        set_item(t, 0, <object>PyTuple_GET_ITEM(m, 0))
        set_item(t, 1, <object>PyTuple_GET_ITEM(m, 1))
        set_item(t, 2, <object>PyTuple_GET_ITEM(m, 2))
        set_item(t, 3, <object>PyTuple_GET_ITEM(m, 4))
        set_item(t, 4, <object>PyTuple_GET_ITEM(m, 3))
        set_item(t, 5, now)
        set_item(t, 6, d.attempt)
        if not PyObject_GC_IsTracked(<object>PyTuple_GET_ITEM(m, 4)):
            PyObject_GC_UnTrack(t)  # (strings, bytes, ints, a dict of strings: see records.message_at)
        out.append(t)
    return out


def settled(list batch, object now, object group, object generation):
    """`Sender._settle`'s one pass over a batch whose dispatch records are durable, as
    `sender._settled_py` (the reference) makes it: (per due, in order, `now` minus its message's
    schedule time; the refs of the dues of `generation`; how many were counted against `group`,
    their group now None; the dues counted against another group, left to the caller). None
    when one is not a compiled Due holding a message (the caller's reference does it then)."""
    cdef Py_ssize_t k, n = len(batch), freed = 0
    cdef list lateness = [None] * n
    cdef list refs = []
    cdef list others = []
    cdef object item, m
    cdef Due d
    for k in range(n):
        item = batch[k]
        if type(item) is not Due or (<Due>item).message is None:
            return None
    for k in range(n):
        d = <Due>batch[k]
        m = d.message
        lateness[k] = now - m.schedule_time
        if d.generation is generation or d.generation == generation:
            refs.append(d.ref)
        if d.group is group:
            d.group = None
            freed += 1
        elif d.group is not None:
            others.append(d)
    return lateness, refs, freed, others


cdef array.array _OFFSETS_Q = array.array("Q")
cdef array.array _OFFSETS_q = array.array("q")


def dispatch_fields(list batch):
    """`Sender._record_dispatch`'s one pass over an acknowledged batch, as `sender._dispatch_fields_py`
    (the reference) makes it: (the bucket of its dues, their schedule offsets in an array "Q",
    their message_log offsets in an array "q"), in order, when they are all compiled Dues of one
    bucket, each with both offsets (none below zero); else None (the caller goes the general way)."""
    cdef Py_ssize_t k, n = len(batch)
    cdef array.array schedule_offsets = array.clone(_OFFSETS_Q, n, zero=False)
    cdef array.array message_log_offsets = array.clone(_OFFSETS_q, n, zero=False)
    cdef unsigned long long *so = <unsigned long long *>schedule_offsets.data.as_voidptr
    cdef long long *mlo = <long long *>message_log_offsets.data.as_voidptr
    cdef object item, bucket = None
    cdef long long schedule_offset, message_log_offset
    cdef Due d
    if not n:
        return None
    for k in range(n):
        item = batch[k]
        if type(item) is not Due:
            return None
        d = <Due>item
        if k == 0:
            bucket = d.bucket
        elif d.bucket is not bucket and not (type(d.bucket) is int and type(bucket) is int and d.bucket == bucket):
            return None
        if type(d.schedule_offset) is not int or type(d.message_log_offset) is not int:
            return None
        try:
            schedule_offset, message_log_offset = d.schedule_offset, d.message_log_offset
        except OverflowError:  # (2**63 and over)
            return None
        if schedule_offset < 0 or message_log_offset < 0:
            return None
        so[k] = <unsigned long long>schedule_offset
        mlo[k] = message_log_offset
    return bucket, schedule_offsets, message_log_offsets


def untried_subject(list batch, object message_type):
    """`sender._untried_subject_py` (the reference) for compiled dues: the subject of a taken
    batch's messages when they are all compiled Dues of one subject, each with a message of
    `message_type` (a named tuple whose second field is the subject), in no group and never tried;
    else None (the caller routes them one by one), as for no dues or any other kind of due."""
    cdef Py_ssize_t k, n = len(batch)
    cdef object item, message, subject = None, s
    cdef Due d
    if not (isinstance(message_type, type) and issubclass(message_type, tuple)):
        raise TypeError(f"a message type is a named tuple, not {message_type!r}")
    for k in range(n):
        item = batch[k]
        if type(item) is not Due:
            return None
        d = <Due>item
        message = d.message
        if type(message) is not message_type or len(<tuple>message) < 2 or d.group is not None \
                or type(d.tried) is not tuple or len(<tuple>d.tried):
            return None
        s = <object>PyTuple_GET_ITEM(message, 1)
        if k == 0:
            if type(s) is not str:
                return None
            subject = s
        elif s is not subject and not (type(s) is str and s == subject):
            return None
    return subject


def set_group(list batch, object group):
    """``d.group = group`` for each compiled Due of `batch` (those `untried_subject` passed).
    Raises TypeError for anything else in it (the dues before it are set)."""
    cdef object item
    for item in batch:
        if type(item) is not Due:
            raise TypeError(f"set_group sets compiled dues, not {type(item).__name__}")
        (<Due>item).group = group


def split_refs(list refs, int bits, bint offsets_too=True):
    """`TickManager._split_refs_py` (the reference): when every ref of `refs` (ints from 0 to
    2**63 - 1) names one bucket (``ref >> bits``), (that bucket's index, the refs' offsets in it,
    ``ref & (2**bits - 1)``, in order; None for them without `offsets_too`); else None, as for no
    refs or anything but such ints."""
    cdef Py_ssize_t k, n = len(refs)
    cdef long long ref, index = -1, mask
    cdef list offsets
    cdef object item
    if n == 0 or not 0 < bits < 63:
        return None
    mask = (1LL << bits) - 1
    offsets = [None] * n if offsets_too else None
    for k in range(n):
        item = refs[k]
        if type(item) is not int:
            return None
        try:
            ref = item
        except OverflowError:
            return None
        if ref < 0:
            return None
        if k == 0:
            index = ref >> bits
        elif ref >> bits != index:
            return None
        if offsets_too:
            offsets[k] = ref & mask
    return index, offsets


cdef object _DUE_OF = itemgetter(0)


def advance(wheel, object now):
    """`TimingWheel.advance`: the entries due by `now` removed and returned as (due, ref) pairs,
    by due time, ties in insertion order, as `TimingWheel._advance_py` (the reference) does, without
    its copies of a slot's due times: a slot drained in part is searched in place."""
    cdef list heap = wheel._heap
    cdef list slot_entries = wheel._slot_entries
    cdef Py_ssize_t mask = wheel._mask
    cdef int shift = wheel._shift
    cdef list fired = []
    cdef object key, entries_obj, limit
    cdef array.array entries
    cdef long long *data
    cdef long long head, tail, latest, at
    cdef Py_ssize_t slot, n, i, j
    cdef bint in_order = True
    limit = (now << shift) | mask  # a key is at or under it exactly when its due is at or before now
    if not heap or heap[0] > limit:
        return fired
    try:
        at = now
    except OverflowError:  # past 64 bits: every due time (64 bits) is before it, or none is
        at = MAX_REF if now > 0 else -MAX_REF - 1
    latest = heap[0] >> shift
    while heap and heap[0] <= limit:
        key = heappop(heap)
        slot = key & mask
        entries_obj = slot_entries[slot]
        head = key >> shift
        if entries_obj is None:
            continue  # stale key
        entries = <array.array>entries_obj
        data = entries.data.as_longlongs
        n = len(entries)
        if data[0] != head:
            continue  # stale key
        if data[n - 2] <= at:
            tail = data[n - 2]
            for i in range(0, n, 2):
                fired.append((data[i], data[i + 1]))
            slot_entries[slot] = None
            wheel._nonempty -= 1
        else:
            j = _after(data, n >> 1, at)  # the first pair due after now (not the first: it is due)
            tail = data[2 * j - 2]
            for i in range(j):
                fired.append((data[2 * i], data[2 * i + 1]))
            del entries[:2 * j]
            heappush(heap, (<object>entries.data.as_longlongs[0] << shift) | slot)
        if head < latest:
            in_order = False
        if tail > latest:
            latest = tail
    if not in_order:
        # Stable: equal due times share a tick, hence a slot, whose order is insertion order.
        fired.sort(key=_DUE_OF)
    wheel._len -= len(fired)
    return fired
