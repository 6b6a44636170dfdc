"""The message operations a node serves: send, cancel, status; and the request handler that turns
frames into them.

Send goes to the receiver (group commit into message_log). Cancel and status wait until replay
has caught up with what is durable, then look the message up in its bucket's schedule_log and
dispatch_log. A cancel that finds the message pending appends a CANCEL record; once it is replayed
nothing fires the message any more, but one already handed to the sender still goes out: the
answer says ALREADY_DELIVERED then, never CANCELLED for a message a broker will see.
"""
from __future__ import annotations

import hmac
import logging

import trio

from delayserver import protocol as p
from delayserver.lookup import Lookup
from delayserver.message import CancelOutcome, DelayServerError, Handle, MessageState, ResultCode
from delayserver.node.receiver import Receiver
from delayserver.node.replication import Master
from delayserver.node.role import NodeRole
from delayserver.replayer import Replayer
from delayserver.storage.buckets import bucket_start
from delayserver.storage.errors import StorageError
from delayserver.storage.store import Store
from delayserver.wheel.tick_manager import TickManager

log = logging.getLogger("delayserver.node")

_SETTLED = {MessageState.DELIVERED: CancelOutcome.ALREADY_DELIVERED,
            MessageState.CANCELLED: CancelOutcome.ALREADY_CANCELLED,
            MessageState.UNKNOWN: CancelOutcome.UNKNOWN}


class MessageOperations:
    def __init__(self, store: Store, receiver: Receiver, replayer: Replayer, ticks: TickManager, role: NodeRole,
                 lookup: Lookup, *, on_acknowledged=lambda api, seconds: None):
        self.store = store
        self.lookup = lookup  # status and cancel find a message through the per-bucket id index
        self.receiver = receiver
        self.replayer = replayer
        self.ticks = ticks
        self.role = role
        # (api, seconds from a send request's arrival to its answer): the metrics' hook.
        self.on_acknowledged = on_acknowledged

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

    async def _replayed_past(self, offset: int, timeout_s: float = 5.0) -> None:
        with trio.move_on_after(timeout_s):
            while self.replayer.offset < offset:
                await self.replayer.caught_up.wait(0.01)

    async def status(self, handle: Handle) -> p.StatusResult:
        await self._replayed_past(self.receiver.durable_offset)
        found = await self.lookup.find(handle.schedule_time, handle.message_id)
        return p.StatusResult(ResultCode.OK, found.state.name.lower(), found.state, found.dispatch_time,
                              found.broker_group)

    async def cancel(self, handle: Handle) -> p.CancelResult:
        refusal = self.role.write_refusal()
        if refusal is not None:
            return p.CancelResult(refusal, refusal.description, CancelOutcome.UNKNOWN)
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


class Requests:
    """The request handler of a node's connections: `connection()` gives each its own responder."""

    def __init__(self, operations: MessageOperations, master: Master, *, cluster_secret: str = ""):
        self.operations = operations
        self.master = master
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

    async def respond(self, frame: p.Frame) -> bytes:
        """The response frame: the command's answer, or an ERROR frame with the refusal's code."""
        try:
            if frame.is_response:
                raise p.RemoteProtocolError("a response frame sent to the server")
            payload = await self._dispatch(frame)
            return p.encode(p.Frame(frame.command, frame.request_id, payload, is_response=True))
        except (p.RemoteProtocolError, DelayServerError) as e:
            return _error(frame.request_id, e.code, str(e))
        except StorageError as e:
            log.exception("storage error serving a request")
            return _error(frame.request_id, ResultCode.INTERNAL, str(e))
        except Exception as e:  # noqa: BLE001 - no request may take the node down
            if not self._logged:
                self._logged = True
                log.exception("unexpected error serving %s; answered INTERNAL", frame.command.name)
            return _error(frame.request_id, ResultCode.INTERNAL, f"internal error: {type(e).__name__}")

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
            return p.encode_status_response(await ops.status(p.decode_handle(frame.payload)))
        if cmd in (p.Command.SYNC_MESSAGE_LOG, p.Command.SYNC_DISPATCH_LOG, p.Command.SYNC_SNAPSHOT):
            if not self.cluster:
                raise DelayServerError("replication needs AUTH with the cluster secret", code=ResultCode.UNAUTHORIZED)
            if cmd == p.Command.SYNC_MESSAGE_LOG:
                return await master.message_log(frame.payload)
            if cmd == p.Command.SYNC_SNAPSHOT:
                return await master.snapshot(frame.payload)
            return await master.dispatch_log(frame.payload)
        raise DelayServerError(f"command {cmd.name} is not served by a delay server", code=ResultCode.BAD_REQUEST)


def _error(request_id: int, code: int, message: str) -> bytes:
    return p.encode(p.Frame(p.Command.ERROR, request_id, p.encode_error(p.ErrorResult(code, message)),
                            is_response=True))
