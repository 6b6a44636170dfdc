"""The one reader: every good record, then one damage report that tells torn tails from corruption."""
from __future__ import annotations

import io

import pytest
from hypothesis import given, settings, strategies as st

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.reader import Damage, read_file_records, read_records, scan
from delayserver.storage.record import (
    HEADER_SIZE, Message, RecordError, RecordType, decode_payload, encode_message, encode_record,
)
from tests.damage import message_record

RECORDS = [message_record(i) for i in range(5)]
IMAGE = b"".join(RECORDS)
OFFSETS = [sum(map(len, RECORDS[:i])) for i in range(len(RECORDS))]


def read(buf, **kw):
    found: list[Damage] = []
    records = [offset for offset, *_ in read_records(buf, "seg", report=found.append, **kw)]
    assert len(found) <= 1, "damage is reported once"
    return records, (found[0] if found else None)


def flipped(buf: bytes, at: int) -> bytes:
    return buf[:at] + bytes([buf[at] ^ 0x40]) + buf[at + 1 :]


def test_clean_end_yields_every_record_and_reports_nothing():
    assert read(IMAGE) == (OFFSETS, None)


def test_truncated_trailing_record_is_an_incomplete_torn_tail():
    records, damage = read(IMAGE[:-3])
    assert records == OFFSETS[:-1]
    assert damage.torn and damage.incomplete and damage.offset == OFFSETS[-1]
    assert damage.length == len(RECORDS[-1]) - 3


def test_flipped_bit_in_the_last_record_is_a_torn_tail_but_not_an_incomplete_one():
    records, damage = read(flipped(IMAGE, len(IMAGE) - 1))
    assert records == OFFSETS[:-1]
    assert damage.torn and not damage.incomplete and damage.reason == "crc mismatch"


def test_flipped_bit_before_valid_records_is_corruption_and_nothing_past_it_is_yielded():
    records, damage = read(flipped(IMAGE, OFFSETS[2] + HEADER_SIZE + 3))
    assert records == OFFSETS[:2]
    assert not damage.torn and damage.offset == OFFSETS[2]
    assert f"valid records follow at offset {OFFSETS[3]}" in damage.reason


def test_any_damage_in_a_sealed_image_is_corruption():
    _, damage = read(IMAGE[:-3], sealed=True)
    assert not damage.torn and "sealed" in damage.reason


def test_zero_filled_tail_is_torn():
    records, damage = read(IMAGE + bytes(4096))
    assert records == OFFSETS and damage.torn and damage.length == 4096


def test_without_a_reporter_corruption_raises_and_a_torn_tail_ends_quietly():
    with pytest.raises(CorruptSegment) as info:
        list(read_records(flipped(IMAGE, OFFSETS[1] + HEADER_SIZE), "seg"))
    assert info.value.offset == OFFSETS[1]
    assert len(list(read_records(IMAGE[:-1], "seg"))) == len(RECORDS) - 1


def test_offsets_are_reported_from_base():
    records, damage = read(IMAGE[:-1], base=1000)
    assert records == [1000 + o for o in OFFSETS[:-1]] and damage.offset == 1000 + OFFSETS[-1]


def test_a_record_whose_crc_holds_but_whose_payload_does_not_decode_is_corruption():
    bad = encode_record(RecordType.MESSAGE, b"\x00" * 7)  # crc fine, fields missing
    records, damage = read(RECORDS[0] + bad + RECORDS[1], decode=True)
    assert records == [0]
    assert not damage.torn and "undecodable MESSAGE payload" in damage.reason


def test_scan_gives_recovery_the_valid_end_and_the_torn_bytes():
    result = scan(IMAGE[:-3], "seg")
    assert (result.valid_end, result.records, result.torn_bytes) == (OFFSETS[-1], 4, len(RECORDS[-1]) - 3)
    with pytest.raises(CorruptSegment):
        scan(IMAGE[:-3], "seg", allow_torn_tail=False)


def test_scan_cuts_damage_followed_by_valid_records_only_within_the_power_loss_window():
    # A hole at record 2 with records 3 and 4 whole after it: what a power loss leaves when
    # unsynced writes land out of order.
    image = flipped(IMAGE, OFFSETS[2] + HEADER_SIZE + 3)
    tail = len(IMAGE) - OFFSETS[2]
    result = scan(image, "seg", power_loss_window=tail)
    assert (result.valid_end, result.records, result.torn_bytes, result.dropped_records) == (OFFSETS[2], 2, tail, 2)
    assert "power loss" in result.torn_reason
    with pytest.raises(CorruptSegment):
        scan(image, "seg", power_loss_window=tail - 1)
    with pytest.raises(CorruptSegment):
        scan(image, "seg")
    with pytest.raises(CorruptSegment):
        scan(image, "seg", allow_torn_tail=False, power_loss_window=tail)


@pytest.mark.parametrize("chunk_bytes", [HEADER_SIZE, 50, len(RECORDS[0]), len(RECORDS[0]) + 1, 1 << 20])
@pytest.mark.parametrize("image", [IMAGE, IMAGE[:-3], flipped(IMAGE, OFFSETS[2] + 20), IMAGE + bytes(100)],
                         ids=["clean", "incomplete", "corrupt", "zeros"])
def test_the_file_reader_in_chunks_agrees_with_the_buffer_reader(image, chunk_bytes):
    want_records, want_damage = read(image)
    found: list[Damage] = []
    got = list(read_file_records(io.BytesIO(image), "seg", chunk_bytes=chunk_bytes, report=found.append))
    assert [offset for offset, _, _ in got] == want_records
    assert all(record == image[o : o + len(record)] for o, _, record in got)
    assert (found[0] if found else None) == want_damage


def test_the_file_reader_takes_a_record_larger_than_its_chunk_whole():
    big = encode_record(RecordType.MESSAGE, encode_message(Message("big", "s", b"x" * 5000, 1)))
    got = list(read_file_records(io.BytesIO(RECORDS[0] + big + RECORDS[1]), chunk_bytes=64))
    assert [record for _, _, record in got] == [RECORDS[0], big, RECORDS[1]]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(RecordType)), st.binary(max_size=200))
def test_any_payload_decodes_or_raises_record_error_only(rtype, payload):
    try:
        decode_payload(rtype, payload, 0, len(payload))
    except RecordError:
        pass


class GrowingFile(io.BytesIO):
    """A file another process appends to: each read past `cut` sees more of it than the last."""

    def __init__(self, image: bytes, cut: int):
        super().__init__(image[:cut])
        self.rest = image[cut:]

    def read(self, size=-1):
        data = super().read(size)
        if self.rest:  # the writer finishes its append just after this read
            pos = self.tell()
            self.seek(0, io.SEEK_END)
            self.write(self.rest)
            self.rest = b""
            self.seek(pos)
        return data


def test_a_record_being_appended_while_the_file_is_read_is_incomplete_not_corrupt():
    found: list[Damage] = []
    cut = OFFSETS[3] + 5
    got = list(read_file_records(GrowingFile(IMAGE, cut), "seg", report=found.append))
    assert [offset for offset, _, _ in got] == OFFSETS[:3]
    (damage,) = found
    assert damage.torn and damage.incomplete and damage.offset == OFFSETS[3]
