"""The message operations a node serves: send, cancel, status, reschedule (and promote); and the
request handler that turns frames into them.

Send goes to the receiver (group commit into message_log). Cancel and status wait until replay
has caught up with what is durable, then look the message up in its bucket's schedule_log and
dispatch_log. A cancel that finds the message pending appends a CANCEL record; once it is replayed
nothing fires the message any more, but one already handed to the sender still goes out: the
answer says ALREADY_DELIVERED then, never CANCELLED for a message a broker will see.

Reschedule moves a pending message: it appends, in one durable write, the message again at its new
time and a CANCEL of the old one (receiver.append_move). From the decision until that CANCEL is
replayed the tick manager holds the message if it falls due (`begin_move`): so either the message was
already handed to the sender (ALREADY_DELIVERED, nothing appended) or the move wins and the old
time never fires. Promote is a reschedule to now. Cancel and reschedule of one handle take turns
(a lock per handle), so their answers agree with what happened.
"""
from __future__ import annotations

import base64
import hmac
import logging

import trio

from delayserver import protocol as p
from delayserver.lookup import Lookup, read_records
from delayserver.keyed_locks import KeyedLocks
from delayserver.message import (
    CancelOutcome, DelayServerError, Handle, InvalidMessage, MessageState, ResultCode, TimeSpec,
)
from delayserver.node.browse import BrowseQuery, Page
from delayserver.node.divergence import answer_epoch_end
from delayserver.node.receiver import Receiver
from delayserver.node.replication import Master
from delayserver.node.role import NodeRole
from delayserver.replayer import Replayer
from delayserver.storage.buckets import bucket_start
from delayserver.storage.record import decode_scheduled
from delayserver.storage.errors import StorageError
from delayserver.storage.store import Store
from delayserver.wheel.tick_manager import TickManager

log = logging.getLogger("delayserver.node")

_SETTLED = {MessageState.DELIVERED: CancelOutcome.ALREADY_DELIVERED,
            MessageState.CANCELLED: CancelOutcome.ALREADY_CANCELLED,
            MessageState.UNKNOWN: CancelOutcome.UNKNOWN}


class MessageOperations:
    def __init__(self, store: Store, receiver: Receiver, replayer: Replayer, ticks: TickManager, role: NodeRole,
                 lookup: Lookup, *, on_acknowledged=lambda api, seconds: None, browser=None):
        self.store = store
        self.lookup = lookup  # status and cancel find a message through the per-bucket id index
        self.receiver = receiver
        self.replayer = replayer
        self.ticks = ticks
        self.role = role
        # (api, seconds from a send request's arrival to its answer): the metrics' hook.
        self.on_acknowledged = on_acknowledged
        self.browser = browser  # node/browse.py
        # Per handle being cancelled or rescheduled: its lock and how many hold or wait for it.
        self._handle_locks = KeyedLocks()  # one cancel or reschedule of a handle at a time

    async def send(self, items: list[p.SendItem], api: str = "binary") -> list[p.SendResult]:
        """Store a batch; each item gets its result (OK only once durable), in order. `api` names
        the door it came in by (binary protocol or HTTP) for the acknowledgement latency."""
        refusal = self.role.write_refusal()
        if refusal is not None:
            return [p.SendResult(refusal, refusal.description, 0, i.message_id) for i in items]
        started = trio.current_time()
        results = await self.receiver.send(items)
        self.on_acknowledged(api, trio.current_time() - started)
        return results

    async def replayed_past(self, offset: int) -> None:
        """Return once replay has passed message_log `offset` (or after 5 s)."""
        await self._replayed_past(offset)

    async def _replayed_past(self, offset: int, timeout_s: float = 5.0) -> None:
        if self.replayer.offset >= offset:  # the common case: no cancel scope to set up
            return
        with trio.move_on_after(timeout_s):
            while self.replayer.offset < offset:
                await self.replayer.caught_up.wait(0.01)

    async def status(self, handle: Handle) -> p.StatusResult:
        await self._replayed_past(self.receiver.durable_offset)
        return _status_result(await self.lookup.find(handle.schedule_time, handle.message_id))

    def status_now(self, handle: Handle) -> p.StatusResult | None:
        """`status` when it needs no wait (the bucket's indexes are built), or None.

        While replay is behind what is durable, only PENDING and DELIVERED are answered at once:
        what replay has yet to apply may hold an acknowledged send (a message the logs do not
        show yet, or a second one of the same handle after the first was cancelled), but never
        an acknowledged cancel or move (both are acknowledged only once replayed), and nothing in
        message_log undoes a delivery; UNKNOWN and CANCELLED wait for replay, as `status` does."""
        found = self.lookup.find_now(handle.schedule_time, handle.message_id)
        if found is None:
            return None
        if found.state not in _ANSWERED_BEFORE_REPLAY and self.replayer.offset < self.receiver.durable_offset:
            return None
        return _status_result(found)

    async def cancel(self, handle: Handle) -> p.CancelResult:
        refusal = self.role.write_refusal()
        if refusal is not None:
            return p.CancelResult(refusal, refusal.description, CancelOutcome.UNKNOWN)
        async with self._handle_locks.hold(handle):
            return await self._cancel(handle)

    async def _cancel(self, handle: Handle) -> p.CancelResult:
        await self._replayed_past(self.receiver.durable_offset)
        found = await self.lookup.find(handle.schedule_time, handle.message_id)
        outcome = _SETTLED.get(found.state)
        if outcome is not None:
            return p.CancelResult(ResultCode.OK, outcome.name.lower(), outcome)
        code, message, offset = await self.receiver.append_cancel(handle.schedule_time, handle.message_id)
        if code != ResultCode.OK:
            return p.CancelResult(code, message, CancelOutcome.UNKNOWN)
        await self._replayed_past(offset + 1)
        # The cancel is applied now: nothing fires it any more. What fired before it still goes.
        bucket = bucket_start(handle.schedule_time, self.store.segment_scale_ms)
        if any(self.ticks.ref(bucket, o) in self.ticks.inflight for o in found.offsets):
            return p.CancelResult(ResultCode.OK, "already delivered (in flight)", CancelOutcome.ALREADY_DELIVERED)
        after = await self.lookup.find(handle.schedule_time, handle.message_id)
        if after.state == MessageState.DELIVERED:
            return p.CancelResult(ResultCode.OK, "already delivered", CancelOutcome.ALREADY_DELIVERED)
        self.ticks.remove_cancelled(bucket, found.offsets, handle.schedule_time)
        return p.CancelResult(ResultCode.OK, "cancelled", CancelOutcome.CANCELLED)

    async def reschedule(self, handle: Handle, when: TimeSpec) -> p.RescheduleResult:
        """Move a pending message to `when` (promote: TimeSpec.delay(0)). The answer is RESCHEDULED
        with the new handle's time, or who won instead (ALREADY_DELIVERED, ALREADY_CANCELLED,
        UNKNOWN), or a refusal (BAD_SCHEDULE_TIME, NOT_MASTER, DISK_FULL, ...)."""
        refusal = self.role.write_refusal()
        if refusal is not None:
            return p.RescheduleResult(refusal, refusal.description, CancelOutcome.UNKNOWN)
        try:
            new_time = self.receiver.schedule_time(when, self.receiver.clock.now_ms())
        except InvalidMessage as e:
            return p.RescheduleResult(e.code, str(e), CancelOutcome.UNKNOWN)
        async with self._handle_locks.hold(handle):
            return await self._reschedule(handle, new_time)

    async def _reschedule(self, handle: Handle, new_time: int) -> p.RescheduleResult:
        await self._replayed_past(self.receiver.durable_offset)
        found = await self.lookup.find(handle.schedule_time, handle.message_id)
        outcome = _SETTLED.get(found.state)
        if outcome is not None:
            return p.RescheduleResult(ResultCode.OK, outcome.name.lower().replace("_", " "), outcome)
        if new_time == handle.schedule_time:
            return p.RescheduleResult(ResultCode.OK, "already due then", CancelOutcome.RESCHEDULED, new_time)
        bucket = bucket_start(handle.schedule_time, self.store.segment_scale_ms)
        ticks = self.ticks
        if any(ticks.ref(bucket, o) in ticks.inflight for o in found.offsets):
            return p.RescheduleResult(ResultCode.OK, "already delivered (in flight)", CancelOutcome.ALREADY_DELIVERED)
        # No await between the check above and this: from here a due copy is held, not sent.
        ticks.begin_move(handle.schedule_time, handle.message_id)
        moved = False
        try:
            [(_, data, s, e)] = await read_records(self.store.schedule_log, bucket, [max(found.offsets)])
            _, message = decode_scheduled(data, s, e)
            code, text, end = await self.receiver.append_move(message, new_time)
            if code != ResultCode.OK:
                return p.RescheduleResult(code, text, CancelOutcome.UNKNOWN)
            moved = True
            # Held until the cancel is replayed: from then on the due queue drops the old time by
            # itself (a copy already fired into the ready queue included).
            while self.replayer.offset < end:
                await self.replayer.caught_up.wait(0.01)
        finally:
            ticks.end_move(handle.schedule_time, handle.message_id, moved)
        ticks.remove_cancelled(bucket, found.offsets, handle.schedule_time)
        return p.RescheduleResult(ResultCode.OK, "rescheduled", CancelOutcome.RESCHEDULED, new_time)


    async def browse(self, query: BrowseQuery) -> Page:
        """A page of messages matching `query`, as of everything acknowledged before it."""
        await self._replayed_past(self.receiver.durable_offset)
        return await self.browser.page(query)


def page_json(page: Page) -> dict:
    """A browse page as the JSON the protocol and the HTTP API carry."""
    return {"messages": [listed_json(m) for m in page.messages], "cursor": page.cursor, "examined": page.examined}


def listed_json(m) -> dict:
    out = {"handle": str(Handle(m.schedule_time, m.message_id)), "id": m.message_id, "subject": m.subject,
           "schedule_time": m.schedule_time, "store_time": m.store_time, "state": m.state.name.lower(),
           "headers": m.headers}
    if m.dispatch_time:
        out["dispatch_time"], out["broker_group"] = m.dispatch_time, m.broker_group
    if m.body is not None:
        out["body"] = base64.b64encode(m.body).decode("ascii")
    return out


class Requests:
    """The request handler of a node's connections: `connection()` gives each its own responder."""

    def __init__(self, operations: MessageOperations, master: Master, schedules=None, transactions=None, *,
                 cluster_secret: str = "", role=None):
        """`role`: the node's NodeRole; replication requests are served only while it is master."""
        self.operations = operations
        self.master = master
        self.role = role
        self.schedules = schedules  # schedules/service.py
        self.transactions = transactions  # a TransactionOperations: half messages
        self.cluster_secret = cluster_secret.encode("utf-8")

    def connection(self) -> ConnectionRequests:
        return ConnectionRequests(self)


class ConnectionRequests:
    """Answers each request frame of one connection with the bytes of its response.

    Nothing a request does can end the node: a refusal is answered with its code, and an
    unexpected exception with INTERNAL, logged with its traceback once per connection. With a
    cluster secret configured, replication requests are served only on a connection that sent AUTH
    with it (producers' secrets do not let a client pull the logs or pin the cleaner)."""

    def __init__(self, requests: Requests):
        self._requests = requests
        self.cluster = not requests.cluster_secret
        self._logged = False

    def authenticate(self, secret: bytes) -> bool:
        """True, and this connection is a cluster node's, when `secret` is the cluster secret."""
        cluster_secret = self._requests.cluster_secret
        if cluster_secret and hmac.compare_digest(secret, cluster_secret):
            self.cluster = True
        return self.cluster and bool(cluster_secret)

    async def respond(self, frame: p.Frame, session=None) -> bytes:
        """The response frame: the command's answer, or an ERROR frame with the refusal's code.
        `session`: the connection's ProducerSession, which takes the answers to the server's own
        requests (TXN_CHECK); for those the result is empty (nothing to send)."""
        try:
            if frame.is_response:
                if session is not None and session.on_response(frame):
                    return b""
                raise p.RemoteProtocolError("a response frame sent to the server")
            transactions = self._requests.transactions
            if frame.command in _TRANSACTION_COMMANDS and transactions is not None:
                return _answer(frame, await transactions.respond(frame, session))
            return _answer(frame, await self._dispatch(frame))
        except Exception as e:  # noqa: BLE001 - no request may take the node down
            return self._failed(frame, e)

    def answer_now(self, frame: p.Frame) -> bytes | None:
        """The response frame to a PING, or to a STATUS that needs no wait (see
        `MessageOperations.status_now`), built in line by the connection's pump without a task of
        its own; None for any other frame, or a status that must wait: `respond` answers those."""
        if frame.is_response:
            return None
        if frame.command == p.Command.PING:
            return _answer(frame, frame.payload)
        if frame.command != p.Command.STATUS:
            return None
        try:
            handle = p.decode_handle(frame.payload)
            result = self._requests.operations.status_now(handle)
            if result is None:
                return None
            return _answer(frame, self._status_response(handle, result))
        except Exception as e:  # noqa: BLE001 - no request may take the node down
            return self._failed(frame, e)

    def _failed(self, frame: p.Frame, e: Exception) -> bytes:
        """The ERROR frame for a request that raised `e` (called in its except clause)."""
        if isinstance(e, (p.RemoteProtocolError, DelayServerError)):
            return _error(frame.request_id, e.code, str(e))
        if isinstance(e, StorageError):
            log.exception("storage error serving a request")
            return _error(frame.request_id, ResultCode.INTERNAL, str(e))
        if not self._logged:
            self._logged = True
            log.exception("unexpected error serving %s; answered INTERNAL", frame.command.name)
        return _error(frame.request_id, ResultCode.INTERNAL, f"internal error: {type(e).__name__}")

    def _status_response(self, handle: Handle, result: p.StatusResult) -> bytes:
        """A status's payload; a message the logs do not know may be an open half message."""
        if result.state == MessageState.UNKNOWN and self._requests.transactions is not None:
            result = self._requests.transactions.status(handle) or result
        return p.encode_status_response(result)

    async def _dispatch(self, frame: p.Frame) -> bytes:
        cmd, ops, master = frame.command, self._requests.operations, self._requests.master
        if cmd == p.Command.PING:
            return frame.payload
        if cmd == p.Command.AUTH:
            self.authenticate(frame.payload)  # a producer's secret was checked by the gate already
            return b""
        if cmd == p.Command.SEND:
            return p.encode_send_response(await ops.send(p.decode_send_request(frame.payload)))
        if cmd == p.Command.CANCEL:
            return p.encode_cancel_response(await ops.cancel(p.decode_handle(frame.payload)))
        if cmd == p.Command.STATUS:
            handle = p.decode_handle(frame.payload)
            return self._status_response(handle, await ops.status(handle))
        if cmd == p.Command.SCHEDULE:
            return p.encode_json(await self._requests.schedules.handle(p.decode_json(frame.payload)))
        if cmd == p.Command.BROWSE:
            query = BrowseQuery.from_json(p.decode_json(frame.payload))
            return p.encode_json(page_json(await ops.browse(query)))
        if cmd == p.Command.RESCHEDULE:
            return p.encode_reschedule_response(await ops.reschedule(*p.decode_reschedule_request(frame.payload)))
        if cmd in (p.Command.SYNC_MESSAGE_LOG, p.Command.SYNC_DISPATCH_LOG, p.Command.SYNC_SNAPSHOT,
                   p.Command.SYNC_EPOCH_END, p.Command.SYNC_DISPATCH_DIGEST):
            if not self.cluster:
                raise DelayServerError("replication needs AUTH with the cluster secret", code=ResultCode.UNAUTHORIZED)
            role = self._requests.role
            if role is not None and not role.is_master():
                # A slave's log is a copy that may still be cut back: never a source for another.
                raise DelayServerError("this node is not a master: replicate from the group's master",
                                       code=ResultCode.NOT_MASTER)
            if cmd == p.Command.SYNC_MESSAGE_LOG:
                return await master.message_log(frame.payload)
            if cmd == p.Command.SYNC_SNAPSHOT:
                return await master.snapshot(frame.payload)
            if cmd == p.Command.SYNC_EPOCH_END:
                return answer_epoch_end(master.store, master.receiver, frame.payload)
            if cmd == p.Command.SYNC_DISPATCH_DIGEST:
                return await master.dispatch_digest(frame.payload)
            return await master.dispatch_log(frame.payload)
        raise DelayServerError(f"command {cmd.name} is not served by a delay server", code=ResultCode.BAD_REQUEST)


_TRANSACTION_COMMANDS = frozenset({p.Command.PREPARE, p.Command.COMMIT, p.Command.ROLLBACK, p.Command.TXN_CHECK,
                                   p.Command.PRODUCER_REGISTER})


#: States a status may answer before replay has passed every durable record (`status_now`).
_ANSWERED_BEFORE_REPLAY = frozenset({MessageState.PENDING, MessageState.DELIVERED})


def _status_result(found) -> p.StatusResult:
    return p.StatusResult(ResultCode.OK, found.state.name.lower(), found.state, found.dispatch_time,
                          found.broker_group)


def _answer(frame: p.Frame, payload: bytes) -> bytes:
    """The response frame to `frame` carrying `payload`."""
    return p.encode(p.Frame(frame.command, frame.request_id, payload, is_response=True))


def _error(request_id: int, code: int, message: str) -> bytes:
    return p.encode(p.Frame(p.Command.ERROR, request_id, p.encode_error(p.ErrorResult(code, message)),
                            is_response=True))
