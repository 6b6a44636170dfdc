"""What both fuzz targets share: the allocation bound and the libFuzzer entry point."""
from __future__ import annotations

import tracemalloc

#: No input may make the code under test hold more than this many bytes per input byte, plus a
#: constant: a declared length is never an allocation.
BYTES_PER_INPUT_BYTE = 64
CONSTANT_BYTES = 1 << 20


def bounded(fn, data: bytes) -> None:
    """Run fn(data) and fail if its peak allocation is out of proportion to the input."""
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    fn(data)
    peak = tracemalloc.get_traced_memory()[1] - before
    limit = BYTES_PER_INPUT_BYTE * len(data) + CONSTANT_BYTES
    if peak > limit:
        raise AssertionError(f"{peak} bytes allocated for a {len(data)}-byte input (limit {limit})")


def main(argv: list[str]) -> None:
    """`python -m tests.fuzz TARGET [libFuzzer options] [corpus dirs]`: fuzz tests/fuzz/fuzz_TARGET.py,
    with coverage feedback from the delayserver package (instrumented as it is imported)."""
    import importlib

    import atheris

    name, options = argv[1], argv[2:]
    with atheris.instrument_imports(include=["delayserver"]):
        target = importlib.import_module(f"tests.fuzz.fuzz_{name}")
    tracemalloc.start()
    atheris.Setup([argv[0], *options], lambda data: bounded(target.test_one_input, data))
    atheris.Fuzz()
