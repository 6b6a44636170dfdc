"""The worker threads of the node's own disk work: the fsyncs that acknowledgements and deliveries
wait for, and the reads of records falling due.

They are threads of a pool of their own (`DISK_THREADS` of them at most), not trio's default
limiter's, which every other blocking call in the process shares (the backlog scan, dedupe saves,
id-index merges, the meta agent's files, library calls). However much of that work is under way,
an acknowledgement never waits for a thread. Each broker transport that blocks in threads has a
pool of its own too (`delayserver.sender.transport.TRANSPORT_THREADS`).

A `ThreadPool` is what `trio.to_thread.run_sync` is for these calls, without what they do not use:
the hand-over of a job to a thread and of its result back costs about a third of what trio's does
(`ops/bench threads`: 39.2 against 103.7 us of CPU when it was written), since trio names the OS
thread after each job and back again (two system calls through ctypes), copies the task's context
and books the job in a limiter; delivery makes such a call per spool append, per dispatch_log
fsync and per read-ahead round. What they share: the calling task waits, uncancellable, until a
job that began has ended (a thread cannot be stopped halfway through an fsync); a job still
waiting for a thread is cancelled as any wait is. A job's thread is not one of trio's: to call
back into trio (`trio.from_thread`) it must pass the run's `trio_token` (none of the node's do).
"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable

import outcome
import trio

#: Worker threads the node's fsyncs and due reads may hold at once.
DISK_THREADS = 16

#: A thread that had no job for this long ends (a pool keeps none it does not use).
IDLE_SECONDS = 10.0


class _Job:
    __slots__ = ("fn", "args", "task", "token")

    def __init__(self, fn, args, task, token):
        self.fn, self.args, self.task, self.token = fn, args, task, token


class ThreadPool:
    """Up to `max_threads` worker threads for blocking calls (`run`), started as needed and ended
    after `idle_seconds` without a job; calls beyond `max_threads` wait for a thread, in order.
    One pool may serve several trio runs: a job's result goes back to the run that asked."""

    def __init__(self, max_threads: int, name: str = "delayserver worker", *, idle_seconds: float = IDLE_SECONDS):
        if max_threads < 1:
            raise ValueError(f"a thread pool needs at least one thread, not {max_threads}")
        self.max_threads = max_threads
        self.name = name
        self.idle_seconds = idle_seconds
        self._mutex = threading.Lock()
        self._idle: list[_Worker] = []  # the last to go idle first: its stack is warm
        self._queued: collections.deque[_Job] = collections.deque()
        self.busy = 0  # threads running a job

    @property
    def threads(self) -> int:
        """Threads started and not ended: those running a job and those idle."""
        return self.busy + len(self._idle)

    @property
    def queued(self) -> int:
        """Calls waiting for a thread."""
        return len(self._queued)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in one of the pool's threads: its result, or what it raised. Cancellable
        only while it waits for a thread."""
        await trio.lowlevel.checkpoint_if_cancelled()
        job = _Job(fn, args, trio.lowlevel.current_task(), trio.lowlevel.current_trio_token())
        with self._mutex:
            if self._idle:
                worker = self._idle.pop()
                self.busy += 1
                worker.give(job)
            elif self.threads < self.max_threads:
                _Worker(self, job)  # raises RuntimeError if the system has no thread for it
                self.busy += 1
            else:
                self._queued.append(job)

        def abort(_raise_cancel) -> trio.lowlevel.Abort:
            with self._mutex:
                try:
                    self._queued.remove(job)  # not begun: it never will
                except ValueError:
                    return trio.lowlevel.Abort.FAILED  # under way: it is waited for
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    # --- the threads' side ---------------------------------------------------------------------

    def _next(self, worker: _Worker) -> _Job | None:
        """The job a worker that finished one runs next, or None (it waits, idle)."""
        with self._mutex:
            if self._queued:
                return self._queued.popleft()
            self.busy -= 1
            self._idle.append(worker)
            return None

    def _retire(self, worker: _Worker) -> bool:
        """True if the idle `worker` ends now; False if a job was given to it meanwhile."""
        with self._mutex:
            if worker not in self._idle:
                return False
            self._idle.remove(worker)
            return True


class _Worker:
    __slots__ = ("pool", "job", "ready")

    def __init__(self, pool: ThreadPool, job: _Job):
        self.pool, self.job = pool, job
        self.ready = threading.Lock()
        self.ready.acquire()  # released when a job is given
        threading.Thread(target=self._work, name=pool.name, daemon=True).start()

    def give(self, job: _Job) -> None:
        self.job = job
        self.ready.release()

    def _work(self) -> None:
        pool, job = self.pool, self.job
        while True:
            while job is not None:
                self.job = None
                result = outcome.capture(job.fn, *job.args)
                task, token = job.task, job.token
                job = pool._next(self)  # before the result goes back: its next call may find this thread idle
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(trio.lowlevel.reschedule, task, result)
                del result, task, token
            if not self.ready.acquire(timeout=pool.idle_seconds):
                if pool._retire(self):
                    return
                self.ready.acquire()  # a job is being given: it comes
            job = self.job


_disk_pool: trio.lowlevel.RunVar = trio.lowlevel.RunVar("delayserver_disk_threads")


def disk_pool() -> ThreadPool:
    """This trio run's pool for the node's disk work (made on first use)."""
    try:
        return _disk_pool.get()
    except LookupError:
        pool = ThreadPool(DISK_THREADS, "delayserver disk")
        _disk_pool.set(pool)
        return pool


async def run_disk(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread of the disk pool."""
    return await disk_pool().run(fn, *args)
