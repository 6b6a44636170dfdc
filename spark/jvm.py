"""How the driver JVM a reconciliation launches itself starts: its class data sharing archive,
and which of the JVM's compilers it runs.

Starting Spark loads thousands of classes from its 280 jars; the JVM parses and verifies each one. A
dynamic class data sharing archive (JDK 13 and later: `-XX:ArchiveClassesAtExit` writes one when the
JVM exits, `-XX:SharedArchiveFile` maps it at start) holds them already parsed: on a 2-core machine
`ops/bench reconcile 500000` took 13.4 to 14.7 s with it and 17.5 to 24.4 s without (README).

The archive is only good for the JVM and class path it was written with, so its name is a digest
of both (`archive_key`). A run that finds none writes one: its JVM dumps the classes it loaded when
it exits, which took about 12 s here, once; `finish` waits for that exit and only then moves the
archive into place under its final name, so a JVM that died half-way never leaves a broken one
behind. A JVM that finds an archive it cannot use (a JDK updated in place) starts without it, as if
there were none.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import attrs

#: The JVM's client compiler alone (`--jit quick`): the JVM compiles hot code once, quickly, and
#: never again with the optimizing compiler. On a 2-core machine a short job spends a good part of
#: its cores on the optimizing compiler's work, which pays back only in a longer one. Measured with
#: `ops/bench reconcile` (README): 1,000,400 records (179 MiB of logs) take about 3.5 s less with
#: it, 2,000,800 (357 MiB) about the same, 10,004,000 (1,785 MiB) half as long again.
QUICK = "-XX:TieredStopAtLevel=1"
#: `--jit auto` runs the client compiler alone when the logs read total less than this.
QUICK_BELOW_BYTES = 256 << 20
JIT_MODES = ("auto", "quick", "full")


def compiler_options(mode: str, input_bytes: int) -> str:
    """The JVM options for `mode` (one of JIT_MODES) and a job reading `input_bytes`."""
    if mode not in JIT_MODES:
        raise ValueError(f"jit must be one of {', '.join(JIT_MODES)}, got {mode!r}")
    quick = mode == "quick" or (mode == "auto" and input_bytes < QUICK_BELOW_BYTES)
    return QUICK if quick else ""


#: Silence class data sharing's own log: the JVM writes it to stdout, where the report goes, and
#: writing an archive lists every class it leaves out (those of signed jars, generated code).
QUIET = "-Xlog:cds*=off"


def default_dir() -> Path:
    """Where archives are kept: $XDG_CACHE_HOME/delayserver/spark (~/.cache/delayserver/spark)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "delayserver" / "spark"


def java_executable() -> Path | None:
    """The java spark-submit runs: $JAVA_HOME/bin/java, else the one on PATH (resolved)."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


def archive_key(java: Path, jars: Path, conf: dict[str, str]) -> str:
    """A digest of what an archive depends on: the java binary (path, size, time), the jars Spark
    puts on the class path (names, sizes, times) and the settings that add to it."""
    digest = hashlib.sha256()

    def add(path: Path) -> None:
        st = path.stat()
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())

    add(java)
    for jar in sorted(jars.glob("*.jar")):
        add(jar)
    for key in sorted(conf):
        if "classpath" in key.lower() or "jars" in key.lower():
            digest.update(f"{key}={conf[key]}\n".encode())
    return digest.hexdigest()[:20]


@attrs.frozen
class Archive:
    """The archive a session's JVM uses (`path` exists) or writes (to `pending`, on exit)."""

    path: Path
    pending: Path | None = None

    @property
    def options(self) -> str:
        """The driver JVM options that use or write it."""
        if self.pending is None:
            return f"-XX:SharedArchiveFile={self.path} {QUIET}"
        return f"-XX:ArchiveClassesAtExit={self.pending} {QUIET}"


def prepare(directory: Path, jars: Path, conf: dict[str, str]) -> Archive | None:
    """The archive for a JVM started with `conf` and the jars in `jars`, kept in `directory`; None
    when there is no java to key it on or the directory cannot be made."""
    java = java_executable()
    if java is None or not jars.is_dir():
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    path = directory / f"spark-{archive_key(java, jars, conf)}.jsa"
    _remove_abandoned(directory)
    if path.is_file():
        return Archive(path)
    if not os.access(directory, os.W_OK):
        return None
    return Archive(path, path.with_name(f"{path.stem}.{os.getpid()}.partial"))


def finish(archive: Archive | None, gateway) -> bool:
    """After the session stopped: when its JVM writes an archive, end the JVM, wait for it, and
    move the archive into place if the JVM exited cleanly. Returns whether an archive was put there.

    `gateway` is the py4j gateway pyspark launched (its `proc` is the spark-submit process, which
    exits when its stdin closes). Waits at most two minutes; a JVM still running then is left to
    finish, and its archive is not used.
    """
    if archive is None or archive.pending is None or gateway is None:
        return False
    proc = getattr(gateway, "proc", None)
    if proc is None:
        return False
    try:
        gateway.shutdown()
    except Exception:  # noqa: BLE001 - the gateway may be gone already; the exit below decides
        pass
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        status = proc.wait(timeout=120)
    except Exception:  # noqa: BLE001 - a JVM that does not exit in time leaves no archive
        return False
    if status != 0 or not archive.pending.is_file() or archive.pending.stat().st_size == 0:
        archive.pending.unlink(missing_ok=True)
        return False
    os.replace(archive.pending, archive.path)
    # One JDK and one Spark per machine is the rule: an archive for others is dead weight (a few
    # hundred MB); a machine that switches back writes it again.
    for other in archive.path.parent.glob("spark-*.jsa"):
        if other != archive.path:
            other.unlink(missing_ok=True)
    return True


def _remove_abandoned(directory: Path) -> None:
    """Remove the partial archives of runs that are gone (killed before their JVM's exit)."""
    for partial in directory.glob("spark-*.partial"):
        try:
            pid = int(partial.suffixes[-2].lstrip("."))
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            partial.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
