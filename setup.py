"""Everything about the project is in setup.cfg; this file only declares the compiled kernels of
delayserver/native (Cython). `optional=True`: an install without a C compiler still works, on the
Python references the kernels stand in for."""
from Cython.Build import cythonize
from setuptools import Extension, setup

KERNELS = [
    Extension("delayserver.native.records", ["delayserver/native/records.pyx"], optional=True),
    Extension("delayserver.native.send", ["delayserver/native/send.pyx"], optional=True),
    # dedupe and receive take the dedupe keys' saved hash (xxh3) from Debian's libxxhash-dev.
    Extension("delayserver.native.dedupe", ["delayserver/native/dedupe.pyx"], libraries=["xxhash"], optional=True),
    Extension("delayserver.native.receive", ["delayserver/native/receive.pyx"], libraries=["xxhash"], optional=True),
    Extension("delayserver.native.wheel", ["delayserver/native/wheel.pyx"], optional=True),
    Extension("delayserver.native.resp", ["delayserver/native/resp.pyx"], optional=True),
    Extension("delayserver.native.idmap", ["delayserver/native/idmap.pyx"], optional=True),
]

setup(ext_modules=cythonize(KERNELS, language_level=3))
