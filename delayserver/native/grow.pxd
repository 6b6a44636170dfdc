# A bytearray filled from the front and grown as it fills, shared by the kernels (cimported).
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from libc.stdint cimport uint8_t


cdef inline uint8_t *reserve(bytearray buf, Py_ssize_t used, Py_ssize_t need) except NULL:
    """The bytes of `buf` from `used` on, grown first when it holds fewer than `need` more: to
    twice its size at least, so that filling it record by record copies what it holds a bounded
    number of times (a bytearray asked for a little more each time grows by an eighth, and each
    growth may copy what it holds). The caller keeps `used` and cuts `buf` to it when done
    (`PyByteArray_Resize`: no copy where it keeps more than half)."""
    cdef Py_ssize_t size = PyByteArray_GET_SIZE(buf)
    if used + need > size:
        PyByteArray_Resize(buf, max(used + need, 2 * size))
    return <uint8_t *>PyByteArray_AS_STRING(buf) + used
