from libc.stdint cimport int64_t


cdef struct Slot:
    Py_hash_t hash
    int64_t value
    void *key  # a str, owned (a reference held); NULL: empty


cdef class IdMap:
    cdef Slot *slots
    cdef Py_ssize_t mask  # capacity - 1 (a power of two)
    cdef Py_ssize_t used
    cdef Py_ssize_t find(self, object key, Py_hash_t h) except -2
    cdef int64_t lookup(self, object key) except? -2
    cdef int put(self, object key, int64_t value) except -1
    cdef int prefetch(self, object key) except -1
    cdef int grow(self, Py_ssize_t capacity) except -1
    cdef void remove_at(self, Py_ssize_t i)
