"""Producer clients: `AsyncProducer` for trio code and `Producer`, a blocking facade.

    async with AsyncProducer("127.0.0.1:20801") as producer:
        handle = await producer.send("orders.expire", b"...", delay=30_000)
        print(await producer.status(handle))

    with Producer("127.0.0.1:20801") as producer:
        handle = producer.send("orders.expire", b"...", delay_level=3)

Transactional sends, as RocketMQ's TransactionMQProducer: give a producer `group` and a
`transaction_listener` (`execute_local_transaction(message, arg)` and
`check_local_transaction(message)`, each returning a TransactionState), then
`send_in_transaction(...)`. The producer registers its group on its connection and answers the
server's checks by calling the listener (a plain function in a worker thread, so the blocking
Producer answers on its background thread while the caller's thread does its own work).

One connection is reused and requests are pipelined over it (a reader task matches responses to
request ids). A lost connection fails the requests in flight with ConnectionError (the producer
may retry them: delivery is at least once, and the id travels with the message for dedupe) and
the next request reconnects, with back-off, within `timeout`. Every non-OK result raises the
exception of its result code, carrying the server's code and message.
"""
from __future__ import annotations

import base64
import inspect
import itertools
import logging
import os
import ssl
import threading
import time
from typing import AsyncIterator, Iterable, Iterator, Mapping

import attrs
import trio

from delayserver import protocol as p
from delayserver.message import (
    MAX_BODY_BYTES, CancelOutcome, DelayServerError, Handle, InvalidMessage, MessageState, MessageTooLarge, ResultCode,
    TimeKind, TimeSpec, TransactionState, check_body_size, error_for, parse_address,
)
from delayserver.meta.wire import parse_address_list
from delayserver.protocol import SendItem
from delayserver.trio_util import BackgroundTasks, receive_into, send_whole

log = logging.getLogger("delayserver.client")

DEFAULT_TIMEOUT = 10.0
STARTUP_GRACE_S = 5.0
SEND_BATCH = 256


_ID_PREFIX = os.urandom(5).hex()  # random per process (and renewed in a forked child)
_id_counter = itertools.count()


_id_head = (-1, "")  # (epoch ms, the ids' first 22 hex digits for it): made once per millisecond


def _renew_id_prefix() -> None:
    global _ID_PREFIX, _id_head
    _ID_PREFIX = os.urandom(5).hex()
    _id_head = (-1, "")


os.register_at_fork(after_in_child=_renew_id_prefix)


def new_message_id(now_ms: int | None = None) -> str:
    """A time-ordered id, unique without coordination: 12 hex digits of epoch ms, 10 random hex
    digits drawn once per process, then a per-process counter (6 hex digits, wrapping)."""
    if now_ms is None:
        now_ms = _clock_ms()
    return _id_head_at(now_ms) + "%06x" % (next(_id_counter) & 0xFFFFFF)


def _id_head_at(now_ms: int) -> str:
    """The first 22 hex digits of the ids made at `now_ms`: made once per millisecond."""
    global _id_head
    ms, head = _id_head
    if ms != now_ms:
        head = f"{now_ms:012x}{_ID_PREFIX}"
        _id_head = (now_ms, head)
    return head


def _item(subject: str, body, deliver_at, delay, delay_level, message_id: str | None, headers,
          now_ms: int | None = None) -> SendItem:
    """The SEND item for one message; raises MessageTooLarge for a body no node takes and
    BadScheduleTime for a time that is not a whole number of 64 bits (decided here, before
    anything is sent). `now_ms`: the time a new id is made with (read from the clock when None)."""
    body = body if type(body) is bytes else bytes(body)
    check_body_size(len(body))
    if deliver_at is None and delay_level is None and type(delay) is int:
        # One fixed delay is the usual send: its spec is made once (bounded: no input grows it forever).
        spec = _DELAY_SPECS.get(delay)
        if spec is None:
            spec = TimeSpec.of(None, delay, None)
            if len(_DELAY_SPECS) < 1024:
                _DELAY_SPECS[delay] = spec
    else:
        spec = TimeSpec.of(deliver_at, delay, delay_level)
    # As SendItem(...) makes it, without the named tuple's Python-level constructor.
    return _new_tuple(SendItem, (message_id or new_message_id(now_ms), subject, spec, body,
                                 dict(headers) if headers else {}))


_DELAY_SPECS: dict[int, TimeSpec] = {}
_new_tuple = tuple.__new__


def _batches(items: list[tuple[int, SendItem]], count: int) -> list[list[tuple[int, SendItem]]]:
    """`items` cut into SEND requests of at most `count` messages and one frame's worth of bytes."""
    batches, current, size = [], [], p.SEND_REQUEST_OVERHEAD
    for entry in items:
        item_size = p.send_item_size(entry[1])
        if current and (len(current) == count or size + item_size > p.DEFAULT_MAX_FRAME_BYTES):
            batches.append(current)
            current, size = [], p.SEND_REQUEST_OVERHEAD
        current.append(entry)
        size += item_size
    if current:
        batches.append(current)
    return batches


def _requests_fast(messages: list, batch: int) -> list[tuple[bytes, int, int, int]] | None:
    """`send_many`'s requests made by the compiled kernel in one pass, without a SendItem per
    message: what `_item`, `_batches` and `protocol.encode_send_request` make of them, each as
    `AsyncProducer._requests_checked` gives it (none refused alone: its span is its count), or
    None when a message needs the checked path (a refusal to decide, an unusual type) or the
    kernel is not built."""
    if _native_encode_messages is None:
        return None
    return _native_encode_messages(messages, Message, _id_head_at, _id_counter, _clock_ms, batch,
                                   p.DEFAULT_MAX_FRAME_BYTES, MAX_BODY_BYTES, TimeKind.AT, TimeKind.DELAY)


def _decode_handles(payload: bytes) -> tuple[list, bool]:
    """The results of a SEND response, each stored message's its Handle, each other its SendResult;
    and whether all were stored. Raises RemoteProtocolError as `protocol.decode_send_response` does."""
    if _native_decode_handles is not None:
        decoded = _native_decode_handles(payload if type(payload) is bytes else bytes(payload), p.SendResult,
                                         p._RESULT_CODE_BY_VALUE, Handle, ResultCode.OK, ResultCode.DUPLICATE)
        if decoded is not None:
            return decoded
    results = [_new_tuple(Handle, (r.schedule_time, r.message_id)) if r.code in _STORED else r
               for r in p.decode_send_response(payload)]
    return results, all(type(r) is Handle for r in results)


def _clock_ms() -> int:
    """The wall clock in epoch ms: what new ids are made with."""
    return time.time_ns() // 1_000_000


try:  # the compiled SEND encoder (delayserver/native/send.pyx), when the install built it
    from delayserver.native.send import decode_handles as _native_decode_handles
    from delayserver.native.send import encode_messages as _native_encode_messages
except ImportError:
    _native_decode_handles = _native_encode_messages = None


DEFAULT_MAX_RECONSUME_TIMES = 16
DEFAULT_LEVEL_COUNT = 18


def retry_target(consumer_group: str, reconsume_times: int, max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES,
                 levels: int = DEFAULT_LEVEL_COUNT) -> tuple[str, int | None]:
    """(subject, delay level) for a consumer's failed message: `%RETRY%<group>` at level
    3 + reconsume_times (at most `levels`), or `%DLQ%<group>` and no delay once
    `reconsume_times` reaches `max_reconsume_times`."""
    if reconsume_times < 0:
        raise ValueError("reconsume_times must not be negative")
    if reconsume_times >= max_reconsume_times:
        return f"%DLQ%{consumer_group}", None
    return f"%RETRY%{consumer_group}", min(3 + reconsume_times, levels)


@attrs.frozen
class Status:
    state: MessageState
    dispatch_time: int = 0
    broker_group: str = ""
    # A PREPARED half message: checks so far and when the server asks next (epoch ms).
    checks: int = 0
    next_check_time: int = 0


@attrs.frozen
class TransactionMessage:
    """A half message, as a transaction listener sees it."""

    handle: Handle
    subject: str
    body: bytes
    headers: Mapping[str, str] = attrs.field(factory=dict)
    #: Which check this is (0: the producer's own execute_local_transaction).
    checks: int = 0

    @property
    def message_id(self) -> str:
        return self.handle.message_id


@attrs.frozen
class TransactionSendResult:
    """What send_in_transaction did: the half message's handle and the local transaction's state
    (COMMIT: the message is scheduled; ROLLBACK: dropped; UNKNOWN: the server will check back)."""

    handle: Handle
    state: TransactionState


@attrs.frozen
class Rescheduled:
    """What `reschedule` and `promote` answer: who won, and the new handle when the move did."""

    outcome: CancelOutcome
    handle: Handle | None = None


@attrs.frozen
class Listed:
    """One message of a browse page."""

    handle: Handle
    subject: str
    state: MessageState
    store_time: int
    headers: Mapping[str, str]
    body: bytes | None = None
    dispatch_time: int = 0
    broker_group: str = ""

    @classmethod
    def from_json(cls, m: dict) -> "Listed":
        body = base64.b64decode(m["body"]) if "body" in m else None
        return cls(Handle(m["schedule_time"], m["id"]), m["subject"], MessageState[m["state"].upper()],
                   m["store_time"], m["headers"], body, m.get("dispatch_time", 0), m.get("broker_group", ""))


@attrs.frozen
class BrowsePage:
    messages: list[Listed]
    cursor: str | None  # pass it for the next page; None after the last


@attrs.frozen
class Message:
    """What `send_many` takes: one message to schedule."""

    subject: str
    body: bytes
    deliver_at: int | None = None
    delay: int | None = None
    delay_level: int | None = None
    message_id: str | None = None
    headers: Mapping[str, str] = attrs.field(factory=dict)


#: Send results that mean "the message is stored": OK, or DUPLICATE (stored before, under this id).
_STORED = (ResultCode.OK, ResultCode.DUPLICATE)


class AsyncProducer(BackgroundTasks):
    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT, secret: str | None = None,
                 tls: ssl.SSLContext | bool = False, group: str | None = None, transaction_listener=None):
        """`secret`: the server's shared secret (default: $DELAYSERVER_SECRET, if set).
        `tls`: True for TLS with the system's trust store, or an SSLContext (say, one trusting
        your own CA: ``ssl.create_default_context(cafile=...)``). `group` and
        `transaction_listener`: the producer group and the listener of transactional sends
        (module docstring); with both, every connection registers to answer the group's checks."""
        if (group is None) != (transaction_listener is None):
            raise ValueError("group and transaction_listener go together")
        self.group = group
        self.transaction_listener = transaction_listener
        self.host, self.port = parse_address(address, default_port=p.DEFAULT_PORT)
        self.timeout = timeout
        self.tls = ssl.create_default_context() if tls is True else (tls or None)
        self.secret = secret if secret is not None else os.environ.get("DELAYSERVER_SECRET", "")
        self._stream: trio.abc.Stream | None = None
        self._waiting: dict[int, tuple[trio.Event, list]] = {}
        self._ids = itertools.count(1)
        self._send_lock = trio.Lock()
        self._connect_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None

    async def _closing(self) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def _connect(self) -> trio.SocketStream:
        if self._stream is not None:  # connected: no trip through the scheduler for the lock
            return self._stream
        async with self._connect_lock:
            if self._stream is not None:
                return self._stream
            delay, deadline = 0.05, trio.current_time() + self.timeout
            while True:
                try:
                    stream = await trio.open_tcp_stream(self.host, self.port)
                    if self.tls is not None:
                        stream = trio.SSLStream(stream, self.tls, server_hostname=self.host)
                        try:
                            await stream.do_handshake()
                        except BaseException:
                            await trio.aclose_forcefully(stream)  # (its socket with it)
                            raise
                    break
                except (OSError, trio.BrokenResourceError) as e:
                    if isinstance(e, ssl.SSLError) or isinstance(e.__cause__, ssl.SSLError):
                        # A certificate or protocol mismatch: trying again will not help.
                        raise ConnectionError(f"TLS with {self.host}:{self.port} failed: {e.__cause__ or e}") from e
                    if trio.current_time() + delay > deadline:
                        raise ConnectionError(f"cannot connect to {self.host}:{self.port}: {e}") from e
                    await trio.sleep(delay)
                    delay = min(delay * 2, 1.0)
            self._stream = stream
            self._nursery.start_soon(self._reader, stream)
            try:
                if self.secret:
                    await self._exchange(stream, p.Command.AUTH, self.secret.encode("utf-8"))
                if self.transaction_listener is not None:
                    await self._exchange(stream, p.Command.PRODUCER_REGISTER, p.encode_register_request(self.group))
            except BaseException:
                self._stream = None
                await stream.aclose()
                raise
            return stream

    async def _reader(self, stream: trio.SocketStream) -> None:
        decoder = p.FrameDecoder()
        error: Exception = ConnectionError("connection closed by the server")
        try:
            while True:
                if not await receive_into(stream, decoder.feed, 65536):
                    break
                while (frame := decoder.next_frame()) is not p.NEED_DATA:
                    if not frame.is_response:
                        if frame.command == p.Command.TXN_CHECK:
                            self._nursery.start_soon(self._answer_check, stream, frame)
                        continue
                    waiter = self._waiting.pop(frame.request_id, None)
                    if waiter is None and frame.command == p.Command.ERROR:
                        err = p.decode_error(frame.payload)
                        error = error_for(err.code, err.message)
                        continue
                    if waiter is not None:
                        waiter[1].append(frame)
                        waiter[0].set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, p.ProtocolError) as e:
            error = ConnectionError(f"connection lost: {e}")
        finally:
            if self._stream is stream:
                self._stream = None
            for event, box in self._waiting.values():
                box.append(error)
                event.set()
            self._waiting.clear()
            # The connection is over: its socket is closed now, not when the collector finds it.
            await trio.aclose_forcefully(stream)

    async def _call(self, command: p.Command, payload: bytes) -> bytes:
        try:
            return await self._call_once(command, payload)
        except trio.TooSlowError:
            raise TimeoutError(f"no answer from {self.host}:{self.port} within {self.timeout} s") from None

    async def _call_once(self, command: p.Command, payload: bytes) -> bytes:
        with trio.fail_after(self.timeout):
            return await self._exchange(await self._connect(), command, payload)

    async def _exchange(self, stream, command: p.Command, payload: bytes) -> bytes:
        rid = next(self._ids) & 0xFFFFFFFF
        event, box = trio.Event(), []
        self._waiting[rid] = (event, box)
        try:
            await send_whole(stream, self._send_lock, p.encode(p.Frame(command, rid, payload)))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._waiting.pop(rid, None)
            raise ConnectionError(f"connection lost: {e}") from e
        try:
            await event.wait()
        finally:
            self._waiting.pop(rid, None)
        result = box[0]
        if isinstance(result, Exception):
            raise result
        if result.command == p.Command.ERROR:
            err = p.decode_error(result.payload)
            if err.code == ResultCode.MESSAGE_TOO_LARGE:
                # A frame refused for its size: the server closes this connection after the answer
                # (a refused message inside a SEND comes in its response instead). Let the next
                # request open a new one rather than write to this one as it closes.
                await self._forget(stream)
            raise error_for(err.code, err.message)
        return result.payload

    async def _answer_check(self, stream, frame: p.Frame) -> None:
        """Answer the server's TXN_CHECK with the listener's verdict (UNKNOWN if it fails)."""
        state = TransactionState.UNKNOWN
        try:
            check = p.decode_check_request(frame.payload)
            item = check.item
            message = TransactionMessage(Handle(item.time.value, item.message_id), item.subject, item.body,
                                         item.headers, check.checks)
            if self.transaction_listener is not None:
                state = TransactionState(await _call(self.transaction_listener.check_local_transaction, message))
        except Exception:
            log.exception("the transaction listener failed on a check; answering UNKNOWN")
            state = TransactionState.UNKNOWN
        if state not in (TransactionState.COMMIT, TransactionState.ROLLBACK):
            state = TransactionState.UNKNOWN
        reply = p.encode(p.Frame(p.Command.TXN_CHECK, frame.request_id, p.encode_check_response(state),
                                 is_response=True))
        try:
            await send_whole(stream, self._send_lock, reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the server asks again later

    async def _forget(self, stream) -> None:
        if self._stream is stream:
            self._stream = None
        await stream.aclose()

    async def request(self, command: p.Command, payload: bytes) -> bytes:
        """One raw request (tools and replication); an ERROR answer raises its exception."""
        return await self._call(command, payload)

    async def ping(self, token: bytes = b"") -> bytes:
        return await self._call(p.Command.PING, token)

    async def send(self, subject: str, body: bytes, *, deliver_at: int | None = None, delay: int | None = None,
                   delay_level: int | None = None, message_id: str | None = None,
                   headers: Mapping[str, str] | None = None) -> Handle:
        """Schedule one message; returns its handle once the server says it is stored.

        `deliver_at` is epoch ms; `delay` is ms from now; `delay_level` is 1-based. Raises the
        result code's exception (BadSubject, MessageTooLarge, BadScheduleTime, ...) on refusal.
        A `message_id` the server accepted within its `dedupe_window` returns the first message's
        handle (the server answered DUPLICATE and stored nothing).
        """
        item = _item(subject, body, deliver_at, delay, delay_level, message_id, headers)
        (result,) = p.decode_send_response(await self._call(p.Command.SEND, self._send_request([item])))
        if result.code not in _STORED:
            raise error_for(result.code, result.message)
        return Handle(result.schedule_time, result.message_id)

    async def send_many(self, messages: Iterable[Message], *, batch: int = SEND_BATCH) -> list[Handle | Exception]:
        """Schedule many messages in pipelined batches; per message, in order, its handle or the
        exception that refused it (a DelayServerError, or ConnectionError / TimeoutError when the
        batch got no answer, or an answer with more or fewer results than it carried, and may be
        sent again)."""
        messages = messages if type(messages) is list else list(messages)
        requests = _requests_fast(messages, batch)
        if requests is None:  # something only the checked path decides (or no compiled kernel)
            requests, out = self._requests_checked(messages, batch)
        else:
            out = [None] * len(messages)

        async def one(request: tuple[bytes | Exception, int, int, int]) -> None:
            payload, first, span, sent = request
            try:
                if isinstance(payload, Exception):
                    raise payload
                results, all_stored = _decode_handles(await self._call(p.Command.SEND, payload))
                if len(results) != sent:
                    raise ConnectionError(f"the server answered {len(results)} results to a batch of {sent}")
            except (ConnectionError, TimeoutError, DelayServerError) as e:
                # Not acknowledged: the caller may send these again (at least once).
                for i in range(first, first + span):
                    if out[i] is None:
                        out[i] = e
                return
            if all_stored and sent == span:  # the usual answer: all stored, none refused before sending
                out[first : first + span] = results
                return
            i = first
            for r in results:
                while out[i] is not None:  # refused before sending (the checked path's gaps)
                    i += 1
                out[i] = r if type(r) is Handle else error_for(r.code, r.message)
                i += 1

        if len(requests) == 1:  # one request: no task of its own
            await one(requests[0])
        else:
            async with trio.open_nursery() as nursery:
                for request in requests:
                    nursery.start_soon(one, request)
        return out

    def _requests_checked(self, messages: list[Message], batch: int) -> tuple[list, list]:
        """The SEND requests of `send_many`, each ``(payload or the exception refusing the whole
        request, index of its first message, messages from its first to its last, messages it
        carries)``, made item by item with every check, and the result list with each message
        refused alone already in its place (the others None)."""
        out: list = []
        items = []
        for i, m in enumerate(messages):
            if not i & 0xFFFF:
                # The new ids' time: the clock read once per 65,536 messages, not per message, and
                # never so seldom that the ids' 24-bit counter comes round within one time.
                now_ms = _clock_ms()
            try:
                items.append((i, _item(m.subject, m.body, m.deliver_at, m.delay, m.delay_level, m.message_id,
                                       m.headers, now_ms)))
                out.append(None)
            except DelayServerError as e:  # refused before sending, alone
                out.append(e)
        requests = []
        for chunk in _batches(items, batch):
            try:
                payload = self._send_request([item for _, item in chunk])
            except DelayServerError as e:
                payload = e
            # The messages refused alone between the chunk's first and last keep their errors.
            requests.append((payload, chunk[0][0], chunk[-1][0] + 1 - chunk[0][0], len(chunk)))
        return requests, out

    @staticmethod
    def _send_request(items: list[SendItem]) -> bytes:
        try:
            request = p.encode_send_request(items)
        except p.LocalProtocolError as e:  # a field no frame can carry (an id over 64 KiB, ...)
            raise InvalidMessage(str(e)) from None
        if len(request) > p.DEFAULT_MAX_FRAME_BYTES:
            raise MessageTooLarge(f"the message takes {len(request)} bytes, over the frame limit of "
                                  f"{p.DEFAULT_MAX_FRAME_BYTES}")
        return request

    async def send_back(self, consumer_group: str, message_id: str, body: bytes, *, reconsume_times: int,
                        headers: Mapping[str, str] | None = None, subject: str = "",
                        max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES,
                        levels: int = DEFAULT_LEVEL_COUNT) -> Handle:
        """Consumer retry, as RocketMQ does it: a message the consumer failed to process comes back
        on `%RETRY%<group>` at delay level 3 + reconsume_times (capped at the last of `levels`),
        and after `max_reconsume_times` goes at once to the dead-letter subject `%DLQ%<group>`.
        Headers `reconsume-times` and `origin-subject` travel with it; the id is kept."""
        target, level = retry_target(consumer_group, reconsume_times, max_reconsume_times, levels)
        headers = {**(headers or {}), "reconsume-times": str(reconsume_times + 1)}
        if subject:
            headers.setdefault("origin-subject", subject)
        if level is None:
            return await self.send(target, body, delay=0, message_id=message_id, headers=headers)
        return await self.send(target, body, delay_level=level, message_id=message_id, headers=headers)

    async def cancel(self, handle: Handle | str) -> CancelOutcome:
        """Cancel a pending message; says whether the cancel won or the message was delivered."""
        handle = Handle.parse(handle) if isinstance(handle, str) else handle
        r = p.decode_cancel_response(await self._call(p.Command.CANCEL, p.encode_handle(handle)))
        if r.code != ResultCode.OK:
            raise error_for(r.code, r.message)
        return r.outcome

    async def status(self, handle: Handle | str) -> Status:
        handle = Handle.parse(handle) if isinstance(handle, str) else handle
        r = p.decode_status_response(await self._call(p.Command.STATUS, p.encode_handle(handle)))
        if r.code != ResultCode.OK:
            raise error_for(r.code, r.message)
        return Status(r.state, r.dispatch_time, r.broker_group, r.checks, r.next_check_time)

    # --- transactions ---------------------------------------------------------------------------

    async def prepare(self, subject: str, body: bytes, *, group: str | None = None, check_immunity_ms: int = 0,
                      deliver_at: int | None = None, delay: int | None = None, delay_level: int | None = None,
                      message_id: str | None = None, headers: Mapping[str, str] | None = None) -> Handle:
        """Store a half message of producer `group` (default: this producer's): durable, never
        delivered until committed. `check_immunity_ms` delays the server's first check."""
        group = group or self.group
        if not group:
            raise ValueError("a half message needs a producer group")
        item = _item(subject, body, deliver_at, delay, delay_level, message_id, headers)
        try:
            request = p.encode_prepare_request(group, check_immunity_ms, item)
        except p.LocalProtocolError as e:
            raise InvalidMessage(str(e)) from None
        (result,) = p.decode_send_response(await self._call(p.Command.PREPARE, request))
        if result.code != ResultCode.OK:
            raise error_for(result.code, result.message)
        return Handle(result.schedule_time, result.message_id)

    async def commit(self, handle: Handle | str) -> TransactionState:
        """Schedule a half message; a repeated commit answers COMMIT again. Raises
        DelayServerError TXN_NOT_FOUND (no such half message) or TXN_RESOLVED (rolled back or parked)."""
        return await self._end(p.Command.COMMIT, handle)

    async def rollback(self, handle: Handle | str) -> TransactionState:
        """Drop a half message; raises as `commit` does."""
        return await self._end(p.Command.ROLLBACK, handle)

    async def _end(self, command: p.Command, handle: Handle | str) -> TransactionState:
        handle = Handle.parse(handle) if isinstance(handle, str) else handle
        r = p.decode_transaction_response(await self._call(command, p.encode_handle(handle)))
        if r.code != ResultCode.OK:
            raise error_for(r.code, r.message)
        return r.state

    async def send_in_transaction(self, subject: str, body: bytes, arg=None, *, check_immunity_ms: int = 0,
                                  **kw) -> TransactionSendResult:
        """RocketMQ's sendMessageInTransaction: prepare a half message, run the listener's
        `execute_local_transaction(message, arg)`, then commit or roll back as it says. UNKNOWN
        (or an exception from the listener, or a lost commit) leaves the half message to the
        server's check-back. `kw`: deliver_at, delay, delay_level, message_id, headers."""
        if self.transaction_listener is None:
            raise ValueError("send_in_transaction needs a producer created with group and transaction_listener")
        handle = await self.prepare(subject, body, check_immunity_ms=check_immunity_ms, **kw)
        message = TransactionMessage(handle, subject, bytes(body), dict(kw.get("headers") or {}))
        try:
            state = TransactionState(await _call(self.transaction_listener.execute_local_transaction, message, arg,
                                                 in_thread=False))
        except Exception:
            log.exception("execute_local_transaction failed; the server will check back")
            state = TransactionState.UNKNOWN
        await self._finish_transaction(handle, state)
        return TransactionSendResult(handle, state)

    async def _finish_transaction(self, handle: Handle, state: TransactionState) -> None:
        try:
            if state == TransactionState.COMMIT:
                await self.commit(handle)
            elif state == TransactionState.ROLLBACK:
                await self.rollback(handle)
        except (ConnectionError, TimeoutError, DelayServerError) as e:
            # As RocketMQ's end of transaction: the check-back resolves what did not get through.
            log.warning("%s of %s not confirmed (%s); the server will check back", state.name, handle, e)


    async def reschedule(self, handle: Handle | str, *, deliver_at: int | None = None,
                         delay: int | None = None) -> Rescheduled:
        """Move a pending message to `deliver_at` (epoch ms) or `delay` ms from now. The answer
        says who won: RESCHEDULED with the new handle (the old one reads as cancelled from then
        on), or ALREADY_DELIVERED, ALREADY_CANCELLED or UNKNOWN with no handle. Raises
        BadScheduleTime for a time past the server's max_delay, and the code's exception on refusal."""
        handle = Handle.parse(handle) if isinstance(handle, str) else handle
        if deliver_at is None and delay is None:
            raise ValueError("give deliver_at or delay")
        request = p.encode_reschedule_request(handle, TimeSpec.of(deliver_at, delay))
        r = p.decode_reschedule_response(await self._call(p.Command.RESCHEDULE, request))
        if r.code != ResultCode.OK:
            raise error_for(r.code, r.message)
        moved = r.outcome == CancelOutcome.RESCHEDULED
        return Rescheduled(r.outcome, Handle(r.schedule_time, handle.message_id) if moved else None)

    async def promote(self, handle: Handle | str) -> Rescheduled:
        """Deliver a pending message now: a reschedule to the server's now."""
        return await self.reschedule(handle, delay=0)

    async def browse(self, *, subject: str | None = None, states: Iterable[str] = ("pending",),
                     since: int | None = None, until: int | None = None, newest_first: bool = False,
                     limit: int = 100, cursor: str | None = None, bodies: bool = False) -> BrowsePage:
        """One page of messages: by `subject` (exact, or a glob with * ? [...]), `states`
        (pending, delivered, cancelled), delivery time in [`since`, `until`) epoch ms, oldest or
        newest first, at most `limit` (1-1000). Pass the page's `cursor` for the next page; it is
        None after the last. Bodies only with `bodies=True`. Raises DelayServerError
        (BAD_REQUEST) for a query the server cannot answer."""
        query = {"states": list(states), "order": "newest" if newest_first else "oldest", "limit": limit,
                 "bodies": bodies}
        for name, value in (("subject", subject), ("since", since), ("until", until), ("cursor", cursor)):
            if value is not None:
                query[name] = value
        page = p.decode_json(await self._call(p.Command.BROWSE, p.encode_json(query)))
        return BrowsePage([Listed.from_json(m) for m in page["messages"]], page["cursor"])

    # --- recurring schedules ---------------------------------------------------------------

    async def put_schedule(self, name: str, subject: str, rule: str, body: bytes = b"", *,
                           headers: Mapping[str, str] | None = None, timezone: str = "UTC",
                           start: int | None = None, end: int | None = None, count: int | None = None,
                           catch_up: str = "one") -> dict:
        """Create or replace the schedule `name`: a message to `subject` at every occurrence of
        `rule` (a cron expression of 5 fields, or 6 with seconds first, read in `timezone`; or
        ``@every 10m``), from `start` to before `end` (epoch ms), at most `count` times;
        `catch_up` (skip, one, all) says what to send of the occurrences missed while the node was
        down. Returns the schedule as the node now has it (its `next` occurrence among others).
        Raises DelayServerError (BAD_REQUEST, ...) naming what is wrong."""
        spec = {"name": name, "subject": subject, "rule": rule, "body": base64.b64encode(bytes(body)).decode("ascii"),
                "headers": dict(headers or {}), "timezone": timezone, "start": start, "end": end, "count": count,
                "catch_up": catch_up}
        return (await self._schedule_request({"op": "put", "schedule": spec}))[0]

    async def pause_schedule(self, name: str) -> dict:
        return (await self._schedule_request({"op": "pause", "name": name}))[0]

    async def resume_schedule(self, name: str) -> dict:
        """Resume a paused schedule: from its next occurrence after now (none missed meanwhile)."""
        return (await self._schedule_request({"op": "resume", "name": name}))[0]

    async def delete_schedule(self, name: str) -> None:
        """Delete a schedule (its occurrence already sent and not yet due is cancelled)."""
        await self._schedule_request({"op": "delete", "name": name})

    async def schedules(self) -> list[dict]:
        """Every schedule of the node, by name."""
        return await self._schedule_request({"op": "list"})

    async def _schedule_request(self, request: dict) -> list[dict]:
        answer = p.decode_json(await self._call(p.Command.SCHEDULE, p.encode_json(request)))
        return [{**s, "body": base64.b64decode(s["body"])} for s in answer["schedules"]]

    async def browse_all(self, **query) -> AsyncIterator[Listed]:
        """Every message the query matches, page after page (`browse`'s arguments)."""
        cursor = None
        while True:
            page = await self.browse(**query, cursor=cursor)
            for m in page.messages:
                yield m
            if page.cursor is None:
                return
            cursor = page.cursor


async def _call(fn, *args, in_thread: bool = True):
    """A listener method: awaited if async, else called (in a worker thread when `in_thread`)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    if in_thread:
        return await trio.to_thread.run_sync(fn, *args)
    return fn(*args)


class Producer:
    """The blocking facade: a trio loop in a background thread runs an AsyncProducer.

    Safe to share between threads; each call blocks until its answer (or `timeout`).
    """

    def __init__(self, address: str | None = None, *, meta: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 **options):
        """Connect to one delay server (`address`), or to the delay groups the meta servers list
        (`meta`: ``HOST:PORT[,HOST:PORT...]``, asked in turn; sends are spread over the groups and
        a dead group is skipped; `meta_tls` is an SSLContext for TLS to the meta servers).
        `options` (`secret`, `tls`) go to each connection, as for AsyncProducer."""
        if (address is None) == (meta is None):
            raise ValueError("give either address or meta")
        if meta is None:
            parse_address(address, default_port=p.DEFAULT_PORT)  # AddressError now, here
        else:
            parse_address_list(meta)  # ValueError now, here
            if options.get("transaction_listener") is not None:
                raise ValueError("transactional producers connect to one delay server (address), not through meta")
        self._address, self._meta, self._timeout, self._options = address, meta, timeout, options
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run_loop, daemon=True, name="delayserver-producer")
        self._thread.start()
        # Starting needs no network (connections are made by the first request), so this is quick;
        # the bound only keeps a broken start from hanging the caller.
        if not self._ready.wait(timeout + STARTUP_GRACE_S):
            raise TimeoutError(f"the producer did not start within {timeout + STARTUP_GRACE_S} s")
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    def _run_loop(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # a start that failed: __init__ raises it in the caller's thread
            self._failure = e
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        if self._meta is not None:
            from delayserver.group_producer import AsyncGroupProducer
            session = AsyncGroupProducer(self._meta, timeout=self._timeout, **self._options)
        else:
            session = AsyncProducer(self._address, timeout=self._timeout, **self._options)
        async with session as producer:
            self._producer = producer
            self._ready.set()
            await self._stop.wait()

    def _run(self, fn, *args, **kw):
        return trio.from_thread.run(lambda: fn(*args, **kw), trio_token=self._token)

    def send(self, subject: str, body: bytes, **kw) -> Handle:
        return self._run(self._producer.send, subject, body, **kw)

    def send_many(self, messages: Iterable[Message], **kw) -> list:
        return self._run(self._producer.send_many, list(messages), **kw)

    def cancel(self, handle: Handle | str) -> CancelOutcome:
        return self._run(self._producer.cancel, handle)

    def send_back(self, consumer_group: str, message_id: str, body: bytes, **kw) -> Handle:
        return self._run(self._producer.send_back, consumer_group, message_id, body, **kw)

    def status(self, handle: Handle | str) -> Status:
        return self._run(self._producer.status, handle)

    def reschedule(self, handle: Handle | str, **kw) -> Rescheduled:
        return self._run(self._producer.reschedule, handle, **kw)

    def promote(self, handle: Handle | str) -> Rescheduled:
        return self._run(self._producer.promote, handle)

    def put_schedule(self, name: str, subject: str, rule: str, body: bytes = b"", **kw) -> dict:
        return self._run(self._producer.put_schedule, name, subject, rule, body, **kw)

    def pause_schedule(self, name: str) -> dict:
        return self._run(self._producer.pause_schedule, name)

    def resume_schedule(self, name: str) -> dict:
        return self._run(self._producer.resume_schedule, name)

    def delete_schedule(self, name: str) -> None:
        return self._run(self._producer.delete_schedule, name)

    def schedules(self) -> list[dict]:
        return self._run(self._producer.schedules)

    def browse(self, **query) -> BrowsePage:
        return self._run(self._producer.browse, **query)

    def browse_all(self, **query) -> Iterator[Listed]:
        """Every message the query matches, fetched a page at a time."""
        cursor = None
        while True:
            page = self.browse(**query, cursor=cursor)
            yield from page.messages
            if page.cursor is None:
                return
            cursor = page.cursor
    # --- transactions ---------------------------------------------------------------------------

    def prepare(self, subject: str, body: bytes, **kw) -> Handle:
        return self._run(self._producer.prepare, subject, body, **kw)

    def commit(self, handle: Handle | str) -> TransactionState:
        return self._run(self._producer.commit, handle)

    def rollback(self, handle: Handle | str) -> TransactionState:
        return self._run(self._producer.rollback, handle)

    def send_in_transaction(self, subject: str, body: bytes, arg=None, *, check_immunity_ms: int = 0,
                            **kw) -> TransactionSendResult:
        """As AsyncProducer.send_in_transaction; `execute_local_transaction` runs in the
        caller's thread (where its database transaction is), checks on the background thread."""
        producer = self._producer
        listener = producer.transaction_listener
        if listener is None:
            raise ValueError("send_in_transaction needs a producer created with group and transaction_listener")
        handle = self.prepare(subject, body, check_immunity_ms=check_immunity_ms, **kw)
        message = TransactionMessage(handle, subject, bytes(body), dict(kw.get("headers") or {}))
        try:
            state = TransactionState(listener.execute_local_transaction(message, arg))
        except Exception:
            log.exception("execute_local_transaction failed; the server will check back")
            state = TransactionState.UNKNOWN
        self._run(producer._finish_transaction, handle, state)
        return TransactionSendResult(handle, state)

    def ping(self) -> bytes:
        return self._run(self._producer.ping)

    def close(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
