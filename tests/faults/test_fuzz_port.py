"""Live-port fuzzing: abuse from many connections while well-behaved producers are being served.

The real server runs with small limits (max_connections, frame_timeout_ms, idle_timeout_ms) and the
embedded spool. Four producers send checkable messages the whole time. Meanwhile:

1. hypothesis generates rounds of abuse, each round several connections at once: valid frames with
   mutations (flipped bytes, truncation, a wrong or huge declared length, a bad crc, garbage after),
   random bytes, several frames pipelined. Every connection sends its bytes, half-closes, and reads
   until the server closes: whatever comes back must be whole, valid response frames, and the server
   must still be running after each round;
2. idle and slow-trickle connections are opened up to the connection limit and past it: the ones past
   it get BUSY, the trickling ones are dropped after frame_timeout_ms, the idle ones after
   idle_timeout_ms, and then the server takes new connections again.

Throughout, the producers' sends must all succeed and keep succeeding; at the end their messages
must be delivered (pass rule of harness.check_deliveries), the server must stop cleanly on SIGTERM,
and `delayctl verify` must pass.

Knobs (environment): DELAYSERVER_FUZZ_EXAMPLES (300: rounds of abuse), DELAYSERVER_FAULT_SEED.
"""
from __future__ import annotations

import collections
import concurrent.futures
import select
import socket
import struct
import threading
import time

import crc32c
import pytest
import trio
from hypothesis import HealthCheck, given, seed as hypothesis_seed, settings, strategies as st

from delayserver import protocol as p
from delayserver.message import Handle, ResultCode, TimeKind, TimeSpec
from tests.faults.harness import (
    Ledger, assert_verify_passes, check_deliveries, drive, env_int, seeded_rng, spool_deliveries,
    wait_until_delivered, write_config,
)
from tests.procs import ServerProcess

pytestmark = pytest.mark.slow

EXAMPLES = env_int("DELAYSERVER_FUZZ_EXAMPLES", 300)
MAX_CONNECTIONS = 48
PRODUCERS = 4
FRAME_TIMEOUT_MS = 1000
IDLE_TIMEOUT_MS = 2000
MAX_FRAME_BYTES = 1 << 20
READ_TIMEOUT_S = 10.0

# --- what to send ---------------------------------------------------------------------------------

texts = st.text(max_size=24)
message_ids = st.one_of(st.just(""), texts, st.text(min_size=120, max_size=140))
valid_subjects = st.sampled_from(["fuzz.a", "fuzz.b", "fuzz:c|d%e-f"])
subjects = st.one_of(valid_subjects, valid_subjects, valid_subjects, st.just(""), texts,
                     st.text(min_size=250, max_size=260))
times = st.one_of(
    st.builds(TimeSpec.delay, st.integers(0, 5000)),
    st.builds(TimeSpec.level, st.integers(0, 20)),
    st.builds(TimeSpec, st.sampled_from(list(TimeKind)), st.integers(-(2**63), 2**63 - 1)),
)
send_items = st.builds(p.SendItem, message_ids, subjects, times, st.binary(max_size=512),
                       st.dictionaries(texts, texts, max_size=3))


@st.composite
def payloads(draw) -> tuple[int, bytes]:
    """(command, payload): well-formed payloads of each request command, or random bytes."""
    kind = draw(st.sampled_from(["send", "handle", "ping", "random"]))
    if kind == "send":
        try:
            return p.Command.SEND, p.encode_send_request(draw(st.lists(send_items, max_size=4)))
        except p.LocalProtocolError:
            return p.Command.SEND, b""
    if kind == "handle":
        command = draw(st.sampled_from([p.Command.CANCEL, p.Command.STATUS]))
        try:
            return command, p.encode_handle(Handle(draw(st.integers(-(2**63), 2**63 - 1)), draw(message_ids)))
        except p.LocalProtocolError:
            return command, b""
    command = draw(st.one_of(st.sampled_from(list(p.Command)), st.integers(0, 255)))
    return command, draw(st.binary(max_size=256))


#: "none" thrice: a third of the frames reach the server unharmed.
MUTATIONS = ["none", "none", "none", "flip", "truncate", "crc", "length", "huge", "header", "tail"]


@st.composite
def frames(draw) -> bytes:
    """One frame: valid, then perhaps mutated."""
    command, payload = draw(payloads())
    flags = draw(st.sampled_from([0, 0, 0, 1, 2, 0xFF]))
    request_id = draw(st.integers(0, 2**32 - 1))
    header = p.HEADER.pack(p.MAGIC, p.VERSION, command, flags, request_id, len(payload))
    data = bytearray(header + payload + p.CRC.pack(crc32c.crc32c(payload, value=crc32c.crc32c(header))))
    mutation = draw(st.sampled_from(MUTATIONS))
    if mutation == "flip":
        for index, xor in draw(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(1, 255)),
                                        min_size=1, max_size=4)):
            data[index] ^= xor
    elif mutation == "truncate":
        del data[draw(st.integers(0, len(data) - 1)):]
    elif mutation == "crc":
        data[-1] ^= 0x01
    elif mutation == "length":
        # A declared length that does not match what follows, crc recomputed or not.
        struct.pack_into(">I", data, 11, draw(st.integers(0, len(payload) + 64)))
        if draw(st.booleans()):
            body = bytes(data[:-4])
            data[-4:] = p.CRC.pack(crc32c.crc32c(body))
    elif mutation == "huge":
        struct.pack_into(">I", data, 11, draw(st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1)))
    elif mutation == "header":
        field = draw(st.sampled_from([(0, ">I"), (4, ">B"), (5, ">B"), (6, ">B")]))
        struct.pack_into(field[1], data, field[0], draw(st.integers(0, 255)))
    elif mutation == "tail":
        data += draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


#: Requests a server must store, interleaved with the abuse so that storage runs alongside it.
well_formed_sends = st.lists(
    st.builds(p.SendItem, st.text(min_size=1, max_size=24), valid_subjects, st.builds(TimeSpec.delay,
              st.integers(0, 3000)), st.binary(max_size=256)),
    min_size=1, max_size=4,
).map(lambda items: p.encode(p.Frame(p.Command.SEND, 1, p.encode_send_request(items))))

connection_bytes = st.one_of(
    frames(),
    well_formed_sends,
    st.lists(frames(), min_size=2, max_size=5).map(b"".join),
    st.binary(min_size=1, max_size=2048),
)

# --- talking to the server ------------------------------------------------------------------------


def exchange(port: int, data: bytes) -> list[p.Frame]:
    """Send `data`, half-close, and read every frame until the server closes the connection.

    Raises AssertionError for bytes that are not whole, valid response frames.
    """
    decoder = p.FrameDecoder(max_frame_bytes=64 << 20)
    received = []
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused what it had read so far and closed: its answer is still there
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            except socket.timeout:
                raise AssertionError(f"no end of the answer within {READ_TIMEOUT_S} s") from None
            if not chunk:
                break
            decoder.feed(chunk)
            while (frame := decoder.next_frame()) is not p.NEED_DATA:
                received.append(frame)
    assert decoder.buffered_bytes == 0, f"the server sent a torn frame: {decoder.buffered_bytes} bytes left"
    for frame in received:
        assert frame.is_response, frame
        if frame.command == p.Command.ERROR:
            p.decode_error(frame.payload)
        elif frame.command == p.Command.SEND:
            p.decode_send_response(frame.payload)
    return received


def answer_kinds(frames: list[p.Frame]) -> list[str]:
    """What each answer was, for the summary: ERROR codes by name, else the command (SEND with its codes)."""
    out = []
    for f in frames:
        if f.command == p.Command.ERROR:
            out.append(f"ERROR {ResultCode(p.decode_error(f.payload).code).name}")
        elif f.command == p.Command.SEND:
            out += [f"SEND {ResultCode(r.code).name}" for r in p.decode_send_response(f.payload)]
        else:
            out.append(f.command.name)
    return out


def fuzz(proc: ServerProcess, seed: int) -> collections.Counter:
    """Run the hypothesis rounds (blocking); returns a count of the answers by kind."""
    answers = collections.Counter()

    @hypothesis_seed(seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(connection_bytes, min_size=1, max_size=8))
    def round_of_abuse(connections: list[bytes]) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(connections)) as pool:
            for future in [pool.submit(exchange, proc.port, data) for data in connections]:
                answers.update(answer_kinds(future.result()))
        answers["connections"] += len(connections)
        assert proc.process.poll() is None, f"the server died: {proc.log_text()[-3000:]}"

    round_of_abuse()
    return answers


def wait_closed(s: socket.socket, timeout_s: float) -> tuple[float | None, list[p.Frame]]:
    """Seconds until the server closed `s` (None: still open after `timeout_s`), and its frames."""
    began = time.monotonic()
    decoder, received = p.FrameDecoder(), []
    s.settimeout(0.05)
    while time.monotonic() - began < timeout_s:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - began, received
        if not chunk:
            return time.monotonic() - began, received
        decoder.feed(chunk)
        while (frame := decoder.next_frame()) is not p.NEED_DATA:
            received.append(frame)
    return None, received


def codes_of(frames: list[p.Frame]) -> set:
    return {p.decode_error(f.payload).code for f in frames if f.command == p.Command.ERROR}


def hold_connections_up_to_the_limit(proc: ServerProcess) -> None:
    """Idle and trickling connections up to the limit and past it (module docstring, 2.)."""
    room = MAX_CONNECTIONS - PRODUCERS
    trickling, idle, extra = 8, room - 8, 6
    opened = [socket.create_connection(("127.0.0.1", proc.port)) for _ in range(room + extra)]
    began = time.monotonic()
    try:
        # The connections past the limit are refused with BUSY at once; the ones within it are held.
        deadline = time.monotonic() + 3
        while len(answered := select.select(opened, [], [], 0.1)[0]) < extra and time.monotonic() < deadline:
            pass
        time.sleep(0.1)
        answered = select.select(opened, [], [], 0)[0]
        busy = [wait_closed(s, 1.0) for s in answered]
        assert len(busy) >= extra, f"{len(busy)} connections refused, {len(opened)} opened with room for {room}"
        assert all(closed is not None and codes_of(frames) == {ResultCode.BUSY} for closed, frames in busy), busy
        held = [s for s in opened if s not in answered]

        ping = p.encode(p.Frame(p.Command.PING, 7, b"slowly"))
        stop = threading.Event()

        def trickle(s: socket.socket) -> None:
            for byte in ping:
                if stop.wait(0.2):
                    return
                try:
                    s.send(bytes([byte]))
                except OSError:
                    return

        threads = [threading.Thread(target=trickle, args=(s,)) for s in held[:trickling]]
        for t in threads:
            t.start()
        trickle_start = time.monotonic()
        try:
            for s in held[:trickling]:
                closed, frames = wait_closed(s, FRAME_TIMEOUT_MS / 1000 + 2 - (time.monotonic() - trickle_start))
                assert closed is not None, "a trickling connection outlived frame_timeout_ms"
                assert codes_of(frames) == {ResultCode.BAD_REQUEST}, frames
        finally:
            stop.set()
            for t in threads:
                t.join()
        for s in held[trickling:]:
            closed, frames = wait_closed(s, IDLE_TIMEOUT_MS / 1000 + 2 - (time.monotonic() - began))
            assert closed is not None, "an idle connection outlived idle_timeout_ms"
        assert time.monotonic() - began >= IDLE_TIMEOUT_MS / 1000 * 0.9, "idle connections were dropped early"
    finally:
        for s in opened:
            s.close()
    assert exchange(proc.port, p.encode(p.Frame(p.Command.PING, 9, b"again")))[0].payload == b"again"


async def test_abuse_on_the_live_port_never_stops_well_behaved_producers_or_damages_the_logs(tmp_path):
    seed, rng = seeded_rng()
    config = write_config(tmp_path / "server.toml", {
        "segment_scale": "1m",
        "max_connections": MAX_CONNECTIONS,
        "frame_timeout_ms": FRAME_TIMEOUT_MS,
        "idle_timeout_ms": IDLE_TIMEOUT_MS,
        "max_frame_bytes": MAX_FRAME_BYTES,
        "max_delay": "1h",
    })
    proc = ServerProcess(tmp_path / "data", args=["--config", str(config)])
    ledger = Ledger(prefix=f"good{seed}")
    try:
        await trio.to_thread.run_sync(proc.start)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: drive(proc.address, ledger, rng, stop, producers=PRODUCERS, max_delay_ms=2000,
                                             batch=(1, 16), pause_ms=(5, 30), timeout=10))
            await trio.sleep(0.5)
            before = len(ledger.acked)
            answers = await trio.to_thread.run_sync(fuzz, proc, seed)
            during_fuzz = len(ledger.acked) - before
            before = len(ledger.acked)
            await trio.to_thread.run_sync(hold_connections_up_to_the_limit, proc)
            during_limits = len(ledger.acked) - before
            stop.set()
        print(f"abuse answered: {dict(answers.most_common())}")
        print(f"{during_fuzz} messages acknowledged meanwhile, "
              f"{during_limits} while the connection limit was held")
        assert ledger.unanswered == 0 and not ledger.refused, (ledger.unanswered, ledger.refused[:3])
        assert during_fuzz > 0 and during_limits > 0, "the producers were not served throughout"
        assert {"ERROR BAD_REQUEST", "SEND OK"} <= set(answers), "the abuse did not reach both refusal and storage"
        assert proc.process.poll() is None, proc.log_text()[-3000:]
        await trio.to_thread.run_sync(
            lambda: wait_until_delivered(ledger, lambda: spool_deliveries(proc.data_dir), timeout_s=30))
        assert await trio.to_thread.run_sync(proc.terminate) == 0, proc.log_text()[-3000:]
    finally:
        proc.kill()
    # Valid messages among the abuse were stored and delivered too; the pass rule is for the producers'.
    ours = [d for d in spool_deliveries(proc.data_dir) if d.message_id in ledger.sent]
    print(check_deliveries(ledger, ours, context=f"seed {seed}"))
    assert_verify_passes(proc.data_dir)
