from libc.stdint cimport int64_t


cdef struct Slot:
    Py_hash_t hash
    int64_t value
    void *key  # a str, owned (a reference held); NULL: empty


cdef struct Shard:
    Slot *slots
    Py_ssize_t mask  # capacity - 1 (a power of two)
    Py_ssize_t used


cdef enum:
    SHARD_BITS = 8
    SHARDS = 256  # 2 ** SHARD_BITS


cdef class IdMap:
    cdef Shard shards[SHARDS]
    cdef Py_ssize_t used
    cdef readonly Py_ssize_t largest_grow
    cdef Py_ssize_t find(self, Shard *shard, object key, Py_hash_t h) except -2
    cdef Py_ssize_t locate(self, object key, Shard **shard) except -2
    cdef int64_t lookup(self, object key) except? -2
    cdef int put(self, object key, int64_t value) except -1
    cdef int prefetch(self, object key) except -1
    cdef int grow(self, Shard *shard, Py_ssize_t capacity) except -1
    cdef void remove_at(self, Shard *shard, Py_ssize_t i)
