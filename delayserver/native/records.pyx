# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Record-format kernels, compiled; each must equal its Python reference (tests/test_native.py
holds them side by side):

- `walk`: the replayer's pass over message_log records (`walk` in delayserver/replayer.py);
- `sequence_framed`: the sequencing in place of a request's framed records (the receiver's pass
  frames a send's, `record.frame_records` any other request's), at append (`sequence_framed` in
  delayserver/storage/record.py);
- `decode_scheduled`: a SCHEDULED payload decoded (`decode_scheduled` in
  delayserver/storage/record.py).

The walk reads record headers and heads by hand and writes each bucket's schedule_log records (header,
message_log offset, the message_log payload as it is, a crc over both) straight into one
bytearray per bucket, without an object per piece. Anything unusual (a record type it does not
know, a head too short, a cancel whose id is not UTF-8) makes it hand back None, and the Python
walk does the pass, raising what it raises.
"""
from cpython cimport array
import array
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.errno cimport EAGAIN, errno
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.errno cimport EINTR
from libc.stdlib cimport calloc, free, malloc, qsort
from libc.string cimport memcmp, memcpy
from posix.types cimport off_t
from delayserver.native.endian cimport be16, be32, be64, put32, put64
from delayserver.native.grow cimport reserve
from delayserver.native.tuples cimport PyObject_GC_IsTracked, PyObject_GC_UnTrack, new_tuple_of, set_item
from delayserver.native.layout cimport (
    HEADER_SIZE, OFFSET_SIZE, MESSAGE_HEAD_SIZE, CANCEL_HEAD_SIZE, TXN_PREFIX_SIZE,
    SCHEDULED_HEAD_SIZE, DELIVERED_HEAD_SIZE, DISPATCH_HEAD_SIZE, MAX_PAYLOAD_BYTES,
    MAX_HEADERS_BYTES, T_MESSAGE, T_CANCEL, T_SCHEDULED, T_SCHEDULED_CANCEL, T_DISPATCH,
    T_DELIVERED, T_EPOCH, T_PREPARE, T_COMMIT, T_ROLLBACK, T_TXN_CHECK, T_TXN_PARK, T_SCHEDULE,
)

cdef extern from "crc32c.h":
    void crc32c_init()
    uint32_t crc32c_update(uint32_t value, const uint8_t *p, size_t n)
    uint32_t crc32c_way(int way, uint32_t value, const uint8_t *p, size_t n) nogil
    int crc32c_hw
    enum:
        CRC32C_LONG
        CRC32C_SHORT

crc32c_init()

#: The part lengths of crc32c.h's three-stream blocks, and whether this processor runs them.
CRC32C_PARTS = (CRC32C_LONG, CRC32C_SHORT)
CRC32C_HARDWARE = crc32c_hw == 1


def crc32c_each_way(data, uint32_t value=0):
    """crc32c.h's crc of `data` from `value` computed each way it can: (three streams, one chain,
    the table), 0 for the first two on a processor without SSE4.2. For the tests, which hold each
    to the crc32c package."""
    cdef const uint8_t[::1] view = data
    cdef const uint8_t *p = NULL
    if view.shape[0]:
        p = &view[0]
    return tuple([crc32c_way(way, value, p, view.shape[0]) for way in range(3)])


def crc32c_rounds(data, Py_ssize_t rounds, int way=0):
    """crc32c.h's crc of `data` `rounds` times over in one way (0: three streams, 1: one chain, 2:
    the table), each round from the value the last gave: the loop `ops/bench crc` times, with no
    interpreter step between rounds. Returns the last value."""
    cdef const uint8_t[::1] view = data
    cdef const uint8_t *p = NULL
    cdef size_t n = view.shape[0]
    cdef uint32_t value = 0
    if n:
        p = &view[0]
    with nogil:
        for _ in range(rounds):
            value = crc32c_way(way, value, p, n)
    return value


cdef enum:
    SHARED_READ_BYTES = 1 << 16  # bucket_log.SHARED_READ_BYTES: the most one read of neighbours takes
    FIRST_READ_BYTES = 512       # the least a record read on its own reads first
    # Records read ahead at most this far apart share a read (read_ahead). Copying the bytes between
    # them costs about 0.26 us per KiB here, a read of its own 0.5 to 0.7 us: 8 KiB between two
    # records cost more than the read it saved (`fetch`'s CPU at 50,000 msg/s falling due, 5,000
    # records a round scattered over a segment: about a tenth less with 2 KiB than with 8).
    READ_AHEAD_GAP_BYTES = 2048

#: What the format constants above stand for, for the tests to compare with record.py.
FORMAT = dict(HEADER_SIZE=HEADER_SIZE, OFFSET_SIZE=OFFSET_SIZE, MESSAGE_HEAD_SIZE=MESSAGE_HEAD_SIZE,
              CANCEL_HEAD_SIZE=CANCEL_HEAD_SIZE, TXN_PREFIX_SIZE=TXN_PREFIX_SIZE, MESSAGE=T_MESSAGE,
              CANCEL=T_CANCEL, SCHEDULED=T_SCHEDULED, SCHEDULED_CANCEL=T_SCHEDULED_CANCEL, EPOCH=T_EPOCH,
              PREPARE=T_PREPARE, COMMIT=T_COMMIT, ROLLBACK=T_ROLLBACK, TXN_CHECK=T_TXN_CHECK,
              TXN_PARK=T_TXN_PARK, SCHEDULE=T_SCHEDULE, DISPATCH=T_DISPATCH, DELIVERED=T_DELIVERED,
              SCHEDULED_HEAD_SIZE=SCHEDULED_HEAD_SIZE, DELIVERED_HEAD_SIZE=DELIVERED_HEAD_SIZE,
              DISPATCH_HEAD_SIZE=DISPATCH_HEAD_SIZE, MAX_PAYLOAD_BYTES=MAX_PAYLOAD_BYTES,
              SHARED_READ_BYTES=SHARED_READ_BYTES, MAX_HEADERS_BYTES=MAX_HEADERS_BYTES)


cdef inline uint32_t type_seed(uint8_t rtype) noexcept:
    """The crc32c a record's checksum starts from: its type byte's (record._TYPE_CRC)."""
    return crc32c_update(0, &rtype, 1)


cdef inline void put_header(uint8_t *p, uint8_t rtype, uint32_t seed, const uint8_t *payload,
                            uint32_t length) noexcept:
    """The record header at `p` (crc, length, type) of the `length` bytes at `payload`."""
    put32(p, crc32c_update(seed, payload, length))
    put32(p + 4, length)
    p[8] = rtype


cdef inline bint is_transactional(int rtype) noexcept nogil:
    return rtype == T_PREPARE or rtype == T_COMMIT or rtype == T_ROLLBACK or rtype == T_TXN_CHECK or rtype == T_TXN_PARK


cdef dict bucket_sizes(const uint8_t *buf, Py_ssize_t n, Py_ssize_t base, Py_ssize_t limit, int64_t scale):
    """About what `walk` will write of each bucket (bucket -> bytes), from a look at the record
    headers only, so that each bucket's buffer is made its size at once instead of grown as it
    fills (growing may copy what it holds). What it leaves out (a schedule time below 0) is grown
    into by doubling (`grow.reserve`); what `walk` does not write (a record it stops before) is cut
    off at its end."""
    cdef dict sizes = {}
    cdef Py_ssize_t pos = 0, s, e, run_bytes = 0
    cdef int64_t sched, bucket, run_bucket = -1
    cdef int rtype
    while pos + HEADER_SIZE <= n and base + pos < limit:
        s = pos + HEADER_SIZE
        e = s + <Py_ssize_t>be32(buf + pos + 4)
        if e > n:
            break
        rtype = buf[pos + 8]
        if (rtype == T_MESSAGE or rtype == T_COMMIT or rtype == T_CANCEL) and s + 16 <= e:
            sched = <int64_t>be64(buf + s + 8)
            if sched >= 0:
                bucket = sched - sched % scale
                if bucket != run_bucket:  # (most passes: one bucket's records, one entry)
                    if run_bytes:
                        sizes[run_bucket] = sizes.get(run_bucket, 0) + run_bytes
                    run_bucket, run_bytes = bucket, 0
                run_bytes += HEADER_SIZE + OFFSET_SIZE + (e - s)
        pos = e
    if run_bytes:
        sizes[run_bucket] = sizes.get(run_bucket, 0) + run_bytes
    return sizes


def walk(data, Py_ssize_t base, Py_ssize_t limit, Py_ssize_t start_offset, int64_t scale, sizes_of,
         change_sequence, uint64_t max_sequence, bytes follow_prefix=None):
    """The replayer's walk (replayer.walk documents the arguments and the result), or None."""
    cdef const uint8_t[::1] view = data
    cdef const uint8_t *buf = &view[0] if view.shape[0] else NULL
    cdef Py_ssize_t n = view.shape[0]
    cdef Py_ssize_t pos = 0, s, e, off, end = start_offset, id_at, id_end, at, size, used = 0
    cdef uint32_t length, crc, seed_scheduled, seed_cancel, seed
    cdef int rtype, kind
    cdef Py_ssize_t head, id_len_at
    cdef bint hit, have_last = False
    cdef int64_t sched, bucket, last_bucket = 0, m
    cdef uint64_t seq
    cdef Py_ssize_t changes = 0, start = 0
    cdef bytearray arr = None
    cdef list bucket_ids = None
    cdef uint8_t *out
    cdef object mid, cancel_id, key, arr_key = None
    cdef dict run = None
    cdef list run_list = None
    cdef bint follow_all = follow_prefix is None
    cdef const char *prefix = NULL if follow_all else PyBytes_AS_STRING(follow_prefix)
    cdef Py_ssize_t prefix_len = 0 if follow_all else PyBytes_GET_SIZE(follow_prefix)
    per_bucket = {}
    ids = {}
    starts = {}
    filled = {}  # bucket -> the bytes of its buffer filled, but the current one's (`used`)
    runs = []
    txn_notes = []
    followed = []
    seed_scheduled = type_seed(T_SCHEDULED)
    seed_cancel = type_seed(T_SCHEDULED_CANCEL)
    if scale <= 0:
        return None  # (the Python walk says what it makes of it)
    expected = bucket_sizes(buf, n, base, limit, scale)
    while pos + HEADER_SIZE <= n:
        length = be32(buf + pos + 4)
        rtype = buf[pos + 8]
        s = pos + HEADER_SIZE
        e = s + length
        if e > n:
            break
        off = base + pos
        if off >= limit:
            break
        if rtype == T_SCHEDULE:
            seq = change_sequence(data, s)
            if seq > max_sequence:
                max_sequence = seq
            followed.append((rtype, s, e))
            changes += 1
            end = base + e
            pos = e
            continue
        if rtype == T_EPOCH:
            end = base + e
            pos = e
            continue
        # Every message_log payload starts store_time, schedule_time, sequence; MESSAGE (and COMMIT)
        # and CANCEL heads then give the id's length at `id_len_at`, the id following the head.
        if rtype == T_MESSAGE or rtype == T_COMMIT:
            head, id_len_at = MESSAGE_HEAD_SIZE, 26
        elif rtype == T_CANCEL:
            head, id_len_at = CANCEL_HEAD_SIZE, 24
        elif is_transactional(rtype):
            head, id_len_at = TXN_PREFIX_SIZE, -1
        else:
            return None  # not a message_log type: the Python walk reports it
        if s + head > n:
            return None
        sched = <int64_t>be64(buf + s + 8)
        seq = be64(buf + s + 16)
        if id_len_at < 0:  # the other transactional records: no id to index
            id_at = id_end = s
        else:
            id_at = s + head
            id_end = id_at + buf[s + id_len_at]
        if is_transactional(rtype):
            txn_notes.append((off, rtype, s, e))
            if rtype != T_COMMIT:  # a COMMIT is scheduled as a MESSAGE is, below
                if seq > max_sequence:
                    max_sequence = seq
                end = base + e
                pos = e
                continue
        m = sched % scale
        if m < 0:
            m += scale
        if sched < 0:  # sched - m may be below int64's range: Python's ints work it out
            key = <object>sched - <object>m
            hit = False
        else:
            bucket = sched - m
            hit = have_last and bucket == last_bucket
            if not hit:
                key = bucket
        if not hit:  # `key` is the bucket's int: the runs share it
            if arr is not None:
                filled[arr_key] = used
            arr = per_bucket.get(key)
            if arr is None:
                arr = per_bucket[key] = PyByteArray_FromStringAndSize(NULL, expected.get(key, 0))
                bucket_ids = ids[key] = []
                start = sizes_of(key)
                starts[key] = start
                used = 0
            else:
                bucket_ids = ids[key]
                start = starts[key]
                used = filled[key]
            arr_key = key
            have_last = sched >= 0
            last_bucket = bucket
        if rtype == T_CANCEL:
            kind, seed = T_SCHEDULED_CANCEL, seed_cancel
        else:
            kind, seed = T_SCHEDULED, seed_scheduled
        at = start + used
        size = HEADER_SIZE + OFFSET_SIZE + (e - s)
        out = reserve(arr, used, size)
        used += size
        put64(out + HEADER_SIZE, <uint64_t>off)
        memcpy(out + HEADER_SIZE + OFFSET_SIZE, buf + s, e - s)
        crc = crc32c_update(crc32c_update(seed, out + HEADER_SIZE, OFFSET_SIZE), buf + s, e - s)
        put32(out, crc)
        put32(out + 4, <uint32_t>(OFFSET_SIZE + (e - s)))
        out[8] = kind
        if id_end > e:
            id_end = e
        if id_end < id_at:
            id_end = id_at
        mid = PyBytes_FromStringAndSize(<const char *>buf + id_at, id_end - id_at)
        bucket_ids.append((at - start, kind, sched, mid))
        if rtype == T_CANCEL:
            try:
                cancel_id = PyUnicode_DecodeUTF8(<const char *>buf + id_at, id_end - id_at, NULL)
            except UnicodeDecodeError:
                return None
            runs.append((key, at, sched, cancel_id))
            run = None
        else:
            if run is None:
                run = {}
                runs.append(run)
                run_list = None
            if not hit or run_list is None:  # else the last record's list: same bucket, same run
                run_list = run.get(key)
                if run_list is None:
                    run_list = run[key] = []
            run_list.append((at, sched))
        if seq > max_sequence:
            max_sequence = seq
        if follow_all or (rtype == T_MESSAGE and id_end - id_at >= prefix_len
                          and memcmp(buf + id_at, prefix, prefix_len) == 0):
            followed.append((rtype, s, e))
        end = base + e
        pos = e
    if arr is not None:  # each buffer cut to what it was filled with (grown ahead: `reserve`)
        filled[arr_key] = used
    for key, arr in per_bucket.items():
        PyByteArray_Resize(arr, filled[key])
    return per_bucket, ids, runs, txn_notes, followed, end, max_sequence, changes


def sequence_framed(framed, Py_ssize_t count, uint64_t sequence):
    """`record.sequence_framed`: the `count` records of `framed` given their sequences from
    `sequence` on and their checksums, in place; returns their bytes. None, with nothing changed,
    for what it leaves to the reference (which raises for it): not a bytearray of `count` whole
    records of types message_log holds, each with room for its sequence; sequences past 2**64."""
    cdef Py_ssize_t n, pos = 0, i
    cdef uint8_t *p
    cdef uint32_t length
    cdef uint8_t rtype
    if type(framed) is not bytearray or count < 0:
        return None
    if count and sequence > 0xFFFFFFFFFFFFFFFF - <uint64_t>(count - 1):
        return None
    n = PyByteArray_GET_SIZE(framed)
    p = <uint8_t *>PyByteArray_AS_STRING(framed)
    for i in range(count):  # first the whole layout checked, so that a bad one changes nothing
        if n - pos < HEADER_SIZE:
            return None
        length = be32(p + pos + 4)
        rtype = p[pos + 8]
        if not (rtype == T_MESSAGE or rtype == T_CANCEL or rtype == T_SCHEDULE or is_transactional(rtype)) \
                or length < TXN_PREFIX_SIZE or <Py_ssize_t>length > n - pos - HEADER_SIZE:
            return None
        pos += HEADER_SIZE + length
    if pos != n:
        return None
    pos = 0
    for i in range(count):
        length = be32(p + pos + 4)
        rtype = p[pos + 8]
        put64(p + pos + HEADER_SIZE + 16, sequence)
        sequence += 1
        put_header(p + pos, rtype, type_seed(rtype), p + pos + HEADER_SIZE, length)
        pos += HEADER_SIZE + length
    return n


#: An empty array "Q" (64-bit keys) that `array.clone` copies the type of.
cdef array.array KEYS_TEMPLATE = array.array("Q")
assert KEYS_TEMPLATE.itemsize == 8

cdef enum:
    OFFSET_BITS = 40  # id_index.OFFSET_BITS: a key is a hash or a time above a segment offset
    HASH_MASK = 0xFFFFFF  # id_index.HASH_MASK


cdef bint key_fields(object item, Py_ssize_t pos, Py_ssize_t *at, int64_t *sched):
    """`at` and `sched` of an ids entry ``(offset, type, schedule time, message id)``; false for an
    entry the kernels leave to the reference (not such a tuple, a field out of range, an offset
    past the key's)."""
    cdef tuple entry
    if type(item) is not tuple or len(<tuple>item) != 4:
        return False
    entry = <tuple>item
    if not isinstance(entry[0], int) or not isinstance(entry[1], int) or not isinstance(entry[2], int):
        return False
    try:
        at[0] = entry[0]
        sched[0] = entry[2]
    except OverflowError:
        return False
    return 0 <= at[0] and pos + at[0] < (<Py_ssize_t>1 << OFFSET_BITS)


def id_keys(list ids, Py_ssize_t pos):
    """The id index keys of the records an append at `pos` added, from their `ids` (as the walk
    gives them): `IdIndex._add_ids`'s keys, in an array "Q" (no int object per key: the index's
    arrays take them with one copy), or None for ids it leaves to it (a message id that is not
    bytes, a field out of range, an offset past the key's)."""
    cdef Py_ssize_t count = len(ids), n = 0
    cdef array.array out = array.clone(KEYS_TEMPLATE, count, zero=False)
    cdef uint64_t *keys = <uint64_t *>out.data.as_voidptr
    cdef object mid
    cdef int64_t sched
    cdef Py_ssize_t at
    cdef uint32_t crc
    cdef uint64_t h
    for item in ids:
        if not key_fields(item, pos, &at, &sched):
            return None
        mid = (<tuple>item)[3]
        if type(mid) is not bytes:
            return None
        crc = crc32c_update(<uint32_t>(<uint64_t>sched & 0xFFFFFFFF), <const uint8_t *><char *>mid, len(<bytes>mid))
        h = (<uint64_t>(<int64_t>crc ^ (sched >> 32))) & HASH_MASK
        keys[n] = (h << OFFSET_BITS) | <uint64_t>(pos + at)
        n += 1
    return out


def time_keys(list ids, Py_ssize_t pos, int64_t scale):
    """The time index keys of the SCHEDULED records an append at `pos` added, from their `ids`:
    `TimeIndex._add_ids`'s keys, in an array "Q", or None for what it leaves to it."""
    cdef Py_ssize_t count = len(ids), n = 0
    cdef array.array out
    cdef uint64_t *keys
    cdef int64_t sched, m
    cdef Py_ssize_t at
    if scale <= 0:
        return None
    out = array.clone(KEYS_TEMPLATE, count, zero=False)
    keys = <uint64_t *>out.data.as_voidptr
    for item in ids:
        if not key_fields(item, pos, &at, &sched):
            return None
        if (<tuple>item)[1] != T_SCHEDULED:
            continue
        m = sched % scale
        if m < 0:
            m += scale
        keys[n] = (<uint64_t>m << OFFSET_BITS) | <uint64_t>(pos + at)
        n += 1
    if n < count:
        array.resize(out, n)
    return out


# --- reading due messages -------------------------------------------------------------------------

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t preadv2(int fd, const iovec *iov, int iovcnt, off_t offset, int flags)
    int RWF_NOWAIT

cdef struct Wanted:
    int64_t offset
    Py_ssize_t index


cdef inline bint as_offset(object item, int64_t *into):
    """`item` as a segment offset, into `into`; False when it is not one (not an int, negative,
    too big): the caller leaves the call to the reference."""
    if type(item) is not int:
        return False
    try:
        into[0] = item
    except OverflowError:
        return False
    return into[0] >= 0


cdef int by_offset(const void *a, const void *b) noexcept nogil:
    cdef const Wanted *x = <const Wanted *>a
    cdef const Wanted *y = <const Wanted *>b
    if x.offset != y.offset:
        return -1 if x.offset < y.offset else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


# What a read answers: all of the range read, some of it not in the page cache, or an error the
# reference must meet itself (the kernel then answers None for the whole call).
cdef enum:
    READ_WHOLE = 1
    READ_NOT_CACHED = 0
    READ_ERROR = -1


cdef int read_nowait(int fd, uint8_t *into, int64_t start, int64_t end) noexcept nogil:
    """`BucketLog.read_cached` of [start, end) into `into`: a page-cache-only read (RWF_NOWAIT)."""
    cdef iovec iov
    cdef ssize_t n
    iov.iov_base = into
    iov.iov_len = <size_t>(end - start)
    n = preadv2(fd, &iov, 1, <off_t>start, RWF_NOWAIT)
    if n < 0:
        return READ_NOT_CACHED if errno == EAGAIN else READ_ERROR
    return READ_WHOLE if n == end - start else READ_NOT_CACHED


cdef object headers_of(const uint8_t *p, Py_ssize_t end):
    """`record.decode_headers` of the headers block at `p` (`end` bytes): the dict, or None where the
    reference raises (a block that does not add up to its length, text that is not UTF-8)."""
    cdef Py_ssize_t pos = 0, key_at, value_len_at, value_at
    cdef dict headers = {}
    while pos < end:
        key_at = pos + 2
        if key_at > end:
            return None
        value_len_at = key_at + (p[pos] << 8 | p[pos + 1])
        value_at = value_len_at + 2
        if value_at > end:
            return None
        pos = value_at + (p[value_len_at] << 8 | p[value_len_at + 1])
        if pos > end:
            return None
        try:
            headers[PyUnicode_DecodeUTF8(<const char *>(p + key_at), value_len_at - key_at, NULL)] = \
                PyUnicode_DecodeUTF8(<const char *>(p + value_at), pos - value_at, NULL)
        except UnicodeDecodeError:
            return None
    return headers


#: The subject of the last due message decoded: the next one's, when its bytes are the same, is
#: this very string (most due messages share their subject with the one before), so that no
#: string is made and freed for it, and its hash, taken where it is routed and encoded, is kept.
cdef object last_subject = None


cdef object message_at(const uint8_t *q, Py_ssize_t plen, object message_type, uint64_t *mlo):
    """The Message of the SCHEDULED payload at `q` (`plen` bytes), its message_log offset put in
    `mlo`; False for what the kernel leaves to the reference: fields that do not add up, text that
    is not UTF-8, headers that do not decode."""
    global last_subject
    cdef Py_ssize_t known_len
    cdef const char *known
    cdef uint64_t seq
    cdef int64_t store, sched
    cdef uint32_t flags, idlen, slen, hlen, blen
    cdef const uint8_t *id_at
    if plen < SCHEDULED_HEAD_SIZE:
        return False
    mlo[0] = be64(q)
    store = <int64_t>be64(q + 8)
    sched = <int64_t>be64(q + 16)
    seq = be64(q + 24)
    flags = be16(q + 32)
    idlen = q[34]
    slen = q[35]
    hlen = be32(q + 36)
    blen = be32(q + 40)
    if <uint64_t>SCHEDULED_HEAD_SIZE + idlen + slen + hlen + blen != <uint64_t>plen:
        return False
    id_at = q + SCHEDULED_HEAD_SIZE
    subject = None
    if last_subject is not None:
        known = PyUnicode_AsUTF8AndSize(last_subject, &known_len)
        if known_len == slen and memcmp(known, id_at + idlen, slen) == 0:
            subject = last_subject
    try:
        mid = PyUnicode_DecodeUTF8(<const char *>id_at, idlen, NULL)
        if subject is None:
            subject = PyUnicode_DecodeUTF8(<const char *>(id_at + idlen), slen, NULL)
            last_subject = subject
    except UnicodeDecodeError:
        return False  # the reference raises what it raises
    headers = headers_of(id_at + idlen + slen, hlen)
    if headers is None:
        return False
    body = PyBytes_FromStringAndSize(<const char *>(id_at + idlen + slen + hlen), blen)
    if (<PyTypeObject *>message_type).tp_base != <PyTypeObject *>tuple:  # (not the named tuple: as its __new__ would)
        return tuple.__new__(message_type, (mid, subject, body, sched, headers, store, seq, flags))
    # The named tuple made as its __new__ makes it, without a tuple of the fields made for it first.
    message = new_tuple_of(message_type, 8)
    set_item(message, 0, mid)
    set_item(message, 1, subject)
    set_item(message, 2, body)
    set_item(message, 3, sched)
    set_item(message, 4, headers)
    set_item(message, 5, store)
    set_item(message, 6, seq)
    set_item(message, 7, flags)
    if not PyObject_GC_IsTracked(headers):
        # Nothing in it can hold a reference back to it (strings, bytes, ints and a dict of
        # strings): out of the collector's generations. CPython untracks only plain tuples, and
        # only those holding no dict or other container, and a message lives until its delivery
        # is durable: the collector would walk it in every collection of its generation till then.
        PyObject_GC_UnTrack(message)
    return message


cdef object due_message(const uint8_t *p, Py_ssize_t length, uint32_t seed, object bucket, object offset,
                        object message_type):
    """`_message_of(bucket, offset, record)` of the whole record at `p` (`length` bytes, header
    included), or False for what the kernel leaves to the reference: a type other than SCHEDULED,
    a crc that does not match, and what `message_at` leaves to it."""
    cdef uint32_t plen
    cdef uint64_t mlo
    if length < HEADER_SIZE or p[8] != T_SCHEDULED:
        return False
    plen = be32(p + 4)
    if HEADER_SIZE + <Py_ssize_t>plen != length:
        return False
    if crc32c_update(seed, p + HEADER_SIZE, plen) != be32(p):
        return False
    message = message_at(p + HEADER_SIZE, plen, message_type, &mlo)
    if message is False:
        return False
    read = (bucket, offset, mlo, message)
    if not PyObject_GC_IsTracked(message):
        PyObject_GC_UnTrack(read)  # (ints and the message above: nothing to walk)
    return read


def decode_scheduled(buf, Py_ssize_t start, Py_ssize_t end, object message_type):
    """`record.decode_scheduled` of the SCHEDULED payload at ``buf[start:end]`` (bytes or a
    bytearray): ``(message_log offset, Message)``. None for what it leaves to the reference, which
    raises for it: another kind of buffer, a span outside `buf`, and what `message_at` leaves."""
    cdef const uint8_t *p
    cdef Py_ssize_t n
    cdef uint64_t mlo
    if type(buf) is bytes:
        p, n = <const uint8_t *>PyBytes_AS_STRING(buf), PyBytes_GET_SIZE(buf)
    elif type(buf) is bytearray:
        p, n = <const uint8_t *>PyByteArray_AS_STRING(buf), PyByteArray_GET_SIZE(buf)
    else:
        return None
    if not 0 <= start <= end <= n:
        return None
    message = message_at(p + start, end - start, message_type, &mlo)
    if message is False:
        return None
    return (mlo, message)


def read_scheduled(int fd, int64_t size, list offsets, Py_ssize_t guess, object bucket, object message_type,
                   list ahead=None):
    """The due messages at `offsets` of one schedule_log segment (`fd`, `size` bytes long), read
    from the page cache only: per offset what `TickManager.read_messages(..., cached_only=True)`
    answers for it, (bucket, offset, message_log offset, Message) or None (not all in the page
    cache), or False for a record it leaves to the reference (damaged, or anything unusual: the
    reference reads it again and raises or reports what it does). None for the whole call on an
    error the reference must meet (a read the file system refuses, an offset that is not one).

    As `BucketLog.read_records_at`: offsets near each other share one read of at most
    SHARED_READ_BYTES; a record it does not hold whole is read on its own (a first read of the
    biggest record's size so far, FIRST_READ_BYTES up to `guess`, then the whole record).

    `ahead`, when given, holds per offset the bytes `read_ahead` read of it in a worker thread, or
    None: a record held there whole and sound is decoded from them, without a read; anything else
    is read from the file (so that damage is met, and reported, where it is)."""
    cdef Py_ssize_t total = len(offsets), n = 0, i, j, k, cap
    cdef Wanted *wanted = NULL
    cdef uint8_t *buf = NULL
    cdef uint8_t *one
    cdef uint8_t *rec
    cdef int64_t first, last, off, end, run_end, at, rsize
    cdef int got
    cdef bint shared
    cdef Py_ssize_t single = min(guess, FIRST_READ_BYTES)
    cdef uint32_t seed = type_seed(T_SCHEDULED)
    cdef list out = [None] * total
    cdef object held
    if guess < HEADER_SIZE or size < 0 or (ahead is not None and len(ahead) != total):
        return None
    if total == 0:
        return out
    wanted = <Wanted *>malloc(total * sizeof(Wanted))
    # A run's shared read, then (not to overwrite it) room for the read of one record.
    cap = SHARED_READ_BYTES + guess
    buf = <uint8_t *>malloc(cap + guess)
    one = buf + cap
    try:
        if wanted == NULL or buf == NULL:
            raise MemoryError()
        for k in range(total):  # the records to read: those `ahead` does not hold
            item = offsets[k]
            if not as_offset(item, &wanted[n].offset):
                return None
            if ahead is not None:
                held = ahead[k]
                if type(held) is bytes:
                    got_ahead = due_message(<const uint8_t *>PyBytes_AS_STRING(held), PyBytes_GET_SIZE(held), seed,
                                            bucket, item, message_type)
                    if got_ahead is not False:
                        out[k] = got_ahead
                        continue
            wanted[n].index = k
            n += 1
        qsort(wanted, n, sizeof(Wanted), by_offset)
        i = 0
        while i < n:
            first = last = wanted[i].offset
            j = i + 1
            while j < n:
                off = wanted[j].offset
                if off - last > guess or off + guess - first > SHARED_READ_BYTES:
                    break
                last = off
                j += 1
            shared = False
            run_end = min(last + guess, size)
            if j - i > 1 and run_end > first:
                got = read_nowait(fd, buf, first, run_end)
                if got == READ_ERROR:
                    return None
                if got == READ_NOT_CACHED:
                    i = j  # the whole run is left to a read that may wait (None each)
                    continue
                shared = True
            for k in range(i, j):
                off = wanted[k].offset
                item = offsets[wanted[k].index]
                if shared:
                    at = off - first
                    if at + HEADER_SIZE <= run_end - first:
                        rsize = HEADER_SIZE + <int64_t>be32(buf + at + 4)
                        if at + rsize <= run_end - first:
                            out[wanted[k].index] = due_message(buf + at, rsize, seed, bucket, item, message_type)
                            continue
                # On its own, as `_record_at`: a first read, then the whole record if bigger. The
                # first read is not all of `guess` (most records are far smaller: a page copied
                # per record cost a quarter of the kernel's time) but the size of the biggest
                # record read so far, from FIRST_READ_BYTES up.
                end = min(off + single, size)
                if end - off < HEADER_SIZE:
                    out[wanted[k].index] = False
                    continue
                got = read_nowait(fd, one, off, end)
                if got == READ_ERROR:
                    return None
                if got == READ_NOT_CACHED:
                    continue  # None
                if one[8] != T_SCHEDULED or be32(one + 4) > MAX_PAYLOAD_BYTES:
                    out[wanted[k].index] = False
                    continue
                rsize = HEADER_SIZE + <int64_t>be32(one + 4)
                if rsize > single:
                    single = min(guess, (rsize + FIRST_READ_BYTES - 1) // FIRST_READ_BYTES * FIRST_READ_BYTES)
                rec = one
                if rsize > end - off:
                    if off + rsize > size:
                        out[wanted[k].index] = False  # cut short
                        continue
                    rec = <uint8_t *>malloc(rsize)
                    if rec == NULL:
                        raise MemoryError()
                    try:
                        got = read_nowait(fd, rec, off, off + rsize)
                        if got == READ_ERROR:
                            return None
                        if got == READ_WHOLE:
                            out[wanted[k].index] = due_message(rec, rsize, seed, bucket, item, message_type)
                    finally:
                        free(rec)
                    continue
                out[wanted[k].index] = due_message(rec, rsize, seed, bucket, item, message_type)
            i = j
        return out
    finally:
        free(wanted)
        free(buf)


cdef extern from "<unistd.h>" nogil:
    ssize_t pread(int fd, void *buf, size_t count, off_t offset)


cdef int64_t read_fully(int fd, uint8_t *into, int64_t start, int64_t end) noexcept nogil:
    """pread of [start, end) until all of it, the end of the file (fewer bytes), or an error (-1)."""
    cdef int64_t done = 0
    cdef ssize_t n
    while start + done < end:
        n = pread(fd, into + done, <size_t>(end - start - done), <off_t>(start + done))
        if n < 0:
            if errno == EINTR:
                continue
            return -1
        if n == 0:
            break
        done += n
    return done


cdef struct Ahead:
    Wanted key       # first: `by_offset` sorts these too
    int64_t at       # where its bytes start in the slab
    int64_t length   # its length (header included); 0: none
    uint8_t *own     # its own buffer (a record bigger than the first read), or NULL


cdef Py_ssize_t run_end(const Ahead *want, Py_ssize_t i, Py_ssize_t n, int64_t first_read,
                        int64_t gap) noexcept nogil:
    """The end (exclusive) of the run of neighbours that starts at `want[i]`: records at most
    `gap` apart, read together in at most SHARED_READ_BYTES."""
    cdef int64_t first = want[i].key.offset, last = first
    cdef Py_ssize_t j = i + 1
    while j < n and want[j].key.offset - last <= gap \
            and want[j].key.offset + first_read - first <= SHARED_READ_BYTES:
        last = want[j].key.offset
        j += 1
    return j


cdef struct HeldSlot:
    int64_t key       # an offset; EMPTY_KEY: a free slot
    PyObject *value   # a reference of its own (the record's bytes); NULL in a free slot


cdef enum:
    EMPTY_KEY = -1
    HELD_MIN_SLOTS = 16


cdef inline uint64_t held_home(int64_t key, int shift) noexcept nogil:
    """A key's first slot (Fibonacci hashing: offsets a record apart spread over the table)."""
    return (<uint64_t>key * <uint64_t>0x9E3779B97F4A7C15) >> shift


cdef class HeldRecords:
    """One bucket's records read ahead, {offset: bytes} (`ReadAhead.records[bucket]` where this is
    built; a dict otherwise, which is what it must behave as: tests/test_native.py).

    An open-addressing table of (offset, bytes) pairs, at most half full, probed linearly. The
    event loop takes tens of thousands of records a second out of it, each put there about a second
    earlier and cold in the processor's caches by then: a dict's lookup of an int key compares the
    key object stored there (a read and a count written in another cold line, and a free when it
    is popped); here the offset is in the slot."""

    cdef HeldSlot *slots
    cdef Py_ssize_t size, count
    cdef int shift

    def __cinit__(self):
        self.slots = NULL
        self.count = 0
        self._allocate(HELD_MIN_SLOTS)

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.slots != NULL:
            for i in range(self.size):
                if self.slots[i].value != NULL:
                    Py_DECREF(<object>self.slots[i].value)
            free(self.slots)

    cdef int _allocate(self, Py_ssize_t size) except -1:
        cdef HeldSlot *slots = <HeldSlot *>malloc(size * sizeof(HeldSlot))
        cdef Py_ssize_t i
        if slots == NULL:
            raise MemoryError()
        for i in range(size):
            slots[i].key = EMPTY_KEY
            slots[i].value = NULL
        self.slots = slots
        self.size = size
        self.shift = 64
        while size > 1:
            self.shift -= 1
            size >>= 1
        return 0

    cdef Py_ssize_t _find(self, int64_t key) noexcept:
        """The slot holding `key`, or -1."""
        cdef Py_ssize_t mask = self.size - 1
        cdef Py_ssize_t i = <Py_ssize_t>held_home(key, self.shift)
        while self.slots[i].key != EMPTY_KEY:
            if self.slots[i].key == key:
                return i
            i = (i + 1) & mask
        return -1

    cdef int _grow(self) except -1:
        cdef HeldSlot *old = self.slots
        cdef Py_ssize_t old_size = self.size, i, j, mask
        self._allocate(old_size * 2)
        mask = self.size - 1
        for i in range(old_size):
            if old[i].key != EMPTY_KEY:
                j = <Py_ssize_t>held_home(old[i].key, self.shift)
                while self.slots[j].key != EMPTY_KEY:
                    j = (j + 1) & mask
                self.slots[j] = old[i]
        free(old)
        return 0

    cdef Py_ssize_t _slot_for(self, int64_t key) except -1:
        """The slot holding `key`, or the free one it would go in (the table grown first if one
        more would make it over half full)."""
        cdef Py_ssize_t i, mask
        if 2 * (self.count + 1) > self.size:
            self._grow()
        mask = self.size - 1
        i = <Py_ssize_t>held_home(key, self.shift)
        while self.slots[i].key != EMPTY_KEY and self.slots[i].key != key:
            i = (i + 1) & mask
        return i

    cdef void _fill(self, Py_ssize_t i, int64_t key, object value) noexcept:
        """Hold `value` at `key` in slot `i` (from `_slot_for`), replacing what was there."""
        Py_INCREF(value)
        if self.slots[i].key == key:
            Py_DECREF(<object>self.slots[i].value)
        else:
            self.slots[i].key = key
            self.count += 1
        self.slots[i].value = <PyObject *>value

    cdef object take(self, int64_t key):
        """The value at `key`, taken out, or None (the slots after it moved back: no tombstones)."""
        cdef Py_ssize_t i = self._find(key), j, mask = self.size - 1, home
        cdef object value
        if i < 0:
            return None
        value = <object>self.slots[i].value  # (a reference of its own: the slot's is dropped below)
        Py_DECREF(value)
        self.count -= 1
        j = i
        while True:
            j = (j + 1) & mask
            if self.slots[j].key == EMPTY_KEY:
                break
            home = <Py_ssize_t>held_home(self.slots[j].key, self.shift)
            if ((j - home) & mask) >= ((j - i) & mask):  # its probe passes i: it may move there
                self.slots[i] = self.slots[j]
                i = j
        self.slots[i].key = EMPTY_KEY
        self.slots[i].value = NULL
        return value

    cdef int64_t key_of(self, object key) except -2:
        """`key` as an offset; -1 for what cannot be one (held nowhere)."""
        cdef int64_t k
        return k if as_offset(key, &k) else -1

    # --- as a dict of them ------------------------------------------------------------------------

    def __len__(self):
        return self.count

    def __contains__(self, key):
        cdef int64_t k = self.key_of(key)
        return k >= 0 and self._find(k) >= 0

    def __getitem__(self, key):
        cdef int64_t k = self.key_of(key)
        cdef Py_ssize_t i = self._find(k) if k >= 0 else -1
        if i < 0:
            raise KeyError(key)
        return <object>self.slots[i].value

    def __setitem__(self, key, value):
        cdef int64_t k = self.key_of(key)
        if k < 0:
            raise TypeError(f"a held record's key is a segment offset, not {key!r}")
        if type(value) is not bytes:
            raise TypeError(f"a held record is bytes, not {type(value).__name__}")
        self._fill(self._slot_for(k), k, value)

    def get(self, key, default=None):
        cdef int64_t k = self.key_of(key)
        cdef Py_ssize_t i = self._find(k) if k >= 0 else -1
        return <object>self.slots[i].value if i >= 0 else default

    def keys(self):
        cdef Py_ssize_t i
        return [self.slots[i].key for i in range(self.size) if self.slots[i].key != EMPTY_KEY]

    def values(self):
        cdef Py_ssize_t i
        return [<object>self.slots[i].value for i in range(self.size) if self.slots[i].key != EMPTY_KEY]

    def items(self):
        cdef Py_ssize_t i
        return [(self.slots[i].key, <object>self.slots[i].value) for i in range(self.size)
                if self.slots[i].key != EMPTY_KEY]

    def __iter__(self):
        return iter(self.keys())

    def __repr__(self):
        return f"HeldRecords({dict(self.items())!r})"


cdef extern from *:
    """
    #define DS_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
    """
    void DS_PREFETCH(const void *p) noexcept nogil


cdef enum:
    # The lines of a held record's bytes object asked of memory ahead of its take: its header
    # and the record's first 352 bytes (a message of a 256-byte body, header included, whole).
    PREFETCH_LINES = 6


def ahead_take(HeldRecords held, list offsets):
    """`_take_py` (delayserver/wheel/read_ahead.py) on one bucket's `held` records: per offset the
    bytes held for it (taken out) or None, with how many were found and their bytes,
    ``(got, found, freed)``.

    What it takes was put there about a second earlier, by another thread, and is cold in the
    processor's caches: one miss after another for each record's slot, then its bytes object,
    then (decoding it) its bytes. So the batch's slots are asked of memory first, all of them, and
    then the records they hold, before any is taken: the misses overlap, and the bytes are in the
    cache when the record is decoded."""
    cdef Py_ssize_t k, n = len(offsets), found = 0, freed = 0, i, line
    cdef list got = [None] * n
    cdef object data
    cdef int64_t key
    cdef const char *obj
    for k in range(n):
        if as_offset(offsets[k], &key):
            DS_PREFETCH(&held.slots[held_home(key, held.shift)])
    for k in range(n):
        if as_offset(offsets[k], &key):
            i = held._find(key)
            if i >= 0:
                obj = <const char *>held.slots[i].value
                for line in range(PREFETCH_LINES):
                    DS_PREFETCH(obj + 64 * line)
    # (Each take finds its slot again: a take moves the slots after the one it empties back.)
    for k in range(n):
        if not as_offset(offsets[k], &key):
            continue
        data = held.take(key)
        if data is not None:
            got[k] = data
            found += 1
            freed += PyBytes_GET_SIZE(data)
    return got, found, freed


def ahead_put(HeldRecords held, dict records, Py_ssize_t room):
    """`_keep_py` (delayserver/wheel/read_ahead.py) into one bucket's `held`: each of `records` not
    held yet, in order, while their bytes fit in `room` (the first that does not fit ends it);
    returns ``(kept, their bytes)``. Raises TypeError for a key that is not an offset or a record
    that is not bytes (what was kept before it stays)."""
    cdef Py_ssize_t kept = 0, added = 0, size, i
    cdef object offset, data
    cdef int64_t key
    for offset, data in records.items():
        if not as_offset(offset, &key):
            raise TypeError(f"a held record's key is a segment offset, not {offset!r}")
        if type(data) is not bytes:
            raise TypeError(f"a held record is bytes, not {type(data).__name__}")
        i = held._slot_for(key)
        if held.slots[i].key == key:
            continue
        size = PyBytes_GET_SIZE(data)
        if added + size > room:
            break
        held._fill(i, key, data)
        added += size
        kept += 1
    return kept, added


cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset)
    int munmap(void *addr, size_t length)
    int PROT_READ
    int MAP_SHARED
    void *MAP_FAILED


cdef extern from "<sys/stat.h>" nogil:
    cdef struct stat:
        off_t st_size
        unsigned long st_dev
        unsigned long st_ino
    int fstat(int fd, stat *buf)


cdef class SegmentMap:
    """A read-only mapping of one schedule_log segment, kept from one read-ahead round to the next
    (`read_ahead(..., mapped=)`): each page of it costs a page fault once, not a read per record
    each round.

    `length` may run past the end of the file (it grows); only the bytes the file holds may be
    touched, and only while it cannot be truncated: a page past the end of its file is a SIGBUS
    (`read_mapped`). `key` names the file it maps, (device, inode): a segment removed and made
    again is mapped again, and a descriptor of another file is read, not copied from this.
    Unmapped when the object goes."""
    cdef const uint8_t *addr
    cdef readonly int64_t length
    cdef unsigned long dev, ino

    def __cinit__(self, int fd, int64_t length):
        cdef void *addr
        cdef stat st
        self.addr = NULL
        if length <= 0:
            raise ValueError("a segment map's length is positive")
        if fstat(fd, &st) != 0:
            raise OSError(errno, "fstat of a schedule_log segment failed")
        self.dev, self.ino = st.st_dev, st.st_ino
        with nogil:
            addr = mmap(NULL, <size_t>length, PROT_READ, MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            raise OSError(errno, "mmap of a schedule_log segment failed")
        self.addr = <const uint8_t *>addr
        self.length = length

    @property
    def key(self):
        return (self.dev, self.ino)

    def __dealloc__(self):
        cdef void *addr = <void *>self.addr
        self.addr = NULL
        if addr != NULL:
            with nogil:
                munmap(addr, <size_t>self.length)


cdef uint8_t *read_mapped(int fd, int64_t size, SegmentMap segment_map, Ahead *want, Py_ssize_t n,
                          int64_t max_record) noexcept nogil:
    """`read_ahead`'s reads from `segment_map` (a mapping of the segment `fd` is open on; `want`
    sorted by offset): each record's bytes copied into one slab (returned, malloc'ed; `at` and
    `length` set in `want`), without a read per record. NULL when the file could not be looked
    at, is not the one mapped, or the slab could not be had (every `length` 0: the caller reads
    instead).

    Only for a caller that keeps the file from being truncated meanwhile (a mapping's page past
    the end of its file is a SIGBUS): `fetch` in delayserver/wheel/prefetch.py holds the lock
    `BucketLog.truncate` takes. `size` is clamped to what the file holds now, so a file shortened
    before the lock was taken is read only as far as it goes."""
    cdef stat st
    cdef int64_t total = 0, off, rsize, used = 0
    cdef Py_ssize_t k
    cdef uint8_t *slab
    cdef const uint8_t *mapped = segment_map.addr
    if fstat(fd, &st) != 0 or st.st_dev != segment_map.dev or st.st_ino != segment_map.ino:
        return NULL
    if st.st_size < size:
        size = st.st_size
    if segment_map.length < size:
        size = segment_map.length
    for k in range(n):
        off = want[k].key.offset
        if off + HEADER_SIZE > size:
            break  # (sorted: none after it either)
        rsize = HEADER_SIZE + <int64_t>be32(mapped + off + 4)
        if rsize <= max_record and off + rsize <= size:
            want[k].length = rsize
            total += rsize
    slab = <uint8_t *>malloc(total if total > 0 else 1)
    if slab == NULL:
        for k in range(n):
            want[k].length = 0
        return NULL
    for k in range(n):
        if want[k].length:
            memcpy(slab + used, mapped + want[k].key.offset, <size_t>want[k].length)
            want[k].at = used
            used += want[k].length
    return slab


cdef uint8_t *read_runs(int fd, int64_t size, Ahead *want, Py_ssize_t n, int64_t first_read,
                        int64_t max_record, int64_t gap) noexcept nogil:
    """`read_ahead`'s reads (`want` sorted by offset): the runs of neighbours, each one read into
    one slab (returned, malloc'ed; NULL when there is no memory for it), each record found whole
    given its `at` and `length` there, or its own buffer (`own`) when it is bigger than its first
    read."""
    cdef Py_ssize_t i = 0, j, k
    cdef int64_t slab_size = 0, used = 0, first, end, got, at, rsize, off
    cdef uint8_t *slab
    while i < n:
        j = run_end(want, i, n, first_read, gap)
        slab_size += max(0, min(want[j - 1].key.offset + first_read, size) - want[i].key.offset)
        i = j
    slab = <uint8_t *>malloc(max(slab_size, 1))
    if slab == NULL:
        return NULL
    i = 0
    while i < n:
        j = run_end(want, i, n, first_read, gap)
        first = want[i].key.offset
        end = min(want[j - 1].key.offset + first_read, size)
        got = read_fully(fd, slab + used, first, end) if end > first else 0
        if got > 0:
            for k in range(i, j):
                off = want[k].key.offset
                at = off - first
                if at + HEADER_SIZE > got:
                    continue
                rsize = HEADER_SIZE + <int64_t>be32(slab + used + at + 4)
                if rsize > max_record or off + rsize > size:
                    continue
                if at + rsize <= got:
                    want[k].at = used + at
                    want[k].length = rsize
                    continue
                want[k].own = <uint8_t *>malloc(rsize)
                if want[k].own == NULL:
                    continue
                if read_fully(fd, want[k].own, off, off + rsize) == rsize:
                    want[k].length = rsize
                else:
                    free(want[k].own)
                    want[k].own = NULL
            used += got
        i = j
    return slab


def read_ahead(int fd, int64_t size, list offsets, Py_ssize_t first_read, Py_ssize_t max_record,
               int64_t gap=READ_AHEAD_GAP_BYTES, SegmentMap mapped=None):
    """{offset: the bytes of the record there} for the offsets of `offsets` (one schedule_log
    segment: `fd`, `size` bytes) that hold one: header included, as the file holds them (not
    checked: `read_scheduled` checks what it decodes). An offset is left out where the length
    there runs past `size` or over `max_record` bytes, or a read fails. `_read_ahead_py` in
    delayserver/wheel/read_ahead.py is the reference.

    For a worker thread reading what falls due soon: the reads may wait for the disk, and all of
    them run with the interpreter's lock released (one release per call, not per read: a thread
    that takes the lock back after each read waits for the event loop each time). Records at most
    `gap` bytes apart share a read of at most SHARED_READ_BYTES (the bytes between them are read
    too, which costs less than a read of their own: READ_AHEAD_GAP_BYTES); each record is read first
    at `first_read` bytes, then whole when it is bigger. None for the whole call on input that is
    not offsets, or a negative `gap`.

    `mapped`: a `SegmentMap` of the file, to copy the records from instead (`read_mapped`), without
    a read per record: only while the file cannot be truncated. Reads, as above, when the file
    cannot be looked at or the mapping is shorter than `size`."""
    cdef Py_ssize_t n = len(offsets), k
    cdef Ahead *want = NULL
    cdef uint8_t *slab = NULL
    cdef dict out = {}
    if first_read < HEADER_SIZE or size < 0 or max_record < HEADER_SIZE or gap < 0:
        return None
    if n == 0:
        return out
    want = <Ahead *>calloc(n, sizeof(Ahead))  # every `own` NULL, whatever returns early
    if want == NULL:
        raise MemoryError()
    try:
        for k in range(n):
            if not as_offset(offsets[k], &want[k].key.offset):
                return None
            want[k].key.index = k
        qsort(want, n, sizeof(Ahead), by_offset)
        if mapped is not None and mapped.length >= size:
            with nogil:
                slab = read_mapped(fd, size, mapped, want, n, max_record)
        if slab == NULL:
            with nogil:
                slab = read_runs(fd, size, want, n, first_read, max_record, gap)
            if slab == NULL:
                raise MemoryError()
        for k in range(n):
            if want[k].length == 0:
                continue
            if want[k].own != NULL:
                out[offsets[want[k].key.index]] = PyBytes_FromStringAndSize(<const char *>want[k].own, want[k].length)
            else:
                out[offsets[want[k].key.index]] = PyBytes_FromStringAndSize(<const char *>(slab + want[k].at),
                                                                            want[k].length)
        return out
    finally:
        for k in range(n):
            if want[k].own != NULL:
                free(want[k].own)
        free(want)
        free(slab)


# --- the spool's DELIVERED records -----------------------------------------------------------------

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    const char *PyUnicode_AsUTF8AndSize(object o, Py_ssize_t *size) except NULL


cdef Py_ssize_t headers_size(dict headers):
    """The size of `record.encode_headers(headers)`, or -1 for headers it refuses or that this
    leaves to it: a key or value not of type str (a subclass too), an empty key, text that cannot
    be UTF-8 (a lone surrogate), or a block over MAX_HEADERS_BYTES."""
    cdef Py_ssize_t total = 0, klen, vlen
    cdef object key, value
    for key, value in headers.items():
        if type(key) is not str or type(value) is not str:
            return -1
        try:
            PyUnicode_AsUTF8AndSize(key, &klen)
            PyUnicode_AsUTF8AndSize(value, &vlen)
        except UnicodeEncodeError:
            return -1
        if klen == 0:
            return -1
        total += 4 + klen + vlen
        if total > MAX_HEADERS_BYTES:
            return -1
    return total


cdef void put_headers(dict headers, uint8_t *q):
    """Write `record.encode_headers(headers)` at `q` (headers that `headers_size` measured: the
    UTF-8 of each str is cached in it by then)."""
    cdef Py_ssize_t klen, vlen
    cdef const char *k
    cdef const char *v
    cdef object key, value
    for key, value in headers.items():
        k = PyUnicode_AsUTF8AndSize(key, &klen)
        v = PyUnicode_AsUTF8AndSize(value, &vlen)
        q[0] = <uint8_t>(klen >> 8)
        q[1] = <uint8_t>klen
        memcpy(q + 2, k, klen)
        q += 2 + klen
        q[0] = <uint8_t>(vlen >> 8)
        q[1] = <uint8_t>vlen
        memcpy(q + 2, v, vlen)
        q += 2 + vlen


cdef Py_ssize_t delivered_size(object m, dict checked_subjects, int64_t min_time, int64_t max_time,
                               Py_ssize_t max_id_bytes):
    """The size of the DELIVERED record of OutboundMessage `m` (header included) as the spool's
    `_encode` writes it, or -1 for one this leaves to `_encode` (see `delivered_records`)."""
    cdef Py_ssize_t idlen, slen, blen, plen, hlen
    cdef object mid_o, subject, raw_subject, body, headers, sched_o, when_o, attempt_o
    cdef int64_t sched, when
    cdef uint64_t attempt
    if not isinstance(m, tuple) or len(<tuple>m) != 7:
        return -1
    mid_o, subject, body, headers, sched_o, when_o, attempt_o = <tuple>m
    if type(mid_o) is not str or not PyUnicode_IS_ASCII(mid_o):
        return -1
    idlen = PyUnicode_GET_LENGTH(mid_o)
    if not 1 <= idlen <= max_id_bytes:
        return -1
    raw_subject = checked_subjects.get(subject) if type(subject) is str else None
    if type(raw_subject) is not bytes:
        return -1
    if type(body) is not bytes or type(headers) is not dict:
        return -1
    hlen = headers_size(<dict>headers) if headers else 0
    if hlen < 0:
        return -1
    if type(sched_o) is not int or type(when_o) is not int or type(attempt_o) is not int:
        return -1
    try:
        sched, when, attempt = sched_o, when_o, attempt_o
    except OverflowError:
        return -1
    if not min_time <= sched <= max_time or attempt > 0xFFFFFFFF:
        return -1
    slen = len(<bytes>raw_subject)
    blen = len(<bytes>body)
    plen = DELIVERED_HEAD_SIZE + MESSAGE_HEAD_SIZE + idlen + slen + hlen + blen
    if blen > MAX_PAYLOAD_BYTES or plen > MAX_PAYLOAD_BYTES:
        return -1
    return HEADER_SIZE + plen


cdef void put_delivered(uint8_t *p, tuple m, dict checked_subjects, Py_ssize_t size, uint32_t seed):
    """Write at `p` the DELIVERED record of `m`, which `delivered_size` measured as `size` bytes."""
    cdef Py_ssize_t idlen, slen, hlen, blen
    cdef object mid_o, subject, raw_subject, body, headers
    cdef uint8_t *q = p + HEADER_SIZE
    mid_o, subject, body, headers = m[0], m[1], m[2], m[3]
    raw_subject = checked_subjects[subject]
    idlen = PyUnicode_GET_LENGTH(mid_o)
    slen = len(<bytes>raw_subject)
    blen = len(<bytes>body)
    hlen = size - HEADER_SIZE - DELIVERED_HEAD_SIZE - MESSAGE_HEAD_SIZE - idlen - slen - blen
    put64(q, <uint64_t><int64_t>m[5])
    put32(q + 8, <uint32_t><uint64_t>m[6])
    q += DELIVERED_HEAD_SIZE
    put64(q, 0)                  # store time
    put64(q + 8, <uint64_t><int64_t>m[4])
    put64(q + 16, 0)             # sequence
    q[24] = 0                    # flags
    q[25] = 0
    q[26] = <uint8_t>idlen
    q[27] = <uint8_t>slen
    put32(q + 28, <uint32_t>hlen)
    put32(q + 32, <uint32_t>blen)
    q += MESSAGE_HEAD_SIZE
    memcpy(q, PyUnicode_AsUTF8AndSize(mid_o, NULL), idlen)
    memcpy(q + idlen, <const char *><bytes>raw_subject, slen)
    if hlen:
        put_headers(<dict>headers, q + idlen + slen)
    memcpy(q + idlen + slen + hlen, <const char *><bytes>body, blen)
    put_header(p, T_DELIVERED, seed, p + HEADER_SIZE, <uint32_t>(size - HEADER_SIZE))


def delivered_records(list messages, dict checked_subjects, int64_t min_time, int64_t max_time,
                      Py_ssize_t max_id_bytes):
    """Per OutboundMessage of `messages`, its DELIVERED record as the spool's `_encode` writes it,
    or None for one it leaves to `_encode` (an id not ASCII, a subject not checked yet, headers
    other than a dict of non-empty str keys and str values within MAX_HEADERS_BYTES, anything out
    of range or of another type: `_encode` accepts or refuses it itself)."""
    cdef list out = [None] * len(messages)
    cdef Py_ssize_t k, size
    cdef bytes rec
    cdef uint32_t seed = type_seed(T_DELIVERED)
    for k in range(len(messages)):
        m = messages[k]
        size = delivered_size(m, checked_subjects, min_time, max_time, max_id_bytes)
        if size < 0:
            continue
        rec = PyBytes_FromStringAndSize(NULL, size)
        put_delivered(<uint8_t *><char *>rec, <tuple>m, checked_subjects, size, seed)
        out[k] = rec
    return out


def delivered_data(list messages, dict checked_subjects, int64_t min_time, int64_t max_time,
                   Py_ssize_t max_id_bytes):
    """``b"".join(delivered_records(...))`` made in one piece, without a bytes object per record,
    when `delivered_records` would encode every one of `messages`; else None (the caller goes
    that way, record by record). None for no messages too."""
    cdef Py_ssize_t k, n = len(messages), total = 0, size
    cdef Py_ssize_t *sizes
    cdef bytes data
    cdef uint8_t *p
    cdef uint32_t seed = type_seed(T_DELIVERED)
    if n == 0:
        return None
    sizes = <Py_ssize_t *>malloc(n * sizeof(Py_ssize_t))
    if sizes == NULL:
        raise MemoryError()
    try:
        for k in range(n):
            size = delivered_size(messages[k], checked_subjects, min_time, max_time, max_id_bytes)
            if size < 0:
                return None
            sizes[k] = size
            total += size
        data = PyBytes_FromStringAndSize(NULL, total)
        p = <uint8_t *><char *>data
        for k in range(n):
            put_delivered(p, <tuple>messages[k], checked_subjects, sizes[k], seed)
            p += sizes[k]
        return data
    finally:
        free(sizes)


# --- dispatch_log records ---------------------------------------------------------------------------


cdef inline void put_dispatch(uint8_t *p, uint32_t seed, uint64_t schedule_offset, int64_t dispatch_time,
                              bytes group, Py_ssize_t glen, uint64_t message_log_offset) noexcept:
    """The whole DISPATCH record at `p` (header, head, the group's `glen` bytes, message_log offset)."""
    cdef uint32_t plen = DISPATCH_HEAD_SIZE + glen + OFFSET_SIZE
    put64(p + HEADER_SIZE, schedule_offset)
    put64(p + HEADER_SIZE + 8, <uint64_t>dispatch_time)
    p[HEADER_SIZE + 16] = <uint8_t>glen
    memcpy(p + HEADER_SIZE + DISPATCH_HEAD_SIZE, <const char *>group, glen)
    put64(p + HEADER_SIZE + DISPATCH_HEAD_SIZE + glen, message_log_offset)
    put_header(p, T_DISPATCH, seed, p + HEADER_SIZE, plen)


def dispatch_data(int64_t dispatch_time, bytes group, schedule_offsets, message_log_offsets):
    """`record.encode_dispatch_data(dispatch_time, group.decode(), schedule_offsets,
    message_log_offsets)` for `group` (the broker group's name as `_group_bytes` gives it) and the
    offsets in arrays "Q" and "q": the DISPATCH records, one after the other in one bytes; or None
    for what it leaves to it: offsets of other counts or types, a message_log offset below zero (a
    record without one)."""
    cdef Py_ssize_t n, k, glen = len(group), plen = DISPATCH_HEAD_SIZE + glen + OFFSET_SIZE
    cdef Py_ssize_t size = HEADER_SIZE + plen
    cdef uint32_t seed = type_seed(T_DISPATCH)
    cdef const uint64_t *so
    cdef const int64_t *mlo
    cdef bytes data
    cdef uint8_t *p
    if type(schedule_offsets) is not array.array or type(message_log_offsets) is not array.array:
        return None
    if (<array.array>schedule_offsets).ob_descr.typecode != b"Q"[0] \
            or (<array.array>message_log_offsets).ob_descr.typecode != b"q"[0]:
        return None
    n = len(schedule_offsets)
    if not 1 <= glen <= 255 or len(message_log_offsets) != n:
        return None
    so = <const uint64_t *>(<array.array>schedule_offsets).data.as_voidptr
    mlo = <const int64_t *>(<array.array>message_log_offsets).data.as_voidptr
    for k in range(n):
        if mlo[k] < 0:
            return None  # a record without one
    data = PyBytes_FromStringAndSize(NULL, size * n)
    p = <uint8_t *><char *>data
    for k in range(n):
        put_dispatch(p, seed, so[k], dispatch_time, group, glen, <uint64_t>mlo[k])
        p += size
    return data


def dispatch_records(int64_t dispatch_time, bytes group, list offsets):
    """`record.encode_dispatch_records(dispatch_time, group.decode(), offsets)` for `group` (the
    broker group's name as `_group_bytes` gives it), or None for what it leaves to it: a
    message_log offset below zero (a record without one), anything out of range or of another
    type."""
    cdef Py_ssize_t glen = len(group), plen = DISPATCH_HEAD_SIZE + glen + OFFSET_SIZE
    cdef list out = []
    cdef uint64_t schedule_offset, message_log_offset
    cdef bytes rec
    cdef uint8_t *p
    cdef uint32_t seed = type_seed(T_DISPATCH)
    if not 1 <= glen <= 255:
        return None
    for item in offsets:
        if type(item) is not tuple or len(<tuple>item) != 2:
            return None
        so, mlo = <tuple>item
        if type(so) is not int or type(mlo) is not int:
            return None
        try:
            schedule_offset, message_log_offset = so, mlo
        except OverflowError:
            return None  # a negative message_log offset among them
        rec = PyBytes_FromStringAndSize(NULL, HEADER_SIZE + plen)
        put_dispatch(<uint8_t *><char *>rec, seed, schedule_offset, dispatch_time, group, glen, message_log_offset)
        out.append(rec)
    return out
