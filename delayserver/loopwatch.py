"""Event-loop stalls made visible: a trio instrument that times every task step.

One task step runs without yielding to any other task: a step of 100 ms is 100 ms during which no
message is delivered, acknowledged or answered. The node installs this instrument while it serves;
a step at or over `threshold_s` is counted (`delayserver_event_loop_slow_steps_total`, and the
longest step in `delayserver_event_loop_longest_step_seconds`) and logged as a warning naming the
task (at most one line per `log_every_s`, with how many more were seen meanwhile).

Garbage collection is timed too (`on_gc`, for `gc.callbacks`): a step's warning says how much of
it the collector took, and the total is `delayserver_gc_pause_seconds_total`. A pause no task
step explains otherwise is usually a full collection walking everything the node holds.

Its cost is two clock reads per task step and per collection.
"""
from __future__ import annotations

import logging
import time

import trio

log = logging.getLogger("delayserver.loop")

DEFAULT_THRESHOLD_S = 0.1


class LoopWatch(trio.abc.Instrument):
    def __init__(self, threshold_s: float = DEFAULT_THRESHOLD_S, log_every_s: float = 10.0, clock=time.perf_counter,
                 gc_clock=time.thread_time):
        """`clock` times steps (wall time: what the loop lost); `gc_clock` times collections (this
        thread's CPU time: a callback may hand the interpreter's lock to another thread between
        "start" and the collection, and that wait is not the collector's)."""
        self.threshold_s = threshold_s
        self.log_every_s = log_every_s
        self.clock = clock
        self.gc_clock = gc_clock
        self.slow_steps = 0
        self.longest_s = 0.0
        self.longest_task = ""
        self._began: float | None = None  # None: installed mid-step, that step is not timed
        self._logged_at: float | None = None
        self._unlogged = 0
        self.gc_seconds = 0.0
        self.gc_longest_s = 0.0
        self._gc_began: float | None = None
        self._step_gc_s = 0.0
        self._step_gc_generation = -1

    def on_gc(self, phase: str, info: dict) -> None:
        """A `gc.callbacks` entry: time each collection, and charge it to the running step."""
        if phase == "start":
            self._gc_began = self.gc_clock()
            return
        if self._gc_began is None:
            return
        took = self.gc_clock() - self._gc_began
        self._gc_began = None
        self.gc_seconds += took
        self.gc_longest_s = max(self.gc_longest_s, took)
        self._step_gc_s += took
        self._step_gc_generation = max(self._step_gc_generation, info.get("generation", -1))

    def before_task_step(self, task) -> None:
        self._began = self.clock()
        self._step_gc_s, self._step_gc_generation = 0.0, -1

    def after_task_step(self, task) -> None:
        if self._began is None:
            return
        took = self.clock() - self._began
        if took < self.threshold_s:
            return
        self.slow_steps += 1
        if took > self.longest_s:
            self.longest_s, self.longest_task = took, task.name
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < self.log_every_s:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more slow steps since the last warning)" if self._unlogged else ""
        gc_part = ""
        if self._step_gc_s >= 0.001:
            gc_part = (f", {self._step_gc_s * 1000:.0f} ms of it in garbage collection "
                       f"(generation {self._step_gc_generation})")
        log.warning("event loop blocked for %.0f ms by task %s%s%s", took * 1000, task.name, gc_part, more)
        self._logged_at, self._unlogged = now, 0
