# Big-endian reads and writes of the record and frame formats, shared by the kernels (cimported).
from libc.stdint cimport uint8_t, uint32_t, uint64_t


cdef inline uint32_t be16(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 8) | p[1]


cdef inline uint32_t be32(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline uint64_t be64(const uint8_t *p) noexcept nogil:
    return (<uint64_t>be32(p) << 32) | be32(p + 4)


cdef inline void put16(uint8_t *p, uint32_t v) noexcept nogil:
    p[0] = v >> 8
    p[1] = v


cdef inline void put32(uint8_t *p, uint32_t v) noexcept nogil:
    p[0] = v >> 24
    p[1] = v >> 16
    p[2] = v >> 8
    p[3] = v


cdef inline void put64(uint8_t *p, uint64_t v) noexcept nogil:
    put32(p, <uint32_t>(v >> 32))
    put32(p + 4, <uint32_t>v)
