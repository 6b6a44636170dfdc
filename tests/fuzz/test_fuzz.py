"""Coverage-guided fuzzing of the one reader and the frame decoder (atheris), for a bounded time.

Each target runs in a subprocess for DELAYSERVER_FUZZ_SECONDS (default 20) from the corpus kept in
tests/fuzz/corpus/<target>; any exception other than a typed damage report or protocol error, or
an allocation out of proportion to the input, makes libFuzzer stop with a crash and this test
fail with its output. Run longer by hand (README: Fuzzing).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from tests.fuzz import fuzz_frames, fuzz_reader
from tests.fuzz.harness import bounded

CORPUS = Path(__file__).parent / "corpus"
REPO = Path(__file__).resolve().parents[2]
SECONDS = int(os.environ.get("DELAYSERVER_FUZZ_SECONDS", "20"))


@pytest.mark.parametrize("target", ["reader", "frames"])
def test_fuzzing_finds_no_crash(target, tmp_path):
    found = tmp_path / "corpus"
    found.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "tests.fuzz", target, f"-max_total_time={SECONDS}", "-timeout=10",
         f"-artifact_prefix={tmp_path}/", str(found), str(CORPUS / target)],
        cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 300,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    assert "Done" in done.stderr and not list(tmp_path.glob("crash-*"))


@pytest.mark.parametrize("target, module", [("reader", fuzz_reader), ("frames", fuzz_frames)])
def test_every_kept_input_passes_its_target(target, module):
    tracemalloc.start()
    try:
        inputs = sorted((CORPUS / target).iterdir())
        assert inputs
        for path in inputs:
            bounded(module.test_one_input, path.read_bytes())
    finally:
        tracemalloc.stop()


def test_the_allocation_bound_catches_an_allocation_out_of_proportion():
    tracemalloc.start()
    try:
        with pytest.raises(AssertionError, match="allocated"):
            bounded(lambda data: bytearray(int.from_bytes(data, "big")), (8 << 20).to_bytes(4, "big"))
    finally:
        tracemalloc.stop()
