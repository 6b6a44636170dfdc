"""The spool: the embedded broker, one durable append-only file per subject.

Each subject's messages go to `<data_dir>/spool/<subject>.log`, one DELIVERED record each (the
record format of `storage.record`). The writer promises:

- ACKED only after an fsync that covers the message returned; appends to one subject are
  group-committed: while one write and fsync run, the batches that arrive wait, and then go in one
  write and one fsync together (a broker's group commit: a slow disk makes the groups bigger, not
  the queue longer);
- a failed write or fsync (ENOSPC, EIO, any OSError) gives RETRY for that subject's part of every
  batch it covered and truncates the file back to where it ended, so a later append never lands after garbage;
  after a failed fsync no later append to that file counts as delivered either (RETRY until the
  node restarts: a later fsync that succeeds proves nothing about the pages the kernel dropped);
- every append holds an exclusive flock on the file, so several spool transports (two broker groups
  on one data directory, or two processes) never interleave their records;
- a transport's first append to a file scans it under the lock: a torn tail (a crash cut an append
  short) is truncated and logged; damage followed by valid records is corruption, and the subject
  gets RETRY with a detail naming file and offset until an operator repairs it;
- a subject that cannot name a file ("." and "..", or over 251 bytes, which with ".log" would pass
  the 255-byte file name limit) and a message outside the record limits are REJECTED.

The reader (`iter_spool`, used by `delayctl tail`) takes no lock: it stops quietly at an incomplete
record, since a writer may be mid-append.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import operator
import os
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping, Sequence

import attrs
import trio

from delayserver.message import MAX_ID_BYTES, MAX_TIME_MS, MIN_TIME_MS, SUBJECT_RE, InvalidMessage
from delayserver.sender.transport import (
    ACKED, TRANSPORT_THREADS, DeliveryResult, OutboundMessage, Outcome, Transport, check_option_names,
)
from delayserver import failpoints
from delayserver.storage.errors import StorageError
from delayserver.storage.reader import Damage, read_file_records
from delayserver.storage.record import (
    CHECKED_SUBJECTS, HEADER_SIZE, MAX_PAYLOAD_BYTES, Message, RecordError, RecordType, decode_delivered,
    encode_delivered, encode_message, encode_record,
)
from delayserver.storage.segment import fsync_dir, fsync_fd, note_io_error
from delayserver.storage.threads import ThreadPool

try:  # the compiled kernel (delayserver/native/records.pyx), when built
    from delayserver.native.records import delivered_data as _native_delivered_data
    from delayserver.native.records import delivered_records as _native_delivered_records
except ImportError:  # pragma: no cover - a build without a C compiler
    _native_delivered_data = _native_delivered_records = None

log = logging.getLogger("delayserver.sender.spool")

_SUBJECT = operator.itemgetter(1)  # an OutboundMessage's subject

SPOOL_DIR = "spool"
SUFFIX = ".log"
_NAME_MAX = 255


class SpoolCorrupt(Exception):
    """A damaged record in a spool file with valid records after it (not a torn tail)."""

    def __init__(self, path: Path, offset: int, reason: str):
        super().__init__(f"{path}: corrupt spool record at offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


def spool_path(data_dir: Path, subject: str) -> Path:
    """The spool file of `subject`. Raises ValueError for a subject that is no safe file name."""
    raw = subject.encode("utf-8") if isinstance(subject, str) else b""
    if not SUBJECT_RE.match(raw) or subject in (".", ".."):
        raise ValueError(f"subject {subject!r} cannot name a spool file")
    if len(raw) + len(SUFFIX) > _NAME_MAX:
        raise ValueError(f"subject {subject!r} is too long for a spool file name ({_NAME_MAX - len(SUFFIX)} bytes at most)")
    return Path(data_dir) / SPOOL_DIR / (subject + SUFFIX)


def list_spool_subjects(data_dir: Path) -> list[str]:
    """The subjects that have a spool file, sorted; empty when nothing was spooled yet."""
    try:
        names = os.listdir(Path(data_dir) / SPOOL_DIR)
    except FileNotFoundError:
        return []
    subjects = []
    for name in names:
        subject = name[: -len(SUFFIX)]
        if name.endswith(SUFFIX) and SUBJECT_RE.match(subject.encode("utf-8")) and subject not in (".", ".."):
            subjects.append(subject)
    return sorted(subjects)


# --- reading --------------------------------------------------------------------------------------


def _scan(f: BinaryIO, path: Path, pos: int) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, record)`` for each whole record from `pos`, through the one reader.

    Ends quietly at a torn tail, or an incomplete last record (an append under way, or cut short
    by a crash). Raises SpoolCorrupt for damage with valid records after it, or a record of a type
    other than DELIVERED.
    """
    def report(damage: Damage) -> None:
        if not damage.torn:
            raise SpoolCorrupt(path, damage.offset, damage.reason)

    for offset, rtype, record in read_file_records(f, path, start=pos, report=report):
        if rtype != RecordType.DELIVERED:
            raise SpoolCorrupt(path, offset, f"record type {rtype} is not DELIVERED")
        yield offset, record


class SpoolCursor:
    """An iterator of ``(offset, dispatch_time, attempt, Message)`` over one spool file.

    `next_offset` is the offset just past the last record yielded: pass it as `start_offset` to a
    later `iter_spool` to follow the file as it grows.
    """

    def __init__(self, path: Path, start_offset: int):
        self.path = path
        self.next_offset = start_offset
        self._records = self._read()

    def __iter__(self) -> SpoolCursor:
        return self

    def __next__(self) -> tuple[int, int, int, Message]:
        return next(self._records)

    def close(self) -> None:
        self._records.close()

    def _read(self) -> Iterator[tuple[int, int, int, Message]]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return
        with f:
            for offset, record in _scan(f, self.path, self.next_offset):
                try:
                    dispatch_time, attempt, message = decode_delivered(record, HEADER_SIZE, len(record))
                except RecordError as e:
                    raise SpoolCorrupt(self.path, offset, f"undecodable DELIVERED payload: {e}") from e
                self.next_offset = offset + len(record)
                yield offset, dispatch_time, attempt, message


def iter_spool(data_dir: Path, subject: str, start_offset: int = 0) -> SpoolCursor:
    """Read the spool of `subject` from `start_offset`, which must be a record boundary.

    Yields nothing when the subject has no spool file yet; stops at an incomplete tail. Raises
    ValueError for a bad subject and SpoolCorrupt (naming file and offset) for damage in the middle.
    """
    return SpoolCursor(spool_path(data_dir, subject), start_offset)


# --- writing --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _open_for_append(path: Path) -> int:
    """Open the spool file read-write, creating it and the spool directory durably if missing."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        pass
    if not path.parent.is_dir():
        path.parent.mkdir(exist_ok=True)
        fsync_dir(path.parent.parent)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return os.open(path, os.O_RDWR)
    try:
        fsync_dir(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _append_durably(path: Path, data: bytes, *, check_tail: bool) -> None:
    """Append `data` to the spool file at `path` in one write, then fsync; return once it is durable.

    Blocking: run it in a worker thread. Holds an exclusive flock on the file throughout. With
    `check_tail`, first truncates a torn tail (logged). Raises SpoolCorrupt for damage inside the
    file, and OSError after truncating the file back to where it ended (an fsync error is never
    retried here: the page cache may have dropped the data).
    """
    fd = _open_for_append(path)
    try:
        with _locked(fd):
            if check_tail:
                _truncate_torn_tail(fd, path)
            end = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                written = 0
                failpoints.io("write", path)
                while written < len(view):
                    written += os.pwrite(fd, view[written:], end + written)
                # Once an fsync of this file failed, every later one raises too (fsyncgate).
                fsync_fd(fd, path)
            except (OSError, StorageError) as e:
                if isinstance(e, OSError):
                    note_io_error(path, e)
                try:
                    os.ftruncate(fd, end)
                except OSError:
                    log.error("%s: could not truncate back to %d after a failed append", path, end)
                raise
    finally:
        os.close(fd)


def _truncate_torn_tail(fd: int, path: Path) -> None:
    size = os.fstat(fd).st_size
    valid_end = 0
    with os.fdopen(os.dup(fd), "rb") as f:
        for offset, record in _scan(f, path, 0):
            valid_end = offset + len(record)
    if valid_end < size:
        log.warning("%s: truncating a torn tail of %d bytes at offset %d", path, size - valid_end, valid_end)
        os.ftruncate(fd, valid_end)
        fsync_fd(fd, path)


def _encode_whole(batch: list[OutboundMessage]) -> bytes | None:
    """The DELIVERED records of all of `batch`, in order, in one bytes object, when the compiled
    kernel encodes every one of them (most batches); else None (`_encode_batch` record by record)."""
    if _native_delivered_data is None:
        return None
    return _native_delivered_data(batch, CHECKED_SUBJECTS, MIN_TIME_MS, MAX_TIME_MS, MAX_ID_BYTES)


def _encode_batch(batch: list[OutboundMessage]) -> list:
    """Per message of `batch`, its DELIVERED record from the compiled kernel, or None where it
    leaves the message to `_encode` (or is not built)."""
    if _native_delivered_records is None:
        return [None] * len(batch)
    return _native_delivered_records(batch, CHECKED_SUBJECTS, MIN_TIME_MS, MAX_TIME_MS, MAX_ID_BYTES)


def _encode(m: OutboundMessage) -> bytes:
    """The DELIVERED record of `m`; raises an InvalidMessage subtype for a message out of limits."""
    message = Message(m.message_id, m.subject, m.body, m.schedule_time, m.headers)
    # The body limit was enforced when the message was accepted; here only the record cap applies.
    payload = encode_message(message, max_body_bytes=MAX_PAYLOAD_BYTES)
    return encode_record(RecordType.DELIVERED, encode_delivered(m.dispatch_time, m.attempt, payload))


@attrs.define(eq=False)
class _Append:
    """One batch's records for a subject, waiting for the write and fsync that cover them."""
    data: bytes
    done: trio.Event = attrs.field(factory=trio.Event)
    result: DeliveryResult | None = None


@attrs.define(eq=False)
class SpoolTransport(Transport):
    """Delivers into the spool of `data_dir`."""

    data_dir: Path
    # Subjects whose file this transport found free of a torn tail. Files are opened per append,
    # so any number of subjects costs no open file descriptors between batches.
    _checked: set[str] = attrs.field(factory=set, init=False)
    # Per subject, the appends waiting for the one in progress (see `_append`); the flock covers
    # other writers.
    _waiting: dict[str, list[_Append]] = attrs.field(factory=dict, init=False)
    #: Over all subjects: appends asked for (a batch's share of one subject counts once), and the
    #: writes (each one write and one fsync) that covered them.
    appends: int = attrs.field(default=0, init=False)
    writes: int = attrs.field(default=0, init=False)
    # The threads its writes may hold (see TRANSPORT_THREADS): one per subject being written, so a
    # spool disk that stalls with many subjects in flight holds these, not the process's shared ones.
    _threads: ThreadPool = attrs.field(init=False, factory=lambda: ThreadPool(TRANSPORT_THREADS, "delayserver spool"))

    @classmethod
    def from_config(cls, address: str, options: Mapping[str, Any], data_dir: Path) -> SpoolTransport:
        """Raises ValueError for an address (the spool has none: it lives in the data directory) or any option."""
        check_option_names("spool", options, set())
        if address:
            raise ValueError(f"spool transport: address must be empty (the spool lives in the data directory), got {address!r}")
        return cls(Path(data_dir))

    @property
    def name(self) -> str:
        return f"spool {self.data_dir / SPOOL_DIR}"

    async def send_batch(self, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
        if len(set(map(_SUBJECT, messages))) == 1:
            return await self._send_subject(messages[0].subject, list(messages))  # one file: no task of its own
        by_subject: dict[str, list[int]] = defaultdict(list)
        for i, m in enumerate(messages):
            by_subject[m.subject].append(i)
        results: list[DeliveryResult] = [ACKED] * len(messages)

        async def send_subject(subject: str, indexes: list[int]) -> None:
            outcomes = await self._send_subject(subject, [messages[i] for i in indexes])
            for i, result in zip(indexes, outcomes):
                results[i] = result

        async with trio.open_nursery() as nursery:
            for subject, indexes in by_subject.items():
                nursery.start_soon(send_subject, subject, indexes)
        return results

    async def _send_subject(self, subject: str, batch: list[OutboundMessage]) -> list[DeliveryResult]:
        try:
            path = spool_path(self.data_dir, subject)
        except ValueError as e:
            return [DeliveryResult(Outcome.REJECTED, str(e))] * len(batch)
        data = _encode_whole(batch)
        if data is not None:  # most batches: every record from the compiled kernel, in one piece
            failure = await self._append(subject, path, data)
            return [ACKED if failure is None else failure] * len(batch)
        encoded = _encode_batch(batch)
        results: list[DeliveryResult] = []
        records = []
        for m, record in zip(batch, encoded):
            try:
                records.append(_encode(m) if record is None else record)
                results.append(ACKED)
            except InvalidMessage as e:
                results.append(DeliveryResult(Outcome.REJECTED, str(e)))
        if records:
            failure = await self._append(subject, path, b"".join(records))
            if failure is not None:
                results = [failure if r.outcome is Outcome.ACKED else r for r in results]
        return results

    async def _append(self, subject: str, path: Path, data: bytes) -> DeliveryResult | None:
        """Append and fsync; None when durable, else the RETRY result for the whole append.

        Group commit: the first append to a subject writes; those that arrive meanwhile queue, and
        it writes them all in one write and one fsync when its own is done, until none is left."""
        pending = _Append(data)
        self.appends += 1
        waiting = self._waiting.get(subject)
        if waiting is not None:  # a writer is at work on this subject: it takes this one too
            waiting.append(pending)
            await pending.done.wait()
            return pending.result
        waiting = self._waiting[subject] = [pending]
        try:
            # Shielded: the appends queued behind this one are written even if its caller is cancelled.
            with trio.CancelScope(shield=True):
                while waiting:
                    group = waiting[:]
                    waiting.clear()
                    try:
                        result = await self._write(subject, path, b"".join(p.data for p in group))
                    except BaseException as e:  # none of them is durable; the others must not wait forever
                        for p in group + waiting:
                            p.result = DeliveryResult(Outcome.RETRY, f"{path}: append failed: {e!r}")
                            p.done.set()
                        raise
                    for p in group:
                        p.result = result
                        p.done.set()
        finally:
            del self._waiting[subject]
        return pending.result

    async def _write(self, subject: str, path: Path, data: bytes) -> DeliveryResult | None:
        check_tail = subject not in self._checked
        try:
            await self._threads.run(partial(_append_durably, path, data, check_tail=check_tail))
        except OSError as e:
            # A failed truncation may have left a torn tail: check it again before the next append.
            self._checked.discard(subject)
            log.warning("%s: append failed, will retry: %s", path, e)
            return DeliveryResult(Outcome.RETRY, f"{path}: {e.strerror or e}")
        except StorageError as e:  # a failed fsync: nothing of this append counts as delivered
            self._checked.discard(subject)
            log.error("%s: append not durable, will retry: %s", path, e)
            return DeliveryResult(Outcome.RETRY, str(e))
        except SpoolCorrupt as e:
            log.error("%s", e)
            return DeliveryResult(Outcome.RETRY, str(e))
        finally:
            self.writes += 1
        self._checked.add(subject)
        return None

    async def aclose(self) -> None:
        """Nothing to release: files are opened per append."""
