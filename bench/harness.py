"""Processes and figures shared by the end-to-end benchmarks (`deliver`, `compare`).

Every process a benchmark starts binds 127.0.0.1 only, lives in a temp directory, and is stopped
by the benchmark on the way out, also on an error or Ctrl-C (callers hold them in an ExitStack).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import psutil
import redis

from delayserver.metrics import percentile

LOCALHOST = "127.0.0.1"
_SERVING = re.compile(rb"serving on ([\d.]+):(\d+)")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait()


@attrs.define(eq=False)
class RedisProcess:
    """A redis-server on 127.0.0.1:`port` with its files in `directory`.

    Without `appendonly` it keeps nothing on disk (no RDB snapshots either), as delay queues on
    Redis are often run; with it, the AOF is fsynced as `appendfsync` says: every second
    (`everysec`, the default) or before each write is answered (`always`).
    """

    directory: Path
    port: int = attrs.field(factory=free_port)
    appendonly: bool = False
    appendfsync: str = "everysec"
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    def client(self, **kw) -> redis.Redis:
        return redis.Redis(host=LOCALHOST, port=self.port, **kw)

    def start(self, timeout: float = 10.0) -> "RedisProcess":
        executable = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(executable).exists():
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                [executable, "--port", str(self.port), "--bind", LOCALHOST, "--dir", str(self.directory),
                 "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.appendfsync],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        client = self.client(socket_timeout=1)
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)
        client.close()
        return self

    def kill(self) -> None:
        """kill -9: whatever only memory held is gone."""
        if self.process is not None:
            _kill(self.process)

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process, 5)


@attrs.define(eq=False)
class DelayServerProcess:
    """`delayserver serve` on a free port of 127.0.0.1, its log in `<data_dir>.log`."""

    data_dir: Path
    config_path: Path | None = None
    flush: str = "sync"
    process: subprocess.Popen | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.with_name(self.data_dir.name + ".log")

    def start(self, timeout: float = 60.0) -> "DelayServerProcess":
        """Start the server and return once it prints its "serving on" line (after recovery)."""
        args = [sys.executable, "-m", "delayserver", "serve", "--data-dir", str(self.data_dir),
                "--listen", f"{LOCALHOST}:0", "--flush", self.flush, "--log-level", "WARNING"]
        if self.config_path is not None:
            args += ["--config", str(self.config_path)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log)
        timer = threading.Timer(timeout, self.process.kill)
        timer.start()
        try:
            line = self.process.stdout.readline()
        finally:
            timer.cancel()
        m = _SERVING.search(line)
        if m is None:
            self.stop()
            raise RuntimeError(f"delay server did not start; its log:\n{self.log_path.read_text()[-3000:]}")
        self.port = int(m.group(2))
        return self

    def kill(self) -> None:
        if self.process is not None:
            _kill(self.process)

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process, 30)


class PeakRss:
    """Samples, every `interval` seconds in a thread, the summed RSS of the processes `pids()`
    names, and keeps the peak (bytes), and the peak of the file pages in it (`peak_file`: mapped
    files' pages, shared with the page cache, such as the segments the read-ahead maps and the
    interpreter's libraries; RssFile and RssShmem). A process that is gone counts as 0."""

    def __init__(self, pids, interval: float = 0.05):
        self._pids = pids
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")
        self.peak = 0
        self.peak_file = 0

    def sample(self) -> None:
        """One look at the processes (the thread's, every `interval`)."""
        total = shared = 0
        for pid in self._pids():
            try:
                info = psutil.Process(pid).memory_info()
            except psutil.Error:
                continue
            total += info.rss
            shared += info.shared
        self.peak = max(self.peak, total)
        self.peak_file = max(self.peak_file, shared)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self.sample()
            self._stopped.wait(self._interval)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._thread.join()


def run_child(args: list[str], timeout: float) -> bytes:
    """Run a Python child to completion and return its stdout; it is killed on timeout or Ctrl-C.

    Raises RuntimeError with its stderr when it fails.
    """
    done = subprocess.run([sys.executable, *args], capture_output=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{done.stderr.decode(errors='replace')[-3000:]}")
    return done.stdout


def lateness_figures(lateness_ms: list[int]) -> dict[str, int]:
    """P50, P90, P99, P999 and max of lateness values (ms), and how many are negative (early)."""
    values = sorted(lateness_ms)
    out = {name: percentile(values, q) for name, q in
           (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))}
    out["max"] = values[-1] if values else 0
    out["early"] = sum(1 for v in values if v < 0)
    return out


def format_lateness(f: dict[str, int]) -> str:
    return (f"P50 {f['p50']} ms, P90 {f['p90']} ms, P99 {f['p99']} ms, P999 {f['p999']} ms, "
            f"max {f['max']} ms; early {f['early']}")


def mib(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 20):.0f} MiB"


def pids_of(*processes) -> list[int]:
    """The pids of those of `processes` (objects with a `.process` Popen) that are running."""
    return [p.process.pid for p in processes if p.process is not None and p.process.poll() is None]


def py_spy(pid: int, seconds: float, out: str) -> subprocess.Popen:
    """py-spy sampling process `pid` 200 times a second for `seconds`, writing the collapsed stacks
    to `out` (`--profile` of the benchmarks); the caller waits for it."""
    return subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-r", "200",
                             "-d", str(max(1, round(seconds))), "-f", "raw", "-o", out, "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def loop_stalls_ms(server_log: str) -> list[int]:
    """The task steps the server logged as holding its event loop (delayserver/loopwatch.py: over
    100 ms), in ms; a warning that says how many more it left out counts those at its own length."""
    out = []
    for m in re.finditer(r"event loop blocked for (\d+) ms by task .*?(?:\((\d+) more slow steps since the last warning\))?$",
                         server_log, re.MULTILINE):
        out += [int(m.group(1))] * (1 + int(m.group(2) or 0))
    return out


def environment_note() -> str:
    """Cores, Python, and the load average: other work on the machine skews every figure; and the
    code the benchmark's servers run (`server_code`)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, load average {load}; {server_code()}"


def server_code() -> str:
    """Where the servers a benchmark starts import delayserver from, as they would import it (this
    environment's PYTHONPATH: bench/__init__.py puts the benchmarks' own tree first), and that
    tree's commit, "+changes" when it has uncommitted ones: a comparison of two trees is one only
    if each side says its own."""
    try:
        where = subprocess.run([sys.executable, "-c", "import delayserver, os; print(os.path.dirname(os.path.dirname(delayserver.__file__)))"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError) as e:
        return f"delayserver not importable here ({e})"
    try:
        rev = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return f"delayserver from {where}"
    return f"delayserver from {where} at {rev}{'+changes' if dirty else ''}"


def spread(values: list[float], fmt: str) -> str:
    """Median, and min-max when there is more than one value."""
    values = sorted(values)
    median = values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    return format(median, fmt) + ("" if len(values) == 1 else f" ({format(values[0], fmt)}-{format(values[-1], fmt)})")


def page_cache_cost(directory: str | None = None, mib: int = 256) -> float:
    """CPU microseconds (user + system) per KiB this process spends writing `mib` MiB into a new
    file in `directory` (a temp directory by default), 64 KiB a write, through the page cache: on a
    virtual machine it moves with how much of the memory its host has backed (bench/memory.py).
    256 MiB reaches past the few pages freed just before."""
    import tempfile

    chunk = b"\0" * 65536
    with tempfile.TemporaryFile(dir=directory) as f:
        fd = f.fileno()
        start = time.process_time()
        for _ in range(mib * 16):
            os.write(fd, chunk)
        spent = time.process_time() - start
    return spent / (mib * 1024) * 1e6


def memory_note(directory: str | None = None) -> str:
    """`page_cache_cost` (in `directory`) as a benchmark prints it, before its runs."""
    return (f"page-cache writes cost {page_cache_cost(directory):.2f} us of CPU per KiB here now "
            f"(pages the machine's host has not backed yet: about 2; touched before: about 0.3)")


def cpu_seconds(process: subprocess.Popen) -> float:
    """User plus system CPU time the process (with its threads) has used so far."""
    return proc_cpu_seconds(process.pid)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads), read from /proc/<pid>/stat: the CPU the process
    itself used, whatever else the machine runs."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """utime + stime of thread `tid` of process `pid` alone (/proc/<pid>/task/<tid>/stat); the
    main thread's `tid` is `pid`: a node's event loop, where its Python runs."""
    return _stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")


def _stat_cpu_seconds(path: str) -> float:
    with open(path, "rb") as f:
        stat = f.read()
    # The command name (field 2) is in parentheses and may hold spaces: split after its last ")".
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


async def sleep_late(late: list[float], stop) -> None:
    """Sleep 1 ms at a time on the running trio loop until `stop()` is true, appending to `late`
    how long past its time each sleep ended: what held the event loop meanwhile."""
    import trio

    while not stop():
        began = time.perf_counter()
        await trio.sleep(0.001)
        late.append(time.perf_counter() - began - 0.001)
