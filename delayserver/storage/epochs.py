"""The epoch history of a message_log: where each master epoch's records begin.

Every batch of message_log opens with an EPOCH record (storage/record.py). The history is the
index of those records that matters: ``(epoch, start offset)`` for the first batch of each epoch,
ascending in both. An epoch's records end where the next epoch begins (or at the log's end), as a
Kafka leader-epoch cache has it. A log written before epochs existed has no EPOCH record: all of
it is epoch 0, and the history is empty.

It is kept in ``message_log/epochs.json``, written like a checkpoint (temp file, fsync, rename),
and written *before* the first batch of a new epoch reaches the log: so after a crash the file
names every epoch the log holds, and maybe one whose first batch never made it, which `open`
drops (it starts at or past the log's end). A missing or damaged file is rebuilt by reading the
log once, and written, empty or not.
"""
from __future__ import annotations

import bisect
import logging
from pathlib import Path

from delayserver.storage.checkpoint import CorruptCheckpoint, read_checkpoint, write_checkpoint
from delayserver.storage.errors import CorruptSegment, StorageError
from delayserver.storage.record import EPOCH_HEAD, RecordType, iter_checked_records

log = logging.getLogger("delayserver.storage")

FILE_NAME = "epochs.json"


class EpochRegression(StorageError):
    """A batch of an older epoch than the log's last: never written (a log never goes back)."""


class EpochHistory:
    """``(epoch, start)`` pairs of one message_log; epoch 0 implicitly starts at offset 0."""

    def __init__(self, path: Path, entries: list[tuple[int, int]] | None = None):
        self.path = Path(path)
        self.entries: list[tuple[int, int]] = list(entries or [])

    @classmethod
    def open(cls, message_log) -> EpochHistory:
        """The history of `message_log` (a MessageLog just opened): from its file, cut back to the
        log's end, or rebuilt from the log when the file is missing or damaged."""
        path = Path(message_log.directory) / FILE_NAME
        try:
            data = read_checkpoint(path)
        except CorruptCheckpoint as e:
            log.error("%s: %s; rebuilding it from message_log", path, e)
            data = None
        if data is not None:
            try:
                entries = [(int(e), int(s)) for e, s in data["epochs"]]
            except (KeyError, TypeError, ValueError) as e:
                log.error("%s: unreadable (%s); rebuilding it from message_log", path, e)
                data = None
        if data is None:
            self = cls(path, _scan(message_log))
            # Written even when empty (a node that never had a master epoch, standalone): without
            # the file, every start would read the whole log again (9 s at 10,000,000 messages).
            # A log with nothing in it has nothing to read again.
            if self.entries or message_log.end_offset > message_log.start_offset:
                self._save()
            return self
        self = cls(path, entries)
        self.truncate(message_log.end_offset)
        return self

    @property
    def last_epoch(self) -> int:
        """The epoch of the log's last batch (0: none carries one)."""
        return self.entries[-1][0] if self.entries else 0

    def epoch_at(self, offset: int) -> int:
        """The epoch of the record at `offset`."""
        i = bisect.bisect_right(self.entries, offset, key=lambda e: e[1])
        return self.entries[i - 1][0] if i else 0

    def begin(self, epoch: int, offset: int) -> None:
        """Note that a batch of `epoch` is about to be written at `offset`; durable before it
        returns when `epoch` is new. Raises EpochRegression for an epoch older than the log's last
        (a log never goes back in epochs) and StorageError when the file cannot be written."""
        last = self.last_epoch
        if epoch == last:
            return
        if epoch < last:
            raise EpochRegression(f"a batch of epoch {epoch} cannot follow one of epoch {last} in message_log")
        self.entries.append((epoch, offset))
        try:
            self._save()
        except Exception:
            self.entries.pop()
            raise

    def note_batches(self, data, base: int) -> None:
        """`begin` each EPOCH record of `data` (whole checked records, about to be written at
        `base`): the records a slave copies from its master."""
        for pos, rtype, s, _ in iter_checked_records(data):
            if rtype == RecordType.EPOCH:
                self.begin(EPOCH_HEAD.unpack_from(data, s)[0], base + pos)

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """Leader-epoch lookup: ``(e, end)`` where `e` is the largest epoch of this log not above
        `epoch` and `end` the offset where the records of `e` end (the start of the next epoch,
        or `log_end`). Epoch 0 is always known, ending where the first epoch begins."""
        i = bisect.bisect_right(self.entries, epoch, key=lambda e: e[0])
        found = self.entries[i - 1][0] if i else 0
        end = self.entries[i][1] if i < len(self.entries) else log_end
        return found, end

    def truncate(self, offset: int) -> None:
        """Forget the epochs that begin at or after `offset` (the log was cut there)."""
        keep = [e for e in self.entries if e[1] < offset]
        if keep != self.entries:
            self.entries = keep
            self._save()

    def _save(self) -> None:
        write_checkpoint(self.path, {"epochs": [list(e) for e in self.entries]})


def _scan(message_log) -> list[tuple[int, int]]:
    """The history read from the log itself (up to any damage, which the log reports itself)."""
    entries: list[tuple[int, int]] = []
    offset = message_log.start_offset
    try:
        while True:
            data, base = message_log.read(offset, 4 << 20)
            if not data:
                break
            for pos, rtype, s, e in iter_checked_records(data):
                if rtype == RecordType.EPOCH:
                    epoch = EPOCH_HEAD.unpack_from(data, s)[0]
                    if not entries or epoch > entries[-1][0]:
                        entries.append((epoch, base + pos))
            offset = base + len(data)
    except CorruptSegment as e:
        log.error("epoch history read up to damage in message_log: %s", e)
    return entries
