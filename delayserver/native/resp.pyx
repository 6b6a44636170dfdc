# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The Redis transport's XADD commands, compiled: `xadd_commands` must equal
`delayserver.sender.redis_streams._xadd_commands_py`, byte for byte (tests/test_native.py holds them
side by side), or hand back None, and the reference then encodes the batch (and raises what it
raises). Each batch is sized first and written after, into one bytes object.

`scan_bulk_replies` finds the end of a batch's replies when each is a bulk string (an XADD's entry
id), and stops at any other shape for hiredis to parse: it never decides what a reply means.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

cdef inline Py_ssize_t digits(int64_t v) noexcept nogil:
    """The length of `v` in decimal, its sign included."""
    cdef uint64_t u = <uint64_t>v
    cdef Py_ssize_t n = 1
    if v < 0:
        u = (~u) + 1
        n = 2
    while u >= 10:
        u //= 10
        n += 1
    return n


cdef inline char *put_raw(char *w, const char *src, Py_ssize_t n) noexcept nogil:
    memcpy(w, src, n)
    return w + n


cdef inline char *put_int(char *w, int64_t v, Py_ssize_t n) noexcept nogil:
    """`v` in decimal (`n` of `digits(v)` characters) at `w`."""
    cdef uint64_t u = <uint64_t>v
    cdef char *end = w + n
    cdef char *p = end
    if v < 0:
        u = (~u) + 1
        w[0] = 45  # '-'
    while True:
        p -= 1
        p[0] = <char>(48 + u % 10)  # '0' + the digit
        u //= 10
        if u == 0:
            break
    return end


cdef inline Py_ssize_t bulk_size(Py_ssize_t n) noexcept nogil:
    """The bytes of a RESP bulk string of `n` bytes: $<n>\\r\\n<data>\\r\\n."""
    return 1 + digits(n) + 2 + n + 2


cdef inline char *put_crlf(char *w) noexcept nogil:
    w[0] = 13  # CR
    w[1] = 10  # LF
    return w + 2


cdef inline char *put_length(char *w, char kind, Py_ssize_t n) noexcept nogil:
    """`kind` ('$' a bulk string, '*' an array) and the length `n`, then CRLF."""
    w[0] = kind
    return put_crlf(put_int(w + 1, n, digits(n)))


cdef inline char *put_bulk(char *w, const char *data, Py_ssize_t n) noexcept nogil:
    return put_crlf(put_raw(put_length(w, 36, n), data, n))  # 36: '$'


cdef inline char *put_int_bulk(char *w, int64_t v) noexcept nogil:
    """`v` in decimal as a bulk string."""
    cdef char text[20]
    cdef Py_ssize_t n = digits(v)
    put_int(text, v, n)
    return put_bulk(w, text, n)


def xadd_commands(list messages, named, bytes body_field, bytes schedule_field, bytes dispatch_field,
                  bytes attempt_field, header_prefix, long long fields):
    """The commands of `_xadd_commands_py` for `messages` (OutboundMessage tuples), or None.
    `named(subject)`: the bytes before the message id (`*` excluded: the array's length is written
    here, `fields` plus two per header) and the subject's field and value, as the reference makes
    them, asked once per subject of the batch. `body_field` and the others: each field's name as a
    bulk string; `header_prefix`: the str in front of each header key."""
    cdef Py_ssize_t count = len(messages), i, total = 0, n, id_n, body_n, key_n, value_n, prefix_n
    cdef int64_t sched, disp, att
    cdef const char *p
    cdef const char *prefix_p
    cdef char *w
    cdef dict subjects = {}
    cdef tuple m, pair
    cdef object body, headers, key, value, subject, item
    cdef bytes out, head, subject_part
    cdef list heads = [None] * count
    prefix_p = PyUnicode_AsUTF8AndSize(header_prefix, &prefix_n)
    try:
        for i in range(count):  # checked and measured first, written after
            item = messages[i]
            if not isinstance(item, tuple) or len(<tuple>item) != 7:
                return None
            m = <tuple>item
            subject = m[1]
            pair = subjects.get(subject)
            if pair is None:
                if type(subject) is not str:
                    return None
                pair = subjects[subject] = tuple(named(subject))
                if len(pair) != 2 or type(pair[0]) is not bytes or type(pair[1]) is not bytes:
                    return None
            heads[i] = pair
            if type(m[0]) is not str or type(m[2]) is not bytes:
                return None
            PyUnicode_AsUTF8AndSize(m[0], &id_n)
            body_n = PyBytes_GET_SIZE(m[2])
            sched, disp, att = m[4], m[5], m[6]
            headers = m[3]
            n = len(headers)
            total += (1 + digits(fields + 2 * n) + 2 + PyBytes_GET_SIZE(pair[0]) + bulk_size(id_n)
                      + PyBytes_GET_SIZE(pair[1]) + PyBytes_GET_SIZE(body_field) + bulk_size(body_n)
                      + PyBytes_GET_SIZE(schedule_field) + bulk_size(digits(sched))
                      + PyBytes_GET_SIZE(dispatch_field) + bulk_size(digits(disp))
                      + PyBytes_GET_SIZE(attempt_field) + bulk_size(digits(att)))
            if n:
                if type(headers) is not dict:
                    return None
                for key, value in (<dict>headers).items():
                    if type(key) is not str or type(value) is not str:
                        return None
                    PyUnicode_AsUTF8AndSize(key, &key_n)
                    PyUnicode_AsUTF8AndSize(value, &value_n)
                    total += bulk_size(prefix_n + key_n) + bulk_size(value_n)
    except Exception:  # a time out of 64 bits, text not encodable: the reference decides
        return None
    out = PyBytes_FromStringAndSize(NULL, total)
    w = PyBytes_AS_STRING(out)
    for i in range(count):
        m = <tuple>messages[i]  # (each checked above)
        pair = <tuple>heads[i]
        headers = m[3]
        n = len(headers)
        w = put_length(w, 42, fields + 2 * n)  # 42: '*'
        head, subject_part = pair[0], pair[1]
        w = put_raw(w, PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head))
        p = PyUnicode_AsUTF8AndSize(m[0], &id_n)
        w = put_bulk(w, p, id_n)
        w = put_raw(w, PyBytes_AS_STRING(subject_part), PyBytes_GET_SIZE(subject_part))
        w = put_raw(w, PyBytes_AS_STRING(body_field), PyBytes_GET_SIZE(body_field))
        body = m[2]
        w = put_bulk(w, PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body))
        w = put_int_bulk(put_raw(w, PyBytes_AS_STRING(schedule_field), PyBytes_GET_SIZE(schedule_field)), m[4])
        w = put_int_bulk(put_raw(w, PyBytes_AS_STRING(dispatch_field), PyBytes_GET_SIZE(dispatch_field)), m[5])
        w = put_int_bulk(put_raw(w, PyBytes_AS_STRING(attempt_field), PyBytes_GET_SIZE(attempt_field)), m[6])
        if n:
            for key, value in (<dict>headers).items():
                p = PyUnicode_AsUTF8AndSize(key, &key_n)
                w = put_crlf(put_raw(put_raw(put_length(w, 36, prefix_n + key_n), prefix_p, prefix_n), p, key_n))
                p = PyUnicode_AsUTF8AndSize(value, &value_n)
                w = put_bulk(w, p, value_n)
    return out


cdef inline Py_ssize_t bulk_end(const unsigned char[:] buf, Py_ssize_t pos, Py_ssize_t size) noexcept nogil:
    """The end of the bulk string at `pos` of `buf` (`size` bytes), -1 if `buf` ends before it,
    -2 if it is not one (another reply's type, a nil, a malformed or oversized length)."""
    cdef Py_ssize_t i = pos + 1, length = 0, end
    cdef unsigned char c
    if buf[pos] != 36:  # '$'
        return -2
    while i < size:
        c = buf[i]
        if c < 48 or c > 57:  # not a digit
            break
        length = length * 10 + (c - 48)
        if length > 536870912:  # past Redis's largest bulk string (proto-max-bulk-len)
            return -2
        i += 1
    if i == size:
        return -1
    if i == pos + 1 or buf[i] != 13:  # no digits (a nil: $-1), or no CR after them
        return -2
    if i + 1 == size:
        return -1
    if buf[i + 1] != 10:
        return -2
    end = i + 2 + length + 2
    if end > size:
        return -1
    if buf[end - 2] != 13 or buf[end - 1] != 10:
        return -2
    return end


def scan_bulk_replies(const unsigned char[:] buf, Py_ssize_t pos, Py_ssize_t want):
    """Up to `want` RESP bulk-string replies ($<n>\\r\\n<n bytes>\\r\\n: what XADD answers) of
    `buf` from `pos`: (the position after the last whole one, how many, and False if it stopped at
    a reply of another shape, True if only for want of bytes or having all). Another shape (an
    error, a nil, a push, a malformed length) is for the caller's hiredis reader to parse, as
    redis_streams._read_replies reads every reply without this scan."""
    cdef Py_ssize_t size = buf.shape[0], got = 0, end
    cdef bint clean = True
    with nogil:
        while got < want and pos < size:
            end = bulk_end(buf, pos, size)
            if end < 0:
                clean = end == -1
                break
            pos = end
            got += 1
    return pos, got, clean
