"""The Redis Streams transport: one XADD per message, a batch's commands sent in one write.

Each message becomes one stream entry in the stream `stream_template.format(subject=subject)`
(default "{subject}"), with these fields, as XRANGE shows them:

    id              the message id (UTF-8)
    subject         the subject
    body            the body, byte for byte
    schedule_time   epoch ms, decimal
    dispatch_time   epoch ms, decimal
    attempt         decimal, 1 on the first try
    h:<key>         one field per header (the prefix keeps headers apart from the fields above)

Options: `stream_template`; `maxlen` (XADD MAXLEN ~ maxlen, approximate trimming; absent means
no trimming); `timeout_ms` (default 5000) for connecting and for every socket read and write, so a
dead or stuck server costs at most that long and never hangs the sender.

Outcomes: an XADD answered with a WRONGTYPE error is REJECTED (the key holds another type, so no
retry can succeed until an operator removes it); any other error of one XADD is RETRY for that
message. A connection error or timeout, or a reply redis-py does not expect (from a server that
is not Redis), is RETRY for the whole batch (entries written before it may then arrive twice:
delivery is at least once). redis-py is blocking: each batch runs in a trio worker thread, using
the transport's own connection pool, and redis-py's own retries are off (the sender retries with
back-off). redis-py makes the connections (address, TLS, AUTH, SELECT, its handshake); the batch's
XADD commands are encoded here, in one pass (a compiled kernel, delayserver/native/resp.pyx, when
built), and written at once on a connection of the pool, and the replies are read off its socket,
as many as there were commands, in order: scanned in one compiled pass when every one is an
entry's id (most batches), else parsed by one hiredis reader. redis-py's pipeline would build a
command object and an argument list per message, and its connection parses one reply per call.
"""
from __future__ import annotations

import logging
import socket
import urllib.parse
from typing import Any, Mapping, Sequence

import attrs
import hiredis
import redis
import trio
from redis.backoff import NoBackoff
from redis.retry import Retry

from delayserver.sender.transport import (
    ACKED, TRANSPORT_THREADS, DeliveryResult, OutboundMessage, Outcome, Transport, check_option_names, int_option,
)
from delayserver.storage.threads import ThreadPool

try:  # the compiled XADD encoder and reply scan (delayserver/native/resp.pyx), when the install built it
    from delayserver.native.resp import scan_bulk_replies as _native_scan_bulk_replies
    from delayserver.native.resp import xadd_commands as _native_xadd_commands
except ImportError:
    _native_scan_bulk_replies = _native_xadd_commands = None

log = logging.getLogger("delayserver.sender.redis")

DEFAULT_TIMEOUT_MS = 5000
DEFAULT_STREAM_TEMPLATE = "{subject}"
HEADER_PREFIX = "h:"
#: Error codes of one XADD that no retry can cure.
_REJECTING_ERRORS = ("WRONGTYPE",)
#: The most read off a connection at once while its replies come in.
_READ_BYTES = 1 << 16


def _bulk(data: bytes) -> bytes:
    """`data` as a RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(data), data)


def xadd_commands(messages: Sequence[OutboundMessage], stream_template: str, maxlen: int | None) -> bytes:
    """The RESP encoding of one `XADD <stream> [MAXLEN ~ <maxlen>] * <fields>` per message, in order,
    with the fields of the module docstring: the command redis-py's `xadd(stream, fields,
    maxlen=maxlen, approximate=True)` sends. The compiled kernel (delayserver/native/resp.pyx) when
    built and it takes the batch, else `_xadd_commands_py`."""
    commands = _xadd_commands_native(messages, stream_template, maxlen)
    return commands if commands is not None else _xadd_commands_py(messages, stream_template, maxlen)


#: The fields after the subject, as RESP bulk strings (the compiled kernel writes them as they are).
_FIELD_NAMES = (b"$4\r\nbody\r\n", b"$13\r\nschedule_time\r\n", b"$13\r\ndispatch_time\r\n", b"$7\r\nattempt\r\n")


def _xadd_commands_native(messages: Sequence[OutboundMessage], stream_template: str, maxlen: int | None) -> bytes | None:
    """`xadd_commands` by the compiled kernel, or None (not built, or a batch it leaves to the reference)."""
    if _native_xadd_commands is None:
        return None
    trim = _trim(maxlen)
    return _native_xadd_commands(messages if type(messages) is list else list(messages),
                                 lambda subject: _subject_parts(subject, stream_template, trim),
                                 *_FIELD_NAMES, HEADER_PREFIX, _field_count(maxlen))


def _trim(maxlen: int | None) -> bytes:
    return b"" if maxlen is None else b"$6\r\nMAXLEN\r\n$1\r\n~\r\n" + _bulk(b"%d" % maxlen)


def _field_count(maxlen: int | None) -> int:
    """The elements of an XADD command of a message without headers."""
    return 15 if maxlen is None else 18


def _subject_parts(subject: str, stream_template: str, trim: bytes) -> tuple[bytes, bytes]:
    """What an XADD of a message of `subject` has before its id (after the array's length), and
    its subject field and value."""
    return (b"$4\r\nXADD\r\n" + _bulk(stream_template.format(subject=subject).encode()) + trim
            + b"$1\r\n*\r\n$2\r\nid\r\n", b"$7\r\nsubject\r\n" + _bulk(subject.encode()))


def _xadd_commands_py(messages: Sequence[OutboundMessage], stream_template: str, maxlen: int | None) -> bytes:
    """`xadd_commands` in Python: the compiled kernel's reference."""
    trim = _trim(maxlen)
    count = _field_count(maxlen)
    # Per subject: the stream's name and the subject field, encoded once per batch.
    subjects: dict[str, tuple[bytes, bytes]] = {}
    parts = []
    for m in messages:
        subject = m.subject
        named = subjects.get(subject)
        if named is None:
            named = subjects[subject] = _subject_parts(subject, stream_template, trim)
        message_id = m.message_id.encode()
        body = m.body
        schedule_time = b"%d" % m.schedule_time
        dispatch_time = b"%d" % m.dispatch_time
        attempt = b"%d" % m.attempt
        headers = m.headers
        extra = b"".join(
            _bulk((HEADER_PREFIX + key).encode()) + _bulk(value.encode()) for key, value in headers.items()
        ) if headers else b""
        parts.append(
            b"*%d\r\n%b$%d\r\n%b\r\n%b$4\r\nbody\r\n$%d\r\n%b\r\n$13\r\nschedule_time\r\n$%d\r\n%b\r\n"
            b"$13\r\ndispatch_time\r\n$%d\r\n%b\r\n$7\r\nattempt\r\n$%d\r\n%b\r\n%b" % (
                count + 2 * len(headers), named[0], len(message_id), message_id, named[1], len(body), body,
                len(schedule_time), schedule_time, len(dispatch_time), dispatch_time, len(attempt), attempt, extra,
            )
        )
    return b"".join(parts)


def _check_template(template: Any) -> str:
    if not isinstance(template, str) or not template:
        raise ValueError(f"redis transport: option 'stream_template' must be a non-empty string, got {template!r}")
    try:
        template.format(subject="subject")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"redis transport: option 'stream_template' {template!r} may use only {{subject}}: {e!r}"
        ) from None
    return template


def _connection_pool(address: str, timeout_s: float) -> redis.ConnectionPool:
    """A pool for "host:port" or a redis://, rediss:// or unix:// URL; ValueError naming the address."""
    settings = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    if "://" in address:
        try:
            return redis.ConnectionPool.from_url(address, **settings)
        except ValueError as e:
            raise ValueError(f"redis transport: bad address {_redacted(address)!r}: {e}") from None
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"redis transport: address must be host:port or a redis:// URL, got {address!r}")
    return redis.ConnectionPool(host=host, port=int(port), **settings)


def _redacted(address: str) -> str:
    """The address without its user and password, fit for logs."""
    parts = urllib.parse.urlsplit(address)
    if "@" not in parts.netloc:
        return address
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _plain_socket(connection) -> socket.socket | None:
    """The socket of a redis-py connection, to read its replies off in bulk; None for a connection
    that keeps none where redis-py's own do (its replies are then read through it)."""
    sock = getattr(connection, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _read_replies(sock: socket.socket, count: int, name: str) -> tuple[list[Any] | None, bool]:
    """`count` replies read off `sock` (a redis-py connection's, whose commands were just written),
    and whether bytes are left over. None for the replies when every one is a bulk string (a stream
    entry's id: each XADD succeeded), as the compiled scan finds (most batches); else each reply,
    parsed by one hiredis reader as the bytes come (redis-py reads and parses one reply per call),
    an error reply a redis.ResponseError in its place. A reply that is an array answers no XADD: a
    RESP3 push (a server's notice), skipped. The socket's timeout is the connection's; a timeout, a
    reset or an end of the stream raises redis.TimeoutError or redis.ConnectionError, as redis-py's
    own reads would."""
    received = bytearray()
    at = scanned = 0
    clean = _native_scan_bulk_replies is not None
    while clean and scanned < count:
        received += _recv(sock, name)
        at, got, clean = _native_scan_bulk_replies(received, at, count - scanned)
        scanned += got
    if clean:
        return None, at < len(received)
    # A reply of another shape: hiredis parses all of them, from the first.
    reader = hiredis.Reader(protocolError=redis.InvalidResponse, replyError=redis.ResponseError)
    if received:
        reader.feed(received)
    replies: list[Any] = []
    while len(replies) < count:
        reply = reader.gets(False)
        if reply is False:
            reader.feed(_recv(sock, name))
        elif not isinstance(reply, list):  # (hiredis gives a push as a PushNotification, a list)
            replies.append(reply)
    return replies, reader.has_data()


def _recv(sock: socket.socket, name: str) -> bytes:
    """The next bytes off `sock`: raises as redis-py's reads do, also at the end of the stream."""
    try:
        data = sock.recv(_READ_BYTES)
    except TimeoutError as e:
        raise redis.TimeoutError(f"{name}: Timeout reading from the server") from e
    except OSError as e:
        raise redis.ConnectionError(f"{name}: error reading from the server: {e}") from e
    if not data:
        raise redis.ConnectionError(f"{name}: connection closed by the server")
    return data


def _outcome_of(reply: Any) -> DeliveryResult:
    if not isinstance(reply, Exception):
        return ACKED
    detail = f"XADD failed: {reply}"
    if str(reply).startswith(_REJECTING_ERRORS):
        return DeliveryResult(Outcome.REJECTED, detail)
    return DeliveryResult(Outcome.RETRY, detail)


@attrs.define(eq=False)
class RedisTransport(Transport):
    """Delivers to Redis Streams through `pool`."""

    address: str
    pool: redis.ConnectionPool
    stream_template: str = DEFAULT_STREAM_TEMPLATE
    maxlen: int | None = None
    # The threads its round trips may hold (see TRANSPORT_THREADS); batches beyond wait for one.
    _threads: ThreadPool = attrs.field(init=False, factory=lambda: ThreadPool(TRANSPORT_THREADS, "delayserver redis"))

    @classmethod
    def from_config(cls, address: str, options: Mapping[str, Any]) -> RedisTransport:
        """Raises ValueError naming the address or the option that is wrong."""
        check_option_names("redis", options, {"stream_template", "maxlen", "timeout_ms"})
        if not isinstance(address, str) or not address:
            raise ValueError("redis transport: address must be host:port or a redis:// URL")
        timeout_ms = int_option("redis", options, "timeout_ms", DEFAULT_TIMEOUT_MS)
        return cls(
            address=address,
            pool=_connection_pool(address, timeout_ms / 1000),
            stream_template=_check_template(options.get("stream_template", DEFAULT_STREAM_TEMPLATE)),
            maxlen=int_option("redis", options, "maxlen", None),
        )

    @property
    def name(self) -> str:
        return f"redis {_redacted(self.address)} stream {self.stream_template}"

    async def send_batch(self, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
        if not messages:
            return []
        try:
            replies = await self._threads.run(self._xadd_all, messages)
        except redis.RedisError as e:
            log.warning("%s: batch of %d failed, will retry: %r", self.name, len(messages), e)
            return [DeliveryResult(Outcome.RETRY, f"{self.name}: {type(e).__name__}: {e}")] * len(messages)
        except Exception as e:  # redis-py met a reply it does not expect (a server that is not Redis)
            log.exception("%s: batch of %d failed, will retry", self.name, len(messages))
            return [DeliveryResult(Outcome.RETRY, f"{self.name}: unexpected {type(e).__name__}: {e}")] * len(messages)
        if replies is None:  # every XADD answered with an entry's id
            return [ACKED] * len(messages)
        return [_outcome_of(reply) for reply in replies]

    def _xadd_all(self, messages: Sequence[OutboundMessage]) -> list[Any] | None:
        """Run in a worker thread: one write of all the batch's commands, then a reply or an
        exception per message, or None when every XADD succeeded (`_read_replies`). A connection
        that fails midway is closed, not handed back for reuse: its unread replies would be taken
        for the next batch's."""
        commands = xadd_commands(messages, self.stream_template, self.maxlen)
        connection = self.pool.get_connection()
        try:
            connection.send_packed_command([commands])
            sock = _plain_socket(connection)
            if sock is None:  # a connection of another shape: its own reads, one by one
                replies: list[Any] = []
                for _ in range(len(messages)):
                    try:
                        replies.append(connection.read_response(disable_decoding=True))
                    except redis.ResponseError as e:
                        replies.append(e)
                return replies
            replies, spare = _read_replies(sock, len(messages), self.name)
            if spare:  # bytes past the batch's replies (nothing a Redis sends): not for the next batch
                connection.disconnect()
            return replies
        except BaseException:
            connection.disconnect()
            raise
        finally:
            self.pool.release(connection)

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.pool.disconnect)
