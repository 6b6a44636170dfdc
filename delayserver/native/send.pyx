# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""SEND codec kernels, compiled; each must equal its Python reference in delayserver/protocol.py
(tests/test_native.py holds them side by side): `encode_items` a request (`_encode_send_request_py`,
the producer's side), `decode_rows` a request's items (`_decode_send_request_py`), `encode_results`
the response (`_encode_send_response_py`), `decode_results` the response on the producer's side
(`_decode_send_response_py`). A request or response comes from a connection: every length is
checked against the payload before a byte of it is read, and anything the reference would not take
gives None.
"""
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeASCII, PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy
from delayserver.native.endian cimport be16, be32, be64, put16, put32, put64

cdef enum:
    ITEM_SIZE = 19  # time kind u8, time value i64, id u16, subject u16, header count u16, body u32


cdef inline object text(const uint8_t *buf, Py_ssize_t start, Py_ssize_t stop):
    return PyUnicode_DecodeUTF8(<const char *>buf + start, stop - start, NULL)


def decode_rows(bytes payload, make_spec, int at_kind=-1):
    """The rows of `protocol.SendBatch` for the SEND request `payload`, or None where the reference
    answers None. `make_spec(kind, value)`: the TimeSpec of a time kind and value, None for a kind
    that is none; called once per distinct pair. A time of kind `at_kind` is its value, an int."""
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
            if kind == at_kind:
                spec = value  # an epoch time: no TimeSpec (the receiver takes it as it is)
            elif kind != last_kind or value != last_value:
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


def encode_results(results, result_type):
    """The SEND response payload of `results` (`protocol._encode_send_response_py`, the reference),
    or None where that answers None: a result not of `result_type` (a tuple of code, message,
    schedule time, message id), a field out of its range, text that is not str or not encodable."""
    cdef Py_ssize_t count, i, total = 4, id_n, msg_n, last_n = 0
    cdef const char *id_p
    cdef const char *msg_p
    cdef const char *last_p = NULL
    cdef long code
    cdef int64_t when
    cdef object result, message_id, message, last_message = None
    cdef bytes out
    cdef uint8_t *w
    cdef tuple row
    if type(results) is not list:
        results = list(results)
    count = len(results)
    if count > 0xFFFFFFFF:
        return None
    try:
        for i in range(count):  # checked and measured first, written after
            result = results[i]
            if type(result) is not result_type:
                return None
            row = <tuple>result
            if not isinstance(row[0], int) or not isinstance(row[2], int):  # (C conversions take floats)
                return None
            code = row[0]
            when = row[2]
            message_id, message = row[3], row[1]
            if type(message_id) is not str or type(message) is not str or not 0 <= code <= 0xFFFF:
                return None
            PyUnicode_AsUTF8AndSize(message_id, &id_n)
            if id_n > 0xFFFF:
                return None
            if message is not last_message:
                PyUnicode_AsUTF8AndSize(message, &msg_n)
                if msg_n > 0xFFFFFFFF:
                    return None
                last_message, last_n = message, msg_n
            total += 12 + id_n + 4 + last_n
    except Exception:  # a field of the wrong type or out of range, a lone surrogate: the reference decides
        return None
    out = PyBytes_FromStringAndSize(NULL, total)
    w = <uint8_t *><char *>out
    put32(w, <uint32_t>count)
    w += 4
    last_message = None
    for i in range(count):
        row = <tuple>results[i]
        code = row[0]
        when = row[2]
        message_id, message = row[3], row[1]
        id_p = PyUnicode_AsUTF8AndSize(message_id, &id_n)
        if message is not last_message:
            last_p = PyUnicode_AsUTF8AndSize(message, &last_n)
            last_message = message
        put16(w, <uint32_t>code)
        put32(w + 2, <uint32_t>(<uint64_t>when >> 32))
        put32(w + 6, <uint32_t><uint64_t>when)
        put16(w + 10, <uint32_t>id_n)
        memcpy(w + 12, id_p, id_n)
        w += 12 + id_n
        put32(w, <uint32_t>last_n)
        memcpy(w + 4, last_p, last_n)
        w += 4 + last_n
    return out


def decode_results(bytes payload, result_type, codes):
    """The SendResults (`result_type`) of the SEND response `payload`, or None where the reference
    answers None (a length past the end, bytes left over, text that is not UTF-8). `codes`: the
    ResultCode of each known code value; an unknown value is kept as the int."""
    cdef Py_ssize_t handles = 0
    return results_of(payload, result_type, codes, None, 0, 0, &handles)


def decode_handles(bytes payload, result_type, codes, handle_type, uint32_t stored, uint32_t stored_too):
    """`decode_results` on the producer's hot path: the same list, except that each result whose
    code is `stored` or `stored_too` (the codes meaning "stored": OK, DUPLICATE) is its
    ``handle_type(schedule time, message id)`` instead; and whether all were. ``(list, all
    stored)``, or None where `decode_results` answers None."""
    cdef Py_ssize_t handles = 0
    cdef list results = results_of(payload, result_type, codes, handle_type, stored, stored_too, &handles)
    if results is None:
        return None
    return results, handles == len(results)


cdef list results_of(bytes payload, result_type, codes, handle_type, uint32_t stored, uint32_t stored_too,
                     Py_ssize_t *handles):
    """`decode_results`, and with a `handle_type`, `decode_handles`'s list (counting its handles
    into `handles`)."""
    cdef const uint8_t *buf = <const uint8_t *>(<char *>payload)
    cdef Py_ssize_t end = len(payload), pos = 4, id_at, text_at, text_len
    cdef Py_ssize_t last_at = -1, last_len = -1
    cdef uint32_t count, i, code
    cdef int64_t when
    cdef object text = None, code_obj, message_id
    cdef list results
    if end < 4:
        return None
    count = be32(buf)
    if <uint64_t>count * 12 > <uint64_t>(end - 4):
        return None
    results = []
    try:
        for i in range(count):
            if pos + 12 > end:
                return None
            code = be16(buf + pos)
            when = <int64_t>be64(buf + pos + 2)
            id_at = pos + 12
            text_at = id_at + be16(buf + pos + 10) + 4
            if text_at > end:
                return None
            text_len = be32(buf + text_at - 4)
            if text_len > end - text_at:
                return None
            # The same message text as the result before (every "stored"): decoded once.
            if text is None or text_len != last_len or memcmp(buf + text_at, buf + last_at, text_len) != 0:
                text = PyUnicode_DecodeUTF8(<const char *>buf + text_at, text_len, NULL)
                last_at, last_len = text_at, text_len
            message_id = PyUnicode_DecodeUTF8(<const char *>buf + id_at, text_at - 4 - id_at, NULL)
            if handle_type is not None and (code == stored or code == stored_too):
                results.append(tuple.__new__(handle_type, (when, message_id)))
                handles[0] += 1
                pos = text_at + text_len
                continue
            code_obj = codes.get(code)
            if code_obj is None:
                code_obj = code
            results.append(tuple.__new__(result_type, (code_obj, text, when, message_id)))
            pos = text_at + text_len
    except UnicodeDecodeError:
        return None
    return results if pos == end else None


cdef Py_ssize_t utf8_size(object text, Py_ssize_t limit) except -2:
    """The UTF-8 length of `text` (a str), -1 when over `limit` or not a str; raises for text
    that is not encodable (a lone surrogate)."""
    cdef Py_ssize_t n
    if type(text) is not str:
        return -1
    PyUnicode_AsUTF8AndSize(text, &n)
    return -1 if n > limit else n


def encode_items(items, item_type, time_kind_type):
    """The SEND request payload of `items` (`protocol._encode_send_request_py`, the reference), or
    None where that answers None: an item not of `item_type` (a tuple of id, subject, time spec,
    body, headers), text that is not str or not encodable, a field out of its range. Each item's
    fields are taken once, before any byte is written (`write_item`)."""
    cdef Py_ssize_t count, i, total = 4, n
    cdef object item, time, kind, headers, body, pairs
    cdef tuple row
    cdef int64_t time_value
    cdef list rows
    cdef bytes out
    cdef uint8_t *w
    cdef uint8_t *stop
    if type(items) is not list:
        items = list(items)
    count = len(items)
    if count > 0xFFFFFFFF:
        return None
    rows = [None] * count
    try:
        for i in range(count):  # checked and measured first, written after
            item = items[i]
            if type(item) is not item_type:
                return None
            row = <tuple>item
            time, body, headers = row[2], row[3], row[4]
            kind = time.kind
            if type(kind) is not time_kind_type or type(body) is not bytes or not isinstance(time.value, int):
                return None
            time_value = time.value  # OverflowError outside int64: the reference decides
            pairs = tuple(headers.items()) if len(headers) else ()
            if not 0 <= <long>kind <= 0xFF or len(<bytes>body) > 0xFFFFFFFF or len(<tuple>pairs) > 0xFFFF:
                return None
            n = item_size(row[0], row[1], <tuple>pairs, <bytes>body)
            if n < 0:
                return None
            total += n
            rows[i] = (<long>kind, time_value, row[0], row[1], pairs, body)
    except Exception:  # a lone surrogate, a value out of its field, an odd mapping: the reference decides
        return None
    out = PyBytes_FromStringAndSize(NULL, total)
    w = <uint8_t *><char *>out
    stop = w + total
    put32(w, <uint32_t>count)
    w += 4
    for i in range(count):
        row = <tuple>rows[i]
        w = write_item(w, row[0], row[1], row[2], row[3], <tuple>row[4], <bytes>row[5])
    assert w == stop
    return out


cdef Py_ssize_t item_size(object message_id, object subject, tuple pairs, bytes body) except -2:
    """The bytes a SEND item of these fields takes, or -1 for one no item carries: an id, subject,
    header key or value not a str or over 65,535 bytes of UTF-8. Raises for text that is not
    encodable (a lone surrogate)."""
    cdef Py_ssize_t total = ITEM_SIZE + len(body), n
    cdef object key, value, text
    for text in (message_id, subject):
        n = utf8_size(text, 0xFFFF)
        if n < 0:
            return -1
        total += n
    for key, value in pairs:
        for text in (key, value):
            n = utf8_size(text, 0xFFFF)
            if n < 0:
                return -1
            total += 2 + n
    return total


cdef uint8_t *write_item(uint8_t *w, int kind, int64_t time_value, object message_id, object subject,
                         tuple pairs, bytes body) except NULL:
    """One SEND item of these fields at `w`, its size measured by `item_size` already (the fields
    are immutable: they write what was measured); where the next one goes."""
    cdef const char *p
    cdef Py_ssize_t n, body_n = len(body)
    cdef uint8_t *w2
    cdef object key, value, text
    w[0] = <uint8_t>kind
    put64(w + 1, <uint64_t>time_value)
    p = PyUnicode_AsUTF8AndSize(message_id, &n)
    put16(w + 9, <uint32_t>n)
    memcpy(w + ITEM_SIZE, p, n)
    w2 = w + ITEM_SIZE + n
    p = PyUnicode_AsUTF8AndSize(subject, &n)
    put16(w + 11, <uint32_t>n)
    memcpy(w2, p, n)
    w2 += n
    put16(w + 13, <uint32_t>len(pairs))
    put32(w + 15, <uint32_t>body_n)
    for key, value in pairs:
        for text in (key, value):
            p = PyUnicode_AsUTF8AndSize(text, &n)
            put16(w2, <uint32_t>n)
            memcpy(w2 + 2, p, n)
            w2 += 2 + n
    memcpy(w2, <const char *>body, body_n)
    return w2 + body_n


cdef object new_id(const char *head, Py_ssize_t head_n, object counter):
    """`head` then the counter's next value's low 24 bits as six lowercase hex digits:
    `client.new_message_id`'s form, `head` being its first 22 hex digits (ASCII)."""
    cdef char buf[64]
    cdef uint32_t c = <uint32_t>(next(counter) & 0xFFFFFF)
    cdef int k
    memcpy(buf, head, head_n)
    for k in range(6):
        buf[head_n + 5 - k] = HEX[c & 0xF]
        c >>= 4
    return PyUnicode_DecodeASCII(buf, head_n + 6, NULL)


cdef const char *HEX = b"0123456789abcdef"


def encode_messages(list messages, message_type, id_head, counter, clock_ms, Py_ssize_t max_count,
                    Py_ssize_t max_frame, Py_ssize_t max_body, int kind_at, int kind_delay):
    """The SEND requests of a producer's `messages` (each of `message_type`, client.Message) in one
    pass, as `client._item` then `client._batches` then `protocol.encode_send_request` make them (the
    reference): a list of ``(payload, index of the first message, message count, message count)``
    (`AsyncProducer._requests_checked`'s shape: span and count, equal here), each request at
    most `max_count` messages and, unless it holds one message, `max_frame` bytes. Or None, before
    anything is sent, for any message the reference must decide: not exactly a `message_type`, a
    body not bytes or over `max_body`, a delay level, both a delivery time and a delay, a time not
    an int or outside int64, an id or subject not str or over 65,535 bytes of UTF-8, headers not a
    dict of str, a request over `max_frame`.

    A message without an id (None or "") gets a new one as `client.new_message_id` makes it:
    ``id_head(now_ms)`` (ASCII) then the low 24 bits of ``next(counter)`` in six hex digits,
    `now_ms` read from `clock_ms()` once in each run of 65,536 messages that makes an id. What is
    written is what was measured: each message's fields are taken once, into a row of immutable
    values (its headers as a tuple of pairs), before any byte is written."""
    cdef Py_ssize_t count = len(messages), i, n, size, first, last, total
    cdef object m, body, at, delay, message_id, subject, headers, pairs, head = None
    cdef const char *head_p = NULL
    cdef Py_ssize_t head_n = 0, head_block = -1
    cdef int64_t time_value
    cdef tuple row
    cdef list rows = [None] * count
    cdef list chunks = []
    cdef list out = []
    cdef bytes payload
    cdef uint8_t *w
    cdef uint8_t *stop
    cdef int kind
    try:
        for i in range(count):  # checked, given ids and measured first; cut and written after
            m = messages[i]
            if type(m) is not message_type:
                return None
            body = m.body
            if type(body) is not bytes or len(<bytes>body) > max_body or m.delay_level is not None:
                return None
            at, delay = m.deliver_at, m.delay
            if at is not None:
                if delay is not None or type(at) is not int:
                    return None
                kind, time_value = kind_at, at  # OverflowError outside int64
            elif delay is not None:
                if type(delay) is not int:
                    return None
                kind, time_value = kind_delay, delay
            else:
                kind, time_value = kind_delay, 0
            message_id, subject = m.message_id, m.subject
            if message_id is None or (type(message_id) is str and len(<str>message_id) == 0):
                if i >> 16 != head_block:  # the clock read once per 65,536 messages, as send_many's
                    head_block = i >> 16
                    head = id_head(clock_ms())
                    if type(head) is not str or not (<str>head).isascii() or len(<str>head) > 48:
                        return None
                    head_p = PyUnicode_AsUTF8AndSize(head, &head_n)
                message_id = new_id(head_p, head_n, counter)
            headers = m.headers
            if type(headers) is not dict:
                return None
            pairs = tuple((<dict>headers).items()) if headers else ()
            if len(<tuple>pairs) > 0xFFFF:
                return None
            n = item_size(message_id, subject, <tuple>pairs, <bytes>body)
            if n < 0:
                return None
            rows[i] = (message_id, subject, body, pairs, kind, time_value, n)
    except Exception:  # a lone surrogate, a time outside int64: the reference decides
        return None
    # Cut as client._batches cuts (SEND_REQUEST_OVERHEAD is the payload's count, four bytes).
    first, size = 0, 4
    for i in range(count):
        n = (<tuple>rows[i])[6]
        if i > first and (i - first == max_count or size + n > max_frame):
            chunks.append((first, i, size))
            first, size = i, 4
        size += n
    if count:
        chunks.append((first, count, size))
    for first, last, total in chunks:
        if total > max_frame:  # one message over the frame: the reference refuses it
            return None
    for first, last, total in chunks:
        payload = PyBytes_FromStringAndSize(NULL, total)
        w = <uint8_t *><char *>payload
        stop = w + total
        put32(w, <uint32_t>(last - first))
        w += 4
        for i in range(first, last):
            row = <tuple>rows[i]
            w = write_item(w, row[4], row[5], row[0], row[1], <tuple>row[3], <bytes>row[2])
        assert w == stop
        out.append((payload, first, last - first, last - first))
    return out

