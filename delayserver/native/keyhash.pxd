# The dedupe table's saved hash of a key (`delayserver.dedupe.key_hash`: 32 bits of xxh3 of its
# UTF-8), taken in C from Debian's libxxhash (libxxhash-dev, installed by ops/_env.sh), for the
# kernels that remember and screen ids (cimported by dedupe.pyx and receive.pyx).
from cpython.unicode cimport PyUnicode_AsUTF8String
from libc.stdint cimport uint32_t, uint64_t


cdef extern from "xxhash.h":
    uint64_t XXH3_64bits(const void *data, size_t length) nogil


cdef extern from "Python.h":
    bint PyUnicode_IS_COMPACT_ASCII(object o)
    const char *PyUnicode_AsUTF8AndSize(object o, Py_ssize_t *size) except NULL


cdef inline uint32_t hash32(const char *data, size_t n) noexcept nogil:
    """32 bits of xxh3 of `n` bytes at `data`: what `key_hash` keeps."""
    return <uint32_t>XXH3_64bits(data, n)  # (its low 32 bits)


cdef inline uint32_t bytes_key_hash(bytes raw) noexcept:
    """`key_hash(raw)`."""
    return hash32(<const char *>raw, <size_t>len(raw))


cdef inline uint32_t str_key_hash(str key) except? 0:
    """`key_hash(key.encode("utf-8"))` of a str. An ASCII string's characters are its UTF-8, read
    in place; any other is encoded to a bytes object and freed (not cached in the string, which
    the table keeps: a cached copy would grow each such id's memory)."""
    cdef Py_ssize_t n
    cdef const char *data
    if PyUnicode_IS_COMPACT_ASCII(key):
        data = PyUnicode_AsUTF8AndSize(key, &n)
        return hash32(data, <size_t>n)
    return bytes_key_hash(PyUnicode_AsUTF8String(key))
