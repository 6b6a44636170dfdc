# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The dedupe table's bookkeeping of accepted ids, compiled (`DedupeTable._remember_many_py` in
delayserver/dedupe.py is the reference this must equal: tests/test_native.py holds them side by
side, column for column)."""
cimport cython
from cpython cimport array
from libc.stdint cimport int64_t, uint32_t
from delayserver.native.idmap cimport IdMap
from delayserver.native.keyhash cimport bytes_key_hash, str_key_hash
from delayserver.native.screen cimport maybe_saved


cdef inline int append_q(array.array a, long long v) except -1:
    cdef Py_ssize_t n = len(a)
    array.resize_smart(a, n + 1)
    a.data.as_longlongs[n] = v
    return 0


cdef inline int append_i(array.array a, unsigned int v) except -1:
    cdef Py_ssize_t n = len(a)
    array.resize_smart(a, n + 1)
    a.data.as_uints[n] = v
    return 0


@cython.boundscheck(True)
@cython.wraparound(True)
def remember_many(positions, list keys, array.array stores, array.array scheds, array.array hashes,
                  list updates, Py_ssize_t base, long long window, entries, long long store_time, saved,
                  saved_position, list request_keys=None):
    """`DedupeTable.remember_many` over the table's columns (`stores`, `scheds`: array "q";
    `hashes`: array "I"); `saved`, `saved_position(key, raw, h)`: the entries read back at start
    (a `_Saved`: its `bits` screen out most ids not among them, without a call) and the lookup
    among them, or None; `positions`: the map of ids (an `IdMap`, probed here without a Python
    call, or a dict). With `request_keys` (a request's keys, `admit`'s), each of `entries` is
    ``(index, schedule time)`` (`admit`'s accepted) and its id is ``request_keys[index]``: no list
    of pairs made for it (`DedupeTable.remember_accepted`). Each key's saved hash is taken here
    (keyhash.pxd), as `key_hash` takes it. Returns how many changes it made (the table's `changes`
    grows by that)."""
    cdef Py_ssize_t changes = 0, i
    cdef object message_id, position, h, raw, entry, index
    cdef long long schedule_time
    cdef int64_t found
    cdef IdMap id_map = positions if type(positions) is IdMap else None
    cdef bytes saved_bitmap = None
    cdef int saved_shift = 0
    if saved is not None:
        saved_shift, saved_bitmap = saved.bits
    if stores.ob_descr.typecode != b"q"[0] or scheds.ob_descr.typecode != b"q"[0] or hashes.ob_descr.typecode != b"I"[0]:
        raise TypeError("dedupe columns of unexpected types")
    if request_keys is not None and type(entries) is not list:
        raise TypeError("with request_keys, entries is a list of (index, schedule time)")
    if id_map is not None and type(entries) is list:  # the probes' cache misses, overlapped
        for entry in <list>entries:
            id_map.prefetch(entry[0] if request_keys is None else request_keys[<Py_ssize_t>entry[0]])
    for entry in entries:
        if request_keys is None:
            message_id, schedule_time = entry
        else:
            index, schedule_time = entry
            message_id = request_keys[<Py_ssize_t>index]
        if id_map is not None:
            found = id_map.lookup(message_id)
            position = None if found < 0 else found
        else:
            position = positions.get(message_id)
        h = None
        if position is None and saved is not None:  # its hash is taken once, for the lookup and to keep
            raw = message_id.encode("utf-8")
            h = bytes_key_hash(raw)
            # most ids not among the saved are told by a bit, without a call
            position = saved_position(message_id, raw, h) if maybe_saved(saved_bitmap, saved_shift, h) else None
            if position is not None and not 0 <= <Py_ssize_t>position - base < len(stores):
                raise IndexError(f"dedupe position {position} is not in the table")
            if position is not None and store_time - stores.data.as_longlongs[<Py_ssize_t>position - base] >= window:
                saved.supersede(position)  # its window is over: the dict's new entry is its current one
                position = None
        if position is not None:
            i = <Py_ssize_t>position - base
            if not 0 <= i < len(stores):
                raise IndexError(f"dedupe position {position} is not in the table")
            if store_time - stores.data.as_longlongs[i] < window:
                scheds.data.as_longlongs[i] = schedule_time
                updates.append(position)
                changes += 1
                continue
        if id_map is not None:
            id_map.put(message_id, base + len(keys))
        else:
            positions[message_id] = base + len(keys)
        keys.append(message_id)
        append_q(stores, store_time)
        append_q(scheds, schedule_time)
        append_i(hashes, (str_key_hash(message_id) if type(message_id) is str
                          else bytes_key_hash(message_id.encode("utf-8"))) if h is None else h)
        changes += 1
    return changes
