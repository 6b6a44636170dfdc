"""`ops/bench pump [--requests N] [--batch M] [--repeat R]`: what the node's connection pump costs
per SEND request, apart from storing it.

A load process sends SEND requests of M messages of 1 KiB (as `ops/bench storage`'s receive
line makes them) over a real TCP socket on loopback, one at a time, each waiting for its answer; in
this process `delayserver.node.pump.pump` reads them off the socket, frames them and answers each
at once with a fixed response of the size a SEND answer has, through the same task and send path
as the node's. A trio instrument times every task step by its thread's CPU: the figures are the
CPU of the pump's own steps (reading, framing, starting the answer) and of the answer's steps,
per request. Storing is left out (`ops/bench storage`'s "receive" line measures it), so that what
a request costs the connection can be told apart from what its messages cost the node.
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time

import trio

from bench.harness import environment_note, memory_note

RESPONSE_BYTES_PER_MESSAGE = 48  # about what a SEND answer carries per message


def request_frame(batch: int) -> bytes:
    """A SEND frame of `batch` messages of 1 KiB, as `ops/bench storage` makes its requests."""
    from bench.storage import send_request
    from delayserver import protocol as p

    return p.encode(p.Frame(p.Command.SEND, 1, send_request(0, batch)))


def load(port: int, requests: int, batch: int) -> None:
    """The load process: `requests` SEND frames, one at a time, each after the last one's answer."""
    import socket

    frame = request_frame(batch)
    response = RESPONSE_BYTES_PER_MESSAGE * batch
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(requests):
            sock.sendall(frame)
            got = 0
            while got < response:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("the pump closed the connection")
                got += len(chunk)


class _StepCpu(trio.abc.Instrument):
    """Thread CPU and count of the task steps, by the task's function name."""

    def __init__(self) -> None:
        self.ns: collections.Counter = collections.Counter()
        self.steps: collections.Counter = collections.Counter()
        self._started = 0

    def before_task_step(self, task) -> None:
        self._started = time.thread_time_ns()

    def after_task_step(self, task) -> None:
        name = task.name.rsplit(".", 1)[-1]
        self.ns[name] += time.thread_time_ns() - self._started
        self.steps[name] += 1


def run(requests: int, batch: int) -> dict:
    """One run: {"pump_us", "answer_us", "pump_steps", "answer_steps"} per request."""
    from delayserver import protocol as p
    from delayserver.node.pump import PumpLimits, pump

    steps = _StepCpu()

    async def main() -> None:
        answer = p.encode(p.Frame(p.Command.SEND, 1, b"r" * (RESPONSE_BYTES_PER_MESSAGE * batch - p.FRAME_OVERHEAD),
                                  is_response=True))

        async def respond(frame: p.Frame) -> bytes:
            return answer

        async def serve_pump(stream) -> None:  # the task whose steps are the pump's
            async with stream:
                await pump(stream, PumpLimits(p.DEFAULT_MAX_FRAME_BYTES, idle_timeout_s=60), respond)

        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        async with listener, trio.open_nursery() as nursery:
            loader = await trio.lowlevel.open_process(
                [sys.executable, "-m", "bench.pump", "load", str(port), str(requests), str(batch)])
            nursery.start_soon(serve_pump, await listener.accept())
            if await loader.wait():
                raise RuntimeError(f"the load process failed ({loader.returncode})")

    trio.run(main, instruments=[steps])
    return {"pump_us": steps.ns["serve_pump"] / requests / 1000, "answer_us": steps.ns["answer"] / requests / 1000,
            "pump_steps": steps.steps["serve_pump"] / requests, "answer_steps": steps.steps["answer"] / requests}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench pump")
    parser.add_argument("--requests", type=int, default=20_000, help="SEND requests a run (default 20,000)")
    parser.add_argument("--batch", type=int, default=64, help="messages of 1 KiB per request (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="runs (default 3)")
    args = parser.parse_args(argv)
    if min(args.requests, args.batch, args.repeat) < 1:
        parser.error("--requests, --batch and --repeat take a whole number of at least 1")
    print(f"pump on {environment_note()}; {memory_note()}", flush=True)
    for _ in range(args.repeat):
        r = run(args.requests, args.batch)
        print(f"pump: SEND requests of {args.batch} x 1 KiB over loopback, answered at once: the pump's steps "
              f"{r['pump_us']:.1f} us of CPU per request ({r['pump_steps']:.2f} steps), the answer's "
              f"{r['answer_us']:.1f} us ({r['answer_steps']:.2f} steps)", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        load(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main(sys.argv[1:])
