"""Prepare, commit, rollback, check and park: each one record through the receiver, so that it is
durable, replicated and replayed like every other record, and applied to the half messages of
every node by replay (`state`).

A half message is resolved once: the resolutions of one (schedule time, id) are serialized on this
node, and each waits until replay has applied what is durable before it decides, so a second COMMIT
answers "already committed" instead of scheduling the message twice.
"""
from __future__ import annotations

import logging

import attrs
import trio

from delayserver import protocol as p
from delayserver.keyed_locks import KeyedLocks
from delayserver.message import BadHeaders, DelayServerError, Handle, InvalidMessage, MessageState, ResultCode, TimeKind, TimeSpec
from delayserver.message import TransactionState as TS
from delayserver.sender.parked import ParkedLog, iter_parked
from delayserver.storage.errors import StorageError
from delayserver.storage.record import (
    FLAG_TRANSACTIONAL, TRANS_CHECK_MAX_PREFIX, Cancel, Message, ParkReason, Prepare, RecordError, RecordType,
    TxnCheck, TxnPark, decode_prepare, encode_cancel, encode_group, encode_message, encode_message_fields, encode_prepare,
    encode_txn_check, encode_txn_park, iter_records,
)
from delayserver.transactions.state import Half, HalfMessages, Key

log = logging.getLogger("delayserver.transactions")

#: The schedule_log offset a parked half message is recorded with: it was never in schedule_log,
#: and no real offset is this large, so a reload of its bucket skips nothing because of it.
NO_SCHEDULE_OFFSET = (1 << 64) - 1

_DONE = {TS.COMMIT: "committed", TS.ROLLBACK: "rolled back", TS.PARKED: "parked after unanswered checks"}


@attrs.frozen
class _ParkedDelivery:
    """What ParkedLog.park takes, for a half message."""

    message: Message
    attempt: int
    schedule_offset: int = NO_SCHEDULE_OFFSET


class TransactionOperations:
    def __init__(self, store, receiver, replayer, lookup, role, config, clock, parked: ParkedLog):
        self.store = store
        self.receiver = receiver
        self.replayer = replayer
        self.halves: HalfMessages = replayer.transactions
        self.lookup = lookup
        self.role = role
        self.config = config
        self.clock = clock
        self.parked = parked
        self._locks = KeyedLocks()

    # --- helpers ------------------------------------------------------------------------------

    async def _replayed_past(self, offset: int, timeout_s: float = 5.0) -> None:
        with trio.move_on_after(timeout_s):
            while self.replayer.offset < offset:
                await self.replayer.caught_up.wait(0.01)

    async def read_prepare(self, half: Half) -> Prepare:
        """The PREPARE record of `half` from message_log (StorageError if it cannot be read).

        Read in a worker thread: a half message committed, checked or parked long after it came
        may be on disk only, and no request waits on the event loop while the disk seeks."""
        try:
            data, base = await trio.to_thread.run_sync(self.store.message_log.reader(half.offset, 1))
        except OSError as e:  # FileNotFoundError: its segment is gone (the half resolved meanwhile)
            raise StorageError(f"PREPARE record at message_log offset {half.offset}: {e}") from None
        for _, rtype, s, e in iter_records(data):
            if rtype == RecordType.PREPARE:
                try:
                    return decode_prepare(data, s, e)
                except RecordError as err:
                    raise StorageError(f"PREPARE record at message_log offset {half.offset}: {err.reason}") from None
            break
        raise StorageError(f"no PREPARE record at message_log offset {half.offset}")

    # --- prepare, commit, rollback ------------------------------------------------------------

    async def prepare(self, group: str, check_immunity_ms: int, item: p.SendItem) -> p.SendResult:
        """Store a half message; OK once durable (its handle names it)."""
        refusal = self.role.write_refusal()
        if refusal is not None:
            return p.SendResult(refusal, refusal.description, 0, item.message_id)
        now = self.clock.now_ms()
        try:
            when = self.receiver.schedule_time(item.time, now)
            message = encode_message_fields(item.message_id, item.subject, item.body, when, item.headers, now,
                                            max_body_bytes=self.config.max_message_bytes)
            payload = encode_prepare(group, check_immunity_ms, message)
        except InvalidMessage as e:
            return p.SendResult(e.code, str(e), 0, item.message_id)
        except ValueError as e:  # the check immunity
            return p.SendResult(ResultCode.BAD_REQUEST, str(e), 0, item.message_id)
        key = (when, item.message_id)
        async with self._locks.hold(key):
            await self._replayed_past(self.receiver.durable_offset)
            if key in self.halves.open:
                return p.SendResult(ResultCode.OK, "already prepared", when, item.message_id)
            done = self.halves.outcome(key)
            if done is not None:
                return p.SendResult(ResultCode.TXN_RESOLVED, f"already {_DONE[done]}", 0, item.message_id)
            code, text, offset = await self.receiver.append_record(RecordType.PREPARE, payload)
            if code != ResultCode.OK:
                return p.SendResult(code, text, 0, item.message_id)
            await self._replayed_past(offset + 1)
        return p.SendResult(ResultCode.OK, "prepared", when, item.message_id)

    async def commit(self, handle: Handle) -> p.TransactionResult:
        """Schedule the half message at its time (at once if that is past)."""
        return await self._resolve(handle, TS.COMMIT)

    async def rollback(self, handle: Handle) -> p.TransactionResult:
        """Drop the half message: it is never delivered."""
        return await self._resolve(handle, TS.ROLLBACK)

    async def _resolve(self, handle: Handle, want: TS) -> p.TransactionResult:
        refusal = self.role.write_refusal()
        if refusal is not None:
            return p.TransactionResult(refusal, refusal.description, TS.UNKNOWN)
        key = (handle.schedule_time, handle.message_id)
        async with self._locks.hold(key):
            await self._replayed_past(self.receiver.durable_offset)
            half = self.halves.open.get(key)
            if half is None or half.parking:
                return await self._settled(key, want)
            now = self.clock.now_ms()
            if want == TS.COMMIT:
                m = (await self.read_prepare(half)).message
                payload = encode_message_fields(m.message_id, m.subject, m.body, m.schedule_time, m.headers, now,
                                                flags=m.flags | FLAG_TRANSACTIONAL, max_body_bytes=len(m.body))
                rtype = RecordType.COMMIT
            else:
                payload = encode_cancel(Cancel(handle.message_id, handle.schedule_time, now))
                rtype = RecordType.ROLLBACK
            code, text, offset = await self.receiver.append_record(rtype, payload)
            if code != ResultCode.OK:
                return p.TransactionResult(code, text, TS.UNKNOWN)
            await self._replayed_past(offset + 1)
        return p.TransactionResult(ResultCode.OK, _DONE[want], want)

    async def _settled(self, key: Key, want: TS) -> p.TransactionResult:
        """The answer for a half message no longer open: OK if it was resolved the way asked."""
        outcome = self.halves.outcome(key)
        if outcome is None and want == TS.COMMIT:
            # Resolutions are remembered only so far back; a committed message is in schedule_log.
            found = await self.lookup.find(*key)
            if found.state in (MessageState.PENDING, MessageState.DELIVERED, MessageState.CANCELLED):
                outcome = TS.COMMIT
        if outcome is None:
            return p.TransactionResult(ResultCode.TXN_NOT_FOUND, ResultCode.TXN_NOT_FOUND.description, TS.UNKNOWN)
        if outcome == want:
            return p.TransactionResult(ResultCode.OK, f"already {_DONE[outcome]}", outcome)
        return p.TransactionResult(ResultCode.TXN_RESOLVED, f"already {_DONE[outcome]}", outcome)

    # --- the checker's steps --------------------------------------------------------------------

    async def check_request(self, half: Half) -> p.CheckRequest:
        m = (await self.read_prepare(half)).message
        item = p.SendItem(m.message_id, m.subject, TimeSpec(TimeKind.AT, m.schedule_time), m.body, dict(m.headers))
        return p.CheckRequest(half.group, half.checks + 1, item)

    async def record_check(self, half: Half) -> bool:
        """Durably count one more check of `half` (so the count survives a restart or failover);
        False if the half message is resolved already or the record was refused."""
        async with self._locks.hold(half.key):
            if self.halves.open.get(half.key) is not half or half.parking:
                return False
            record = TxnCheck(half.message_id, half.schedule_time, half.checks + 1, self.clock.now_ms())
            code, text, offset = await self.receiver.append_record(RecordType.TXN_CHECK, encode_txn_check(record))
            if code != ResultCode.OK:
                log.warning("check of %s not recorded: %s", half.message_id, text)
                return False
            await self._replayed_past(offset + 1)
            return True

    async def park(self, half: Half, reason: ParkReason) -> bool:
        """Resolve `half` as parked (the park writer then writes its PARKED record)."""
        async with self._locks.hold(half.key):
            if self.halves.open.get(half.key) is not half or half.parking:
                return False
            record = TxnPark(half.message_id, half.schedule_time, reason, self.clock.now_ms())
            code, text, offset = await self.receiver.append_record(RecordType.TXN_PARK, encode_txn_park(record))
            if code != ResultCode.OK:
                log.warning("park of %s not recorded: %s", half.message_id, text)
                return False
            await self._replayed_past(offset + 1)
            return True

    # --- status ---------------------------------------------------------------------------------

    def status(self, handle: Handle) -> p.StatusResult | None:
        """PREPARED, with its checks and next check time, for an open half message; None otherwise."""
        half = self.halves.open.get((handle.schedule_time, handle.message_id))
        if half is not None and not half.parking:
            c = self.config
            return p.StatusResult(ResultCode.OK, "prepared", MessageState.PREPARED, 0, "", half.checks,
                                  half.next_check_time(c.transaction_timeout_ms, c.check_interval_ms))
        outcome = self.halves.outcome((handle.schedule_time, handle.message_id))
        if outcome in (TS.ROLLBACK, TS.PARKED):
            group = f" on {TRANS_CHECK_MAX_PREFIX}{half.group}" if half is not None else ""
            return p.StatusResult(ResultCode.OK, f"half message {_DONE[outcome]}{group}", MessageState.UNKNOWN)
        return None

    # --- requests -------------------------------------------------------------------------------

    async def respond(self, frame: p.Frame, session=None) -> bytes:
        """The response payload of a transactional request (PREPARE, COMMIT, ROLLBACK,
        PRODUCER_REGISTER); raises RemoteProtocolError or DelayServerError to refuse it."""
        cmd = frame.command
        if cmd == p.Command.PREPARE:
            group, immunity, item = p.decode_prepare_request(frame.payload)
            return p.encode_send_response([await self.prepare(group, immunity, item)])
        if cmd in (p.Command.COMMIT, p.Command.ROLLBACK):
            handle = p.decode_handle(frame.payload)
            result = await (self.commit(handle) if cmd == p.Command.COMMIT else self.rollback(handle))
            return p.encode_transaction_response(result)
        if cmd == p.Command.PRODUCER_REGISTER:
            group = p.decode_register_request(frame.payload)
            encode_group(group)  # BadSubject for a name no parked subject can carry
            if session is None:
                raise DelayServerError("this connection cannot take checks", code=ResultCode.BAD_REQUEST)
            session.register(group)
            return b""
        raise DelayServerError(f"{cmd.name} is sent by the server to producers, not to it", code=ResultCode.BAD_REQUEST)

    # --- the park writer ------------------------------------------------------------------------

    def _parked_keys(self) -> set[Key]:
        return {(pk.message.schedule_time, pk.message.message_id) for _, pk in iter_parked(self.parked.directory)
                if pk.schedule_offset == NO_SCHEDULE_OFFSET}

    async def serve_parking(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Write the PARKED record of each half message replay resolved as parked, once."""
        written = await trio.to_thread.run_sync(self._parked_keys)
        task_status.started()
        while True:
            while self.halves.to_park:
                half = self.halves.to_park[0]
                if half.key not in written:
                    try:
                        await self._write_parked(half)
                    except StorageError as e:
                        log.error("parking half message %s failed, will retry: %s", half.message_id, e)
                        await trio.sleep(1)
                        continue
                    written.add(half.key)
                self.halves.to_park.pop(0)
                self.halves.parked_written(half)
            await self.halves.park_wakeup.wait()

    async def _write_parked(self, half: Half) -> None:
        m = (await self.read_prepare(half)).message
        subject = TRANS_CHECK_MAX_PREFIX + half.group
        headers = {**m.headers, "origin-subject": m.subject, "producer-group": half.group,
                   "transaction-checks": str(half.checks)}
        parked = m._replace(subject=subject, headers=headers)
        try:
            encode_message(parked, max_body_bytes=len(m.body))
        except BadHeaders:  # no room for the extra headers: the message as it came
            parked = m._replace(subject=subject)
        reason = ("transaction checked %d times without an answer" % half.checks if half.parking == ParkReason.CHECK_MAX
                  else "transaction unresolved past retention")
        await self.parked.park(_ParkedDelivery(parked, half.checks), reason, self.clock.now_ms())
        log.warning("half message %s of group %s parked on %s: %s", m.message_id, half.group, subject, reason)
