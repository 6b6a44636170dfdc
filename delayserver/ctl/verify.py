"""`delayctl verify DATA_DIR`: check a stopped node's whole data directory, read-only.

What is checked:
- every record of every segment of message_log, schedule_log and dispatch_log: framing, crc, that
  its payload decodes, that its type belongs to that log; a schedule_log record's time lies in its
  bucket; a dispatch_log record names a scheduled message of its bucket's schedule segment;
- message_log's sealed segments each end where the next one begins;
- no bucket is quarantined (a QUARANTINED bucket is damage until `delayctl salvage` lifts it);
- the checkpoints: each parses and its crc holds; replay.json's message_log offset is a record
  boundary within message_log, and each schedule segment size it holds is a record boundary within
  that segment (the replayer truncates back to it at start, so it must not lie past the end).

Outcomes: a torn tail at the end of a segment (what a crash leaves behind) is a warning, "torn tail
(will be truncated at next start)", since the node truncates it when it starts and it holds
nothing the node relies on; exit 0. Corruption (damage in a sealed segment, or before valid
records), a bad checkpoint or a cursor past the data is damage; exit 1, naming file and offset.
A path that is not a data directory is a usage error: exit 2.
A summary per log (segments, records, bytes) is printed either way.
"""
from __future__ import annotations

import sys
from pathlib import Path

import attrs

from delayserver.ctl.progress import Progress
from delayserver.ctl.segments import LOG_OF_TYPE, SegmentFile
from delayserver.replayer import CHECKPOINT_NAME
from delayserver.storage.buckets import bucket_name, parse_bucket_name
from delayserver.storage.checkpoint import CorruptCheckpoint, read_checkpoint
from delayserver.storage.quarantine import list_quarantined
from delayserver.storage.record import RecordType

LOGS = ("message_log", "schedule_log", "dispatch_log")
#: The widest bucket (segment_scale is at most an hour): a schedule time must lie this close after
#: its bucket's start, whatever scale the node runs with.
MAX_SCALE_MS = 60 * 60_000
TORN_NOTE = "(will be truncated at next start)"


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help="check every log and checkpoint of a data directory",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("data_dir", type=Path, help="the node's data directory")
    p.set_defaults(run=run)


@attrs.define
class LogSummary:
    segments: int = 0
    records: int = 0
    bytes: int = 0


@attrs.define
class Verification:
    """What verify found in one data directory."""

    data_dir: Path
    problems: list[str] = attrs.Factory(list)
    warnings: list[str] = attrs.Factory(list)
    logs: dict[str, LogSummary] = attrs.Factory(lambda: {name: LogSummary() for name in LOGS})
    checkpoints: int = 0
    replay: dict = attrs.Factory(dict)

    def segment(self, log: str, path: Path, *, sealed: bool = False) -> SegmentFile:
        summary = self.logs[log]
        segment = SegmentFile(path, sealed=sealed)
        summary.segments += 1
        summary.bytes += segment.size
        return segment

    def records(self, log: str, segment: SegmentFile):
        """The segment's good records, counted, with damage and foreign record types reported."""
        for offset, rtype, value in segment.records():
            if LOG_OF_TYPE.get(rtype) != log:
                self.problems.append(f"{segment.path}: {RecordType(rtype).name} record at offset {offset} "
                                     f"does not belong in {log}")
            self.logs[log].records += 1
            yield offset, rtype, value
        if segment.damage is None:
            return
        if segment.damage.torn:
            self.warnings.append(f"{segment.damage} {TORN_NOTE}")
        else:
            self.problems.append(str(segment.damage))


def run(args) -> int:
    data_dir: Path = args.data_dir
    # A path that is no data directory at all is a usage error (exit 2), not damage (exit 1).
    if not data_dir.is_dir():
        print(f"error: {data_dir}: not a directory", file=sys.stderr)
        return 2
    if not any((data_dir / name).is_dir() for name in (*LOGS, "checkpoint")):
        print(f"error: {data_dir}: not a data directory (no message_log, schedule_log, dispatch_log "
              "or checkpoint)", file=sys.stderr)
        return 2
    v = Verification(data_dir)
    total = sum(p.stat().st_size for name in LOGS for p in (data_dir / name).glob("*.log"))
    with Progress(total, "verify") as progress:
        check_checkpoints(v)
        check_message_log(v, progress)
        check_bucket_logs(v, progress)
    for q in list_quarantined(data_dir).values():
        v.problems.append(f"bucket {bucket_name(q.bucket)} QUARANTINED: {q.path} offset {q.offset}: {q.reason} "
                          f"(recover it with: delayctl salvage {data_dir} {bucket_name(q.bucket)})")
    report(v)
    return 1 if v.problems else 0


def check_checkpoints(v: Verification) -> None:
    directory = v.data_dir / "checkpoint"
    for path in sorted(directory.glob("*.tmp")):
        v.warnings.append(f"{path}: left by an interrupted checkpoint write; ignored (the old checkpoint stands)")
    for path in sorted(directory.glob("*.json")):
        v.checkpoints += 1
        try:
            data = read_checkpoint(path)
        except CorruptCheckpoint as e:
            v.problems.append(str(e))
            continue
        if path.name == CHECKPOINT_NAME:
            if well_formed_replay(data):
                v.replay = data
            else:
                v.problems.append(f"{path}: not a replay checkpoint: {data}")


def well_formed_replay(data: dict) -> bool:
    """Whether the cursors verify compares against the logs have the types the replayer writes."""
    offset = data.get("message_log_offset", 0)
    sizes = data.get("schedule_sizes", {})
    return (
        type(offset) is int and offset >= 0 and isinstance(sizes, dict)
        and all(type(size) is int and size >= 0 for size in sizes.values())
    )


def check_message_log(v: Verification, progress: Progress) -> None:
    directory = v.data_dir / "message_log"
    bases = sorted(int(p.stem) for p in directory.glob("*.log") if len(p.stem) == 20 and p.stem.isdigit())
    replay_offset = v.replay.get("message_log_offset")
    replay_ok = replay_offset is None
    end = bases[0] if bases else 0
    for i, base in enumerate(bases):
        path = directory / f"{base:020d}.log"
        sealed = i < len(bases) - 1
        segment = v.segment("message_log", path, sealed=sealed)
        # Record boundaries are kept only for the segment the replay offset falls in.
        holds_replay = replay_offset is not None and base <= replay_offset <= base + segment.size
        boundaries = {0}
        for offset, _, _ in v.records("message_log", segment):
            if holds_replay:
                boundaries.add(offset)
        valid_end = segment.damage.offset if segment.damage else segment.size
        boundaries.add(valid_end)
        replay_ok = replay_ok or (holds_replay and replay_offset - base in boundaries)
        if sealed and base + segment.size != bases[i + 1]:
            v.problems.append(f"{path}: sealed segment ends at offset {base + segment.size} "
                              f"but the next one starts at {bases[i + 1]}")
        end = base + valid_end
        progress.advance(segment.size)
    if not replay_ok:
        where = ("before the first segment" if bases and replay_offset < bases[0]
                 else f"past the end of message_log ({end})" if replay_offset > end
                 else "not at a record boundary")
        v.problems.append(f"{v.data_dir / 'checkpoint' / CHECKPOINT_NAME}: message_log offset {replay_offset} is {where}")


def check_bucket_logs(v: Verification, progress: Progress) -> None:
    sizes = v.replay.get("schedule_sizes", {})
    buckets = set()
    for log in ("schedule_log", "dispatch_log"):
        for path in (v.data_dir / log).glob("*.log"):
            try:
                buckets.add(parse_bucket_name(path.stem))
            except ValueError:
                v.warnings.append(f"{path}: not a bucket segment name; ignored")
    for bucket in sorted(buckets):
        schedule = check_schedule_segment(v, bucket, sizes.get(bucket_name(bucket)), progress)
        check_dispatch_segment(v, bucket, schedule, progress)


@attrs.frozen
class ScheduleSegment:
    """What a dispatch_log is checked against: the offsets of its bucket's scheduled messages."""

    scheduled: set[int]
    valid_end: int
    torn: bool


def check_schedule_segment(v: Verification, bucket: int, checkpointed: int | None,
                           progress: Progress) -> ScheduleSegment | None:
    """Check one schedule segment (None when there is none)."""
    path = v.data_dir / "schedule_log" / f"{bucket_name(bucket)}.log"
    if not path.exists():
        return None
    segment = v.segment("schedule_log", path)
    scheduled, boundaries = set(), {0}
    for offset, rtype, value in v.records("schedule_log", segment):
        boundaries.add(offset)
        if rtype == RecordType.SCHEDULED:
            scheduled.add(offset)
        due = value[1].schedule_time if rtype in (RecordType.SCHEDULED, RecordType.SCHEDULED_CANCEL) else bucket
        if not bucket <= due < bucket + MAX_SCALE_MS:
            v.problems.append(f"{path}: record at offset {offset} is due at {due}, outside its bucket")
    valid_end = segment.damage.offset if segment.damage else segment.size
    boundaries.add(valid_end)
    if checkpointed is not None and checkpointed not in boundaries:
        where = f"past its {valid_end} good bytes" if checkpointed > valid_end else "not at a record boundary"
        v.problems.append(f"{v.data_dir / 'checkpoint' / CHECKPOINT_NAME}: size {checkpointed} "
                          f"of {path.name} is {where}")
    progress.advance(segment.size)
    return ScheduleSegment(scheduled, valid_end, segment.damage is not None and segment.damage.torn)


def check_dispatch_segment(v: Verification, bucket: int, schedule: ScheduleSegment | None,
                           progress: Progress) -> None:
    path = v.data_dir / "dispatch_log" / f"{bucket_name(bucket)}.log"
    if not path.exists():
        return
    if schedule is None:
        v.warnings.append(f"{path}: no schedule segment for this bucket (left by an interrupted clean?)")
    segment = v.segment("dispatch_log", path)
    for offset, rtype, dispatch in v.records("dispatch_log", segment):
        if rtype != RecordType.DISPATCH or schedule is None or dispatch.schedule_offset in schedule.scheduled:
            continue
        if dispatch.schedule_offset >= schedule.valid_end:
            # Past the schedule segment's good records: in its torn tail (the replayer rebuilds
            # the same bytes at the same offsets), or past corruption already reported.
            if schedule.torn:
                v.warnings.append(f"{path}: record at offset {offset} names schedule_log offset "
                                  f"{dispatch.schedule_offset}, in the torn tail {TORN_NOTE}")
        else:
            v.problems.append(f"{path}: record at offset {offset} names schedule_log offset "
                              f"{dispatch.schedule_offset}, which is not a scheduled message")
    progress.advance(segment.size)


def report(v: Verification) -> None:
    for name, s in v.logs.items():
        print(f"{name:<14} {s.segments:>8} segments {s.records:>12} records {s.bytes:>14} bytes")
    print(f"{'checkpoint':<14} {v.checkpoints:>8} files")
    for text in v.warnings:
        print(f"warning: {text}")
    for text in v.problems:
        print(f"damage: {text}")
    if v.problems:
        print(f"{v.data_dir}: DAMAGED, {len(v.problems)} problem(s)")
    else:
        print(f"{v.data_dir}: healthy" + (f", {len(v.warnings)} warning(s)" if v.warnings else ""))
