"""Fuzz target: the one reader of log images (storage.reader) and the record decoders under it.

Whatever the bytes, reading them gives records and at most one typed damage report (Damage), and
recovery's scan gives a ScanResult or CorruptSegment: never another exception. The buffer reader
and the file reader (in chunks) agree record for record and on the damage.

    python -m tests.fuzz reader -max_total_time=600 /tmp/reader-corpus tests/fuzz/corpus/reader
"""
from __future__ import annotations

import io

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.reader import Damage, read_file_records, read_records, scan

PATH = "fuzzed.log"


def test_one_input(data: bytes) -> None:
    if not data:
        return
    flags, image = data[0], data[1:]
    sealed = bool(flags & 1)
    chunk_bytes = 9 + (flags >> 1) * 7

    found: list[Damage] = []
    records = list(read_records(image, PATH, sealed=sealed, decode=True, report=found.append))
    assert len(found) <= 1
    for damage in found:
        assert isinstance(damage, Damage) and 0 <= damage.offset < len(image)

    plain: list[Damage] = []
    whole = [(offset, rtype) for offset, rtype, _, _ in read_records(image, PATH, report=plain.append)]
    in_chunks: list[Damage] = []
    chunked = [(offset, rtype, record) for offset, rtype, record in
               read_file_records(io.BytesIO(image), PATH, chunk_bytes=chunk_bytes, report=in_chunks.append)]
    assert [(o, t) for o, t, _ in chunked] == whole
    assert all(image[o : o + len(r)] == r for o, _, r in chunked)
    assert in_chunks == plain
    assert [(o, t) for o, t, _ in records] == whole[: len(records)]

    try:
        result = scan(image, PATH, allow_torn_tail=not sealed)
    except CorruptSegment:
        pass
    else:
        assert result.valid_end + result.torn_bytes == len(image)
