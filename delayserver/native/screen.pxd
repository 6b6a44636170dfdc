# The dedupe table's screen of the ids read back at start (`_Saved.bits` in delayserver/dedupe.py:
# a bit for each value of the top bits of their hashes), for the kernels that look ids up
# (cimported by dedupe.pyx and receive.pyx).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint32_t


cdef inline bint maybe_saved(bytes bitmap, int shift, uint32_t h) noexcept:
    """Whether an id whose `key_hash` is `h` may be among the saved ids (False: it is not). A
    bitmap not yet built, or a shift out of range, screens nothing out."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(bitmap)
    cdef uint32_t bit
    if n == 0 or not 0 <= shift < 32:
        return True
    bit = h >> shift
    if (bit >> 3) >= <uint32_t>n:
        return True
    return ((<const uint8_t *>PyBytes_AS_STRING(bitmap))[bit >> 3] >> (bit & 7)) & 1

