# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The dedupe table's map of accepted ids to their positions, compiled: the dict it stands in
for (`delayserver.dedupe._positions_dict`) with the same answers (tests/test_native.py holds them
side by side), in less memory and fewer cache misses per probe.

Arrays of slots, each the key's hash, its position (a machine integer, not an int object) and
the key, probed linearly from the hash's low bits and never more than half full; 256 of them
(shards), a key's chosen by its hash's top bits, each growing on its own. One array for all held
the event loop for 89 to 112 ms when it doubled at a million ids (a scratch loop of
`DedupeTable.remember_many`, six runs: a new array of 96 MiB to fault in and every slot moved, in
one put); a shard's doubling moves a 256th of that, and the shards,
filling alike, double one after another, puts apart: the slowest request of 64 ids going into a
map growing past a million took 0.9 and 3.6 ms against 94 and 96 (a scratch loop of
`DedupeTable.remember_many`, alternated; `ops/bench dedupe` prints it). A probe of an id
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
    # 2 ** SHARD_BITS shards (`shard_of`): SHARDS in idmap.pxd.
    SHARD_SHIFT = 8 * sizeof(size_t) - SHARD_BITS


cdef inline Shard *shard_of(IdMap m, Py_hash_t h) noexcept:
    """The shard of a key of hash `h`: its top bits (its home slot in the shard: its low bits)."""
    return &m.shards[<size_t>h >> SHARD_SHIFT]


cdef class IdMap:
    """str -> position (a signed 64-bit integer), a mapping as a dict of them is: `get`, `in`,
    `[]`, `del`, `pop`, `len`, `update`, `items`, iteration (over a copy of the keys).
    `largest_grow`: the most slots one put has moved (a shard's doubling)."""

    def __cinit__(self):
        cdef Py_ssize_t k
        for k in range(SHARDS):
            self.shards[k].slots = NULL
        for k in range(SHARDS):
            self.shards[k].slots = <Slot *>PyMem_Calloc(MIN_CAPACITY, sizeof(Slot))
            if self.shards[k].slots == NULL:
                raise MemoryError()
            self.shards[k].mask = MIN_CAPACITY - 1
            self.shards[k].used = 0
        self.used = 0
        self.largest_grow = 0

    def __dealloc__(self):
        cdef Py_ssize_t i, k
        cdef Shard *shard
        for k in range(SHARDS):
            shard = &self.shards[k]
            if shard.slots == NULL:
                continue
            for i in range(shard.mask + 1):
                if shard.slots[i].key != NULL:
                    Py_DECREF(<object>shard.slots[i].key)
            PyMem_Free(shard.slots)
            shard.slots = NULL

    cdef Py_ssize_t find(self, Shard *shard, object key, Py_hash_t h) except -2:
        """The index in `shard` (the key's) of the slot holding `key` (hash `h`), or -1."""
        cdef Py_ssize_t i = <Py_ssize_t>(<size_t>h & <size_t>shard.mask)
        cdef Slot *s
        while True:
            s = &shard.slots[i]
            if s.key == NULL:
                return -1
            if s.hash == h and (s.key == <void *>key or PyObject_RichCompareBool(<object>s.key, key, Py_EQ)):
                return i
            i = (i + 1) & shard.mask

    cdef int64_t lookup(self, object key) except? -2:
        """The position of `key`, or -1 when the map does not hold it."""
        cdef Shard *shard = NULL
        cdef Py_ssize_t i = self.locate(key, &shard)
        return -1 if i < 0 else shard.slots[i].value

    cdef int put(self, object key, int64_t value) except -1:
        """map[key] = value."""
        cdef Py_hash_t h
        cdef Py_ssize_t i
        cdef Shard *shard
        if not isinstance(key, str):
            raise TypeError(f"an id map's keys are strings, not {type(key).__name__}")
        h = PyObject_Hash(key)
        shard = shard_of(self, h)
        i = self.find(shard, key, h)
        if i >= 0:
            shard.slots[i].value = value
            return 0
        if (shard.used + 1) * 2 > shard.mask + 1:
            self.grow(shard, (shard.mask + 1) * 2)
        i = <Py_ssize_t>(<size_t>h & <size_t>shard.mask)
        while shard.slots[i].key != NULL:
            i = (i + 1) & shard.mask
        Py_INCREF(key)
        shard.slots[i].key = <void *>key
        shard.slots[i].hash = h
        shard.slots[i].value = value
        shard.used += 1
        self.used += 1
        return 0

    cdef int prefetch(self, object key) except -1:
        """Start reading the slot where a probe of `key` begins (its hash is taken, and kept in
        the string). A caller about to probe for many keys asks this for each first: the cache
        misses of their probes then overlap instead of following one another."""
        cdef Py_hash_t h
        cdef Shard *shard
        if isinstance(key, str):
            h = PyObject_Hash(key)
            shard = shard_of(self, h)
            __builtin_prefetch(&shard.slots[<size_t>h & <size_t>shard.mask])
        return 0

    cdef int grow(self, Shard *shard, Py_ssize_t capacity) except -1:
        """Move every slot of `shard` to a new array of `capacity` (a power of two, more than
        twice its `used`)."""
        cdef Slot *old = shard.slots
        cdef Slot *new = <Slot *>PyMem_Calloc(capacity, sizeof(Slot))
        cdef Py_ssize_t n = shard.mask + 1, i, j, mask = capacity - 1
        if new == NULL:
            raise MemoryError()
        for i in range(n):
            if old[i].key != NULL:
                j = <Py_ssize_t>(<size_t>old[i].hash & <size_t>mask)
                while new[j].key != NULL:
                    j = (j + 1) & mask
                new[j] = old[i]
        shard.slots = new
        shard.mask = mask
        PyMem_Free(old)
        if shard.used > self.largest_grow:
            self.largest_grow = shard.used
        return 0

    cdef void remove_at(self, Shard *shard, Py_ssize_t i):
        """Empty slot `i` of `shard`, moving back the slots after it in its run that may not stay
        past a hole (each must stay reachable from its home slot without crossing an empty one)."""
        cdef Slot *slots = shard.slots
        cdef void *key = slots[i].key
        cdef Py_ssize_t j = i, home
        cdef Py_ssize_t mask = shard.mask
        while True:
            j = (j + 1) & mask
            if slots[j].key == NULL:
                break
            home = <Py_ssize_t>(<size_t>slots[j].hash & <size_t>mask)
            # Slot j stays when its home is cyclically in (i, j]: the hole at i is not on its path.
            if (i < home <= j) if i <= j else (i < home or home <= j):
                continue
            slots[i] = slots[j]
            i = j
        slots[i].key = NULL
        shard.used -= 1
        self.used -= 1
        Py_DECREF(<object>key)

    cdef Py_ssize_t locate(self, object key, Shard **shard) except -2:
        """`find` of `key` in its shard (set in `shard`), -1 when absent or not a string."""
        cdef Py_hash_t h
        if not isinstance(key, str):
            return -1
        h = PyObject_Hash(key)
        shard[0] = shard_of(self, h)
        return self.find(shard[0], key, h)

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
        cdef Shard *shard = NULL
        cdef Py_ssize_t i = self.locate(key, &shard)
        if i < 0:
            raise KeyError(key)
        self.remove_at(shard, i)

    def pop(self, key, *default):
        cdef Shard *shard = NULL
        cdef Py_ssize_t i = self.locate(key, &shard)
        cdef int64_t v
        if i < 0:
            if default:
                return default[0]
            raise KeyError(key)
        v = shard.slots[i].value
        self.remove_at(shard, i)
        return v

    def remove_if(self, key, int64_t position):
        """Remove `key` when its position is `position` (one probe: expiry's `get` and `del`);
        returns whether it did."""
        cdef Shard *shard = NULL
        cdef Py_ssize_t i = self.locate(key, &shard)
        if i < 0 or shard.slots[i].value != position:
            return False
        self.remove_at(shard, i)
        return True

    def update(self, entries):
        """Put every (key, position) of `entries` (pairs, or a mapping's items)."""
        if hasattr(entries, "items"):
            entries = entries.items()
        for key, value in entries:
            self[key] = value

    def items(self):
        """A list of (key, position), in no particular order."""
        cdef Py_ssize_t i, k
        cdef Shard *shard
        cdef list out = []
        for k in range(SHARDS):
            shard = &self.shards[k]
            for i in range(shard.mask + 1):
                if shard.slots[i].key != NULL:
                    out.append((<object>shard.slots[i].key, shard.slots[i].value))
        return out

    def keys(self):
        return [key for key, _ in self.items()]

    def __iter__(self):
        return iter(self.keys())

    def __sizeof__(self):
        cdef Py_ssize_t k, slots = 0
        for k in range(SHARDS):
            slots += self.shards[k].mask + 1
        return type(self).__basicsize__ + slots * sizeof(Slot)

    def __repr__(self):
        return f"IdMap({dict(self.items())!r})"
