# Named tuples made in C as their own __new__ makes them, and taken out of the collector's
# generations where nothing in them can reach back to them; shared by the kernels (cimported).
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM

cdef extern from "Python.h":
    PyObject *PyType_GenericAlloc(PyTypeObject *type, Py_ssize_t nitems)
    int PyObject_GC_IsTracked(object o)
    void PyObject_GC_UnTrack(object o)


cdef inline object new_tuple_of(object tuple_type, Py_ssize_t n):
    """An instance of `tuple_type` (a direct subclass of tuple, as a named tuple is) of `n` items,
    each to be put in by `set_item` before anything else sees it; tracked by the collector, as
    any tuple is made."""
    cdef PyObject *o = PyType_GenericAlloc(<PyTypeObject *>tuple_type, n)
    if o == NULL:
        raise MemoryError()
    t = <object>o
    Py_DECREF(t)  # (the cast took a reference of its own: `t` owns the new tuple's one)
    return t


cdef inline void set_item(object t, Py_ssize_t i, object value):
    Py_INCREF(value)
    PyTuple_SET_ITEM(t, i, value)
