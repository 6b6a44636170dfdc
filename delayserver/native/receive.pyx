# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The receiver's pass over a request's messages, compiled (`_admit` in delayserver/node/receiver.py
is the reference this must equal, row for row: tests/test_native.py holds them side by side).

The messages to store are framed here, one after the other, into one bytearray per request: each
a record header (its length and type; its checksum, like its sequence, is set when the commit task
gives it its sequence: `record.sequence_framed`) and its payload. A message that passes the checks
at a glance gets a MESSAGE head written in front of a copy of its span of the request. Everything
else (a refusal, a duplicate, a message whose fields need `encode_message_fields`'s checks) is
answered as the reference answers it, through the same Python objects (`context`).
"""
cimport cython
from cpython.object cimport PyObject
from cpython.dict cimport PyDict_GetItemWithError
from cpython.bytearray cimport PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy
from delayserver.native.endian cimport put32, put64
from delayserver.native.grow cimport reserve
from delayserver.native.idmap cimport IdMap
from delayserver.native.keyhash cimport str_key_hash
from delayserver.native.layout cimport HEADER_SIZE, MESSAGE_HEAD_SIZE, T_MESSAGE
from delayserver.native.screen cimport maybe_saved


cdef inline void put_record_header(uint8_t *out, Py_ssize_t length) noexcept:
    """A MESSAGE record's header, its checksum left for when it is sequenced."""
    put32(out, 0)
    put32(out + 4, <uint32_t>length)
    out[8] = T_MESSAGE


cdef bint maybe_saved_id(key, bytes bitmap, int shift) except -1:
    """Whether `key` may be among the dedupe table's ids read back at start (False: it is not, and
    `find` would answer None). A key `find` would have to look at otherwise (not a str, no UTF-8)
    is left to it."""
    cdef uint32_t h
    if type(key) is not str:
        return True
    try:
        h = str_key_hash(key)
    except UnicodeError:
        return True
    return maybe_saved(bitmap, shift, h)


def admit(list rows, items, view, long long now, refused, refusal_text, table, dict committing, schedule_time,
          tuple at_window, long long max_bytes, tuple context):
    """`receiver._admit`: the same arguments, the same answer."""
    send_result, duplicate, invalid_message, encode_message_fields, checked_subjects, dedupe_key, max_id, max_headers = context
    cdef object at_first = at_window[0], at_last = at_window[1]
    cdef Py_ssize_t count = len(rows), i, span, id_at, id_len, subject_len, headers_len, body_len
    cdef Py_ssize_t max_id_bytes = max_id, max_headers_bytes = max_headers
    ids, saved = table.screen() if table is not None else (None, None)
    cdef IdMap id_map = ids if type(ids) is IdMap else None  # probed without a Python call
    cdef bytes saved_bitmap = None
    cdef int saved_shift = 0
    if saved is not None:  # the ids read back at start: most of those not among them are told by a bit
        saved_shift, saved_bitmap = saved
    cdef list results = [None] * count
    cdef list accepted = []
    cdef bytearray framed = bytearray()
    cdef Py_ssize_t used = 0, cap = 0
    cdef dict in_batch = {}
    cdef list keys = [None] * count
    cdef list twins = []
    cdef list waits = []
    cdef object last_spec = None, last_when = 0, when, spec, message_id, subject, headers, key = None, known
    cdef object encoded, item, other
    cdef tuple row
    cdef const uint8_t[::1] buf
    cdef Py_ssize_t buf_n = 0
    cdef uint8_t *out
    cdef long long when_c
    if view is not None:
        buf = view
        buf_n = buf.shape[0]
        for i in range(count):  # room for every message stored from its span: one allocation
            row = <tuple>rows[i]
            if row[4] >= 0:
                cap += HEADER_SIZE + MESSAGE_HEAD_SIZE + <Py_ssize_t>row[5] + <Py_ssize_t>row[6] \
                    + <Py_ssize_t>row[7] + <Py_ssize_t>row[8]
        if cap > 0 and refused is None:
            PyByteArray_Resize(framed, cap)
    if id_map is not None and refused is None:  # the probes' cache misses, overlapped
        for i in range(count):
            row = <tuple>rows[i]
            if not row[3]:
                id_map.prefetch(row[0])
    for i in range(count):
        row = <tuple>rows[i]
        message_id, subject, spec, headers = row[0], row[1], row[2], row[3]
        if refused is not None:
            results[i] = send_result(refused, refusal_text, 0, message_id)
            continue
        if table is not None:
            key = message_id if not headers else dedupe_key(message_id, headers)
            keys[i] = key
            # `find` only for a key accepted since start, or one the saved ids' bitmap does not rule out
            if (id_map.lookup(key) >= 0 if id_map is not None else key in ids) or (
                    saved is not None and maybe_saved_id(key, saved_bitmap, saved_shift)):
                known = table.find(key, now)
            else:
                known = None
            if known is not None:
                results[i] = duplicate(known, message_id)
                continue
            if key in in_batch:
                twins.append((i, in_batch[key]))
                continue
            if key in committing:
                other = committing[key]
                waits.append((i, other, other.when_of(key)))
                continue
        try:
            if type(spec) is int:  # an epoch time, as decoded
                when = spec if at_first <= spec <= at_last else schedule_time(spec, now)
            else:
                if spec is not last_spec:
                    last_when, last_spec = schedule_time(spec, now), spec
                when = last_when
            id_at, id_len, subject_len, headers_len, body_len = row[4], row[5], row[6], row[7], row[8]
            span = id_len + subject_len + headers_len + body_len
            if (id_at >= 0 and 0 < id_len <= max_id_bytes and subject in checked_subjects
                    and body_len <= max_bytes and subject_len <= 0xFF and id_len <= 0xFF
                    and (not headers_len or (headers_len <= max_headers_bytes and "" not in headers))
                    and id_at + span <= buf_n and type(when) is int):
                when_c = when
                out = reserve(framed, used, HEADER_SIZE + MESSAGE_HEAD_SIZE + span)
                put_record_header(out, MESSAGE_HEAD_SIZE + span)
                out += HEADER_SIZE
                put64(out, <uint64_t>now)
                put64(out + 8, <uint64_t>when_c)
                put64(out + 16, 0)
                out[24] = 0
                out[25] = 0
                out[26] = <uint8_t>id_len
                out[27] = <uint8_t>subject_len
                put32(out + 28, <uint32_t>headers_len)
                put32(out + 32, <uint32_t>body_len)
                memcpy(out + MESSAGE_HEAD_SIZE, &buf[id_at], span)
                used += HEADER_SIZE + MESSAGE_HEAD_SIZE + span
            else:
                item = items[i]
                encoded = encode_message_fields(item.message_id, item.subject, item.body, when,
                                                item.headers, now, max_body_bytes=max_bytes)
                if type(encoded) is not bytes:
                    encoded = bytes(encoded)
                span = PyBytes_GET_SIZE(encoded)
                out = reserve(framed, used, HEADER_SIZE + span)
                put_record_header(out, span)
                memcpy(out + HEADER_SIZE, PyBytes_AS_STRING(encoded), span)
                used += HEADER_SIZE + span
        except invalid_message as e:
            results[i] = send_result(e.code, str(e), 0, message_id)
            continue
        accepted.append((i, when))
        if table is not None:
            in_batch[key] = i
    if PyByteArray_GET_SIZE(framed) != used:
        PyByteArray_Resize(framed, used)
    return results, accepted, framed, keys, twins, waits


# --- a stored request's bookkeeping: `Receiver.send`'s passes over its accepted messages ----------
# (`receiver._mark_committing` and the two after it are the references, tests/test_native.py;
# indexed as Python indexes, checked: the indexes are admit's, but a wrong one must not crash)

@cython.boundscheck(True)
@cython.wraparound(True)
def mark_committing(dict committing, list keys, list accepted, object pending):
    """``committing[keys[i]] = pending`` of each ``(i, when)`` of `accepted`."""
    cdef tuple entry
    for entry in accepted:
        committing[keys[<Py_ssize_t>entry[0]]] = pending


@cython.boundscheck(True)
@cython.wraparound(True)
def unmark_committing(dict committing, list keys, list accepted, object pending):
    """Takes the key of each of `accepted` out of `committing` where `pending` still holds it."""
    cdef tuple entry
    cdef object key
    cdef PyObject *held
    for entry in accepted:
        key = keys[<Py_ssize_t>entry[0]]
        held = PyDict_GetItemWithError(committing, key)  # borrowed: no reference taken and dropped
        if held == <PyObject *>pending:
            del committing[key]


@cython.boundscheck(True)
@cython.wraparound(True)
def stored_results(list results, list accepted, list rows, object result_type, object code, object text):
    """``results[i] = result_type(code, text, when, rows[i][0])`` of each ``(i, when)`` of
    `accepted`, made as the named tuple's own constructor makes it."""
    cdef tuple entry
    cdef Py_ssize_t i
    for entry in accepted:
        i = entry[0]
        results[i] = tuple.__new__(result_type, (code, text, entry[1], rows[i][0]))
