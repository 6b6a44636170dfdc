# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The dedupe table's map of accepted ids to their positions, compiled: the dict it stands in
for (`delayserver.dedupe._positions_dict`) with the same answers (tests/test_native.py holds them
side by side), in less memory and fewer cache misses per probe.

One array of slots, each the key's hash, its position (a machine integer, not an int object) and
the key, probed linearly from the hash's low bits and never more than half full. A probe of an id
the map does not hold, which is what nearly every send asks, reads consecutive slots from one
place until an empty one: mostly one cache line, where a dict reads its index table and then an
entry elsewhere for each slot it passes. A removed key's run is closed up behind it (backward
shift), so no tombstone lengthens later probes.

Keys are strings (`str` or a subclass): their hash is Python's, randomised per process, so a
client cannot choose ids that pile into one run. Two keys are the same when their hashes are and
they compare equal.
"""
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.object cimport PyObject_Hash, PyObject_RichCompareBool, Py_EQ
from cpython.ref cimport Py_INCREF, Py_DECREF, PyObject
from libc.stdint cimport int64_t

cdef extern from *:
    void __builtin_prefetch(const void *address)

cdef enum:
    MIN_CAPACITY = 8


cdef class IdMap:
    """str -> position (a signed 64-bit integer), a mapping as a dict of them is: `get`, `in`,
    `[]`, `del`, `pop`, `len`, `update`, `items`, iteration (over a copy of the keys)."""

    def __cinit__(self):
        self.slots = <Slot *>PyMem_Calloc(MIN_CAPACITY, sizeof(Slot))
        if self.slots == NULL:
            raise MemoryError()
        self.mask = MIN_CAPACITY - 1
        self.used = 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.slots != NULL:
            for i in range(self.mask + 1):
                if self.slots[i].key != NULL:
                    Py_DECREF(<object>self.slots[i].key)
            PyMem_Free(self.slots)

    cdef Py_ssize_t find(self, object key, Py_hash_t h) except -2:
        """The index of the slot holding `key` (hash `h`), or -1."""
        cdef Py_ssize_t i = <Py_ssize_t>(<size_t>h & <size_t>self.mask)
        cdef Slot *s
        while True:
            s = &self.slots[i]
            if s.key == NULL:
                return -1
            if s.hash == h and (s.key == <void *>key or PyObject_RichCompareBool(<object>s.key, key, Py_EQ)):
                return i
            i = (i + 1) & self.mask

    cdef int64_t lookup(self, object key) except? -2:
        """The position of `key`, or -1 when the map does not hold it."""
        cdef Py_ssize_t i
        if not isinstance(key, str):
            return -1
        i = self.find(key, PyObject_Hash(key))
        return -1 if i < 0 else self.slots[i].value

    cdef int put(self, object key, int64_t value) except -1:
        """map[key] = value."""
        cdef Py_hash_t h
        cdef Py_ssize_t i
        if not isinstance(key, str):
            raise TypeError(f"an id map's keys are strings, not {type(key).__name__}")
        h = PyObject_Hash(key)
        i = self.find(key, h)
        if i >= 0:
            self.slots[i].value = value
            return 0
        if (self.used + 1) * 2 > self.mask + 1:
            self.grow((self.mask + 1) * 2)
        i = <Py_ssize_t>(<size_t>h & <size_t>self.mask)
        while self.slots[i].key != NULL:
            i = (i + 1) & self.mask
        Py_INCREF(key)
        self.slots[i].key = <void *>key
        self.slots[i].hash = h
        self.slots[i].value = value
        self.used += 1
        return 0

    cdef int prefetch(self, object key) except -1:
        """Start reading the slot where a probe of `key` begins (its hash is taken, and kept in
        the string). A caller about to probe for many keys asks this for each first: the cache
        misses of their probes then overlap instead of following one another."""
        if isinstance(key, str):
            __builtin_prefetch(&self.slots[<size_t>PyObject_Hash(key) & <size_t>self.mask])
        return 0

    cdef int grow(self, Py_ssize_t capacity) except -1:
        """Move every slot to a new array of `capacity` (a power of two, more than twice `used`)."""
        cdef Slot *old = self.slots
        cdef Slot *new = <Slot *>PyMem_Calloc(capacity, sizeof(Slot))
        cdef Py_ssize_t n = self.mask + 1, i, j, mask = capacity - 1
        if new == NULL:
            raise MemoryError()
        for i in range(n):
            if old[i].key != NULL:
                j = <Py_ssize_t>(<size_t>old[i].hash & <size_t>mask)
                while new[j].key != NULL:
                    j = (j + 1) & mask
                new[j] = old[i]
        self.slots = new
        self.mask = mask
        PyMem_Free(old)
        return 0

    cdef void remove_at(self, Py_ssize_t i):
        """Empty slot `i`, moving back the slots after it in its run that may not stay past a hole
        (each must stay reachable from its home slot without crossing an empty one)."""
        cdef void *key = self.slots[i].key
        cdef Py_ssize_t j = i, home
        cdef Py_ssize_t mask = self.mask
        while True:
            j = (j + 1) & mask
            if self.slots[j].key == NULL:
                break
            home = <Py_ssize_t>(<size_t>self.slots[j].hash & <size_t>mask)
            # Slot j stays when its home is cyclically in (i, j]: the hole at i is not on its path.
            if (i < home <= j) if i <= j else (i < home or home <= j):
                continue
            self.slots[i] = self.slots[j]
            i = j
        self.slots[i].key = NULL
        self.used -= 1
        Py_DECREF(<object>key)

    # --- the mapping's Python face ------------------------------------------------------------

    def __len__(self):
        return self.used

    def __contains__(self, key):
        return self.lookup(key) >= 0

    def get(self, key, default=None):
        cdef int64_t v = self.lookup(key)
        return default if v < 0 else v

    def __getitem__(self, key):
        cdef int64_t v = self.lookup(key)
        if v < 0:
            raise KeyError(key)
        return v

    def __setitem__(self, key, int64_t value):
        if value < 0:
            raise ValueError("an id map's positions are not negative")
        self.put(key, value)

    def __delitem__(self, key):
        cdef Py_ssize_t i = -1
        if isinstance(key, str):
            i = self.find(key, PyObject_Hash(key))
        if i < 0:
            raise KeyError(key)
        self.remove_at(i)

    def pop(self, key, *default):
        cdef Py_ssize_t i = -1
        cdef int64_t v
        if isinstance(key, str):
            i = self.find(key, PyObject_Hash(key))
        if i < 0:
            if default:
                return default[0]
            raise KeyError(key)
        v = self.slots[i].value
        self.remove_at(i)
        return v

    def remove_if(self, key, int64_t position):
        """Remove `key` when its position is `position` (one probe: expiry's `get` and `del`);
        returns whether it did."""
        cdef Py_ssize_t i
        if not isinstance(key, str):
            return False
        i = self.find(key, PyObject_Hash(key))
        if i < 0 or self.slots[i].value != position:
            return False
        self.remove_at(i)
        return True

    def update(self, entries):
        """Put every (key, position) of `entries` (pairs, or a mapping's items)."""
        if hasattr(entries, "items"):
            entries = entries.items()
        for key, value in entries:
            self[key] = value

    def items(self):
        """A list of (key, position), in no particular order."""
        cdef Py_ssize_t i
        return [(<object>self.slots[i].key, self.slots[i].value)
                for i in range(self.mask + 1) if self.slots[i].key != NULL]

    def keys(self):
        cdef Py_ssize_t i
        return [<object>self.slots[i].key for i in range(self.mask + 1) if self.slots[i].key != NULL]

    def __iter__(self):
        return iter(self.keys())

    def __sizeof__(self):
        return type(self).__basicsize__ + (self.mask + 1) * sizeof(Slot)

    def __repr__(self):
        return f"IdMap({dict(self.items())!r})"

