# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A SEND request's items, decoded by a compiled kernel (see `_decode_send_request_py` in
delayserver/protocol.py, the reference this must equal: tests/test_native.py holds them side by
side). The request comes from a connection: every length is checked against the payload before a
byte of it is read, and anything the reference would not take gives None.
"""
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp

cdef enum:
    ITEM_SIZE = 19  # time kind u8, time value i64, id u16, subject u16, header count u16, body u32


cdef inline uint32_t be16(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 8) | p[1]


cdef inline uint32_t be32(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline object text(const uint8_t *buf, Py_ssize_t start, Py_ssize_t stop):
    return PyUnicode_DecodeUTF8(<const char *>buf + start, stop - start, NULL)


def decode_rows(bytes payload, make_spec):
    """The rows of `protocol.SendBatch` for the SEND request `payload`, or None where the reference
    answers None. `make_spec(kind, value)`: the TimeSpec of a time kind and value, None for a kind
    that is none; called once per distinct pair."""
    cdef const uint8_t *buf = <const uint8_t *>(<char *>payload)
    cdef Py_ssize_t end = len(payload)
    cdef Py_ssize_t pos, id_at, subject_at, headers_at, at, key_at, value_len_at, value_at
    cdef Py_ssize_t last_subject_at = -1, last_subject_len = -1
    cdef uint64_t count, i, h
    cdef uint32_t id_len, subject_len, header_count, body_len
    cdef int kind, last_kind = -1
    cdef int64_t value, last_value = 0
    cdef object spec = None, subject = None, key, message_id
    cdef dict headers
    cdef dict specs = {}
    cdef list rows = []
    if end < 4:
        return None
    count = be32(buf)
    if <int64_t>count * ITEM_SIZE > end - 4:
        return None
    pos = 4
    try:
        for i in range(count):
            if pos + ITEM_SIZE > end:
                return None
            kind = buf[pos]
            value = <int64_t>((<uint64_t>be32(buf + pos + 1) << 32) | be32(buf + pos + 5))
            id_len = be16(buf + pos + 9)
            subject_len = be16(buf + pos + 11)
            header_count = be16(buf + pos + 13)
            body_len = be32(buf + pos + 15)
            if kind != last_kind or value != last_value:
                pair = (kind, value)
                spec = specs.get(pair)
                if spec is None:
                    spec = make_spec(kind, value)
                    if spec is None:
                        return None
                    specs[pair] = spec
                last_kind, last_value = kind, value
            id_at = pos + ITEM_SIZE
            subject_at = id_at + id_len
            at = headers_at = subject_at + subject_len
            if headers_at > end:
                return None
            headers = {}
            for h in range(header_count):
                key_at = at + 2
                if key_at > end:
                    return None
                value_len_at = key_at + be16(buf + at)
                value_at = value_len_at + 2
                if value_at > end:
                    return None
                at = value_at + be16(buf + value_len_at)
                if at > end:
                    return None
                key = text(buf, key_at, value_len_at)
                if key in headers:
                    return None
                headers[key] = text(buf, value_at, at)
            pos = at + body_len
            if pos > end:
                return None
            message_id = text(buf, id_at, subject_at)
            # A batch usually names one subject: its text is made once.
            if subject_len != last_subject_len or memcmp(buf + subject_at, buf + last_subject_at, subject_len) != 0:
                subject = text(buf, subject_at, headers_at)
                last_subject_at, last_subject_len = subject_at, subject_len
            rows.append((message_id, subject, spec, headers, id_at, id_len, subject_len, at - headers_at, body_len))
    except UnicodeDecodeError:
        return None
    return rows if pos == end else None
