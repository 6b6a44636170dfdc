"""How the job starts its driver JVM (`spark.jvm`): which archive it uses or writes, and which
compilers it runs. The archive's use by a real JVM is in test_reconcile."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spark import jvm

pytestmark = pytest.mark.skipif(jvm.java_executable() is None, reason="no java on PATH, no JAVA_HOME")


def jars_in(path):
    path.mkdir()
    for name in ("spark-core.jar", "spark-sql.jar"):
        (path / name).write_bytes(b"PK" + name.encode())
    return path


def test_the_client_compiler_alone_for_a_small_job_and_the_default_for_a_big_one():
    assert jvm.compiler_options("auto", jvm.QUICK_BELOW_BYTES - 1) == jvm.QUICK
    assert jvm.compiler_options("auto", jvm.QUICK_BELOW_BYTES) == ""
    assert jvm.compiler_options("quick", 10 << 30) == jvm.QUICK
    assert jvm.compiler_options("full", 0) == ""
    with pytest.raises(ValueError, match="jit must be one of auto, quick, full"):
        jvm.compiler_options("fast", 0)


def test_the_archive_is_named_after_the_java_the_jars_and_the_class_path_settings(tmp_path):
    jars = jars_in(tmp_path / "jars")
    java = jvm.java_executable()
    key = jvm.archive_key(java, jars, {"spark.driver.memory": "2g"})
    assert jvm.archive_key(java, jars, {"spark.driver.memory": "6g"}) == key  # not on the class path
    assert jvm.archive_key(java, jars, {"spark.driver.extraClassPath": "/opt/x.jar"}) != key
    assert jvm.archive_key(java, jars, {"spark.jars": "/opt/y.jar"}) != key
    (jars / "spark-core.jar").write_bytes(b"PK another build")
    assert jvm.archive_key(java, jars, {}) != key


def test_a_run_without_an_archive_writes_one_and_a_later_run_maps_it(tmp_path):
    jars = jars_in(tmp_path / "jars")
    archives = tmp_path / "cache" / "spark"
    first = jvm.prepare(archives, jars, {})
    assert first.pending is not None and not first.path.exists()
    assert first.options == f"-XX:ArchiveClassesAtExit={first.pending} {jvm.QUIET}"
    first.pending.write_bytes(b"an archive")
    os.replace(first.pending, first.path)
    later = jvm.prepare(archives, jars, {})
    assert later == jvm.Archive(first.path)
    assert later.options == f"-XX:SharedArchiveFile={first.path} {jvm.QUIET}"


def test_the_partial_archive_of_a_run_that_is_gone_is_removed_and_a_live_one_kept(tmp_path):
    jars = jars_in(tmp_path / "jars")
    archives = tmp_path / "spark"
    archives.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    abandoned = archives / f"spark-0123.{int(gone.stdout)}.partial"
    live = archives / f"spark-0123.{os.getppid()}.partial"
    abandoned.write_bytes(b"half")
    live.write_bytes(b"being written")
    jvm.prepare(archives, jars, {})
    assert not abandoned.exists() and live.exists()


def test_no_archive_where_the_directory_cannot_be_made(tmp_path):
    jars = jars_in(tmp_path / "jars")
    (tmp_path / "file").write_text("not a directory")
    assert jvm.prepare(tmp_path / "file" / "spark", jars, {}) is None


def test_finish_puts_the_archive_in_place_only_after_a_clean_exit(tmp_path):
    """The launched process stands for spark-submit: it exits when its stdin closes, as the JVM
    pyspark launches does, writing the archive on its way out (or failing to)."""
    archive = jvm.Archive(tmp_path / "spark-k.jsa", tmp_path / "spark-k.1.partial")

    class Gateway:
        def __init__(self, code):
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"import sys; sys.stdin.read(); "
                                       f"open({str(archive.pending)!r}, 'wb').write(b'classes'); sys.exit({code})"],
                stdin=subprocess.PIPE)
            self.shut = False

        def shutdown(self):
            self.shut = True

    failed = Gateway(3)
    assert jvm.finish(archive, failed) is False
    assert failed.shut and not archive.path.exists() and not archive.pending.exists()
    (tmp_path / "spark-old.jsa").write_bytes(b"another JDK's")
    assert jvm.finish(archive, Gateway(0)) is True
    assert archive.path.read_bytes() == b"classes" and not archive.pending.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spark-k.jsa"]
    assert jvm.finish(jvm.Archive(archive.path), object()) is False  # an archive in use: nothing to do
