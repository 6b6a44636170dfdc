"""`ops/bench memory`: what a write into the page cache costs on this machine now, and `--warm` to
touch the machine's free memory once so that the benchmarks after it do not pay the first touch.

A virtual machine's host may back the guest's memory only when the guest first touches a page;
until then, every page the kernel takes for the page cache costs a fault in the host (measured on
the benchmark machine after a boot: about 2 us of CPU per KiB written, 0.3 once the memory had
been used). A benchmark that writes hundreds of MB then measures the machine as much as the code,
and the first of two runs in a sitting pays more than the second. `--warm` allocates and fills the
available memory but `--leave-gib` (default 2) in 1 GiB pieces, then frees it, and prints the
cost before and after. It does not last: the guest hands free pages back to the host after a while
(free page reporting), and there a probe went from 0.28 to 0.81 us/KiB within a minute of a warm-up.
A/B figures are therefore taken alternating in one sitting, never one build's runs after the other's.

`--fill N` writes N GiB into two new files (64 KiB writes, as two logs grow side by side) and
prints the cost of each 512 MiB: on the benchmark machine the page cache's first 4 GiB or so cost
about 0.3 us of CPU per KiB, every KiB beyond them about 2.8, run after run. `--drop` fsyncs each
512 MiB and gives its pages back (`posix_fadvise(DONTNEED)`), so that the cache stays small;
`--give-back` fsyncs each MiB of each file and gives its pages back at once, as the node gives back
message_log's behind its fsyncs, and prints the advice's own CPU beside the writes' (on the
benchmark machine 0.16 to 0.20 us per KiB written plus 0.06 to 0.08 for the advice, against 0.22
rising to 1.04 keeping the pages: the next writes reuse the pages given back).
"""
from __future__ import annotations

import sys
import time

from bench.harness import page_cache_cost

GIB = 1 << 30


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def touch(nbytes: int) -> int:
    """Allocate and fill `nbytes` (rounded down to whole GiB) at once, then free them; returns how
    many bytes were touched. Filled, not just allocated: the kernel maps a page on its first write."""
    pieces = [bytearray(GIB) for _ in range(nbytes // GIB)]  # zero-filled: every page written
    del pieces
    return nbytes // GIB * GIB


#: `--give-back`: how much of each file is written between two of its fsyncs (a few group commits
#: of message_log at 100,000 msg/s of 1 KiB messages).
GIVE_BACK_BYTES = 1 << 20


def fill(gib: float, drop: bool, directory: str | None = None, step: int = 512 << 20,
         give_back: bool = False) -> None:
    """`--fill`: write `gib` GiB into two new files, printing the CPU per KiB of each `step` bytes.
    `give_back`: each GIVE_BACK_BYTES of each file fsynced and handed back once written, as the
    receiver hands back message_log's: the fsyncs not counted (as with `drop`: the server's run in
    worker threads), the advice counted apart."""
    import os
    import tempfile

    chunk = b"x" * (64 << 10)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        fds = [os.open(f"{tmp}/f{i}", os.O_WRONLY | os.O_CREAT, 0o644) for i in range(2)]
        try:
            written = 0
            while written < gib * GIB:
                began = time.thread_time()
                synced = advised = 0.0
                for n in range(step // len(chunk) // len(fds)):
                    for fd in fds:
                        os.write(fd, chunk)
                    if give_back and (n + 1) * len(chunk) % GIVE_BACK_BYTES == 0:
                        for fd in fds:
                            end = os.lseek(fd, 0, os.SEEK_CUR)
                            before = time.thread_time()
                            os.fdatasync(fd)
                            between = time.thread_time()
                            os.posix_fadvise(fd, end - GIVE_BACK_BYTES, GIVE_BACK_BYTES, os.POSIX_FADV_DONTNEED)
                            synced += between - before
                            advised += time.thread_time() - between
                cpu = time.thread_time() - began - synced - advised
                if drop:  # (not counted: the server's fsyncs run in worker threads)
                    for fd in fds:
                        os.fdatasync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                written += step
                advice = f" (giving the pages back: {advised * 1e6 / (step >> 10):.2f} more)" if give_back else ""
                print(f"  {written / GIB:5.1f} GiB written: {cpu * 1e6 / (step >> 10):.2f} us of CPU per KiB{advice}",
                      flush=True)
        finally:
            for fd in fds:
                os.close(fd)


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="ops/bench memory")
    parser.add_argument("--warm", action="store_true", help="touch the available memory once, then measure again")
    parser.add_argument("--leave-gib", type=float, default=2.0, metavar="N",
                        help="with --warm: GiB of the available memory left untouched (default 2)")
    parser.add_argument("--fill", type=float, default=0.0, metavar="N",
                        help="write N GiB into two new files and print the cost of each 512 MiB")
    parser.add_argument("--drop", action="store_true",
                        help="with --fill: give each 512 MiB's pages back to the page cache once written")
    parser.add_argument("--give-back", action="store_true",
                        help="with --fill: fsync each MiB of each file and give its pages back at once, as the "
                             "receiver does message_log's")
    args = parser.parse_args(argv)
    if args.leave_gib < 0 or args.fill < 0:
        parser.error("--leave-gib and --fill take a number of GiB of at least 0")
    if args.fill:
        how = ", each 512 MiB given back" if args.drop else ", each MiB given back once fsynced" if args.give_back else ""
        print(f"page-cache writes while {args.fill:g} GiB fill it{how}:", flush=True)
        fill(args.fill, args.drop, give_back=args.give_back)
        return
    print(f"page-cache writes: {page_cache_cost():.2f} us of CPU per KiB (256 MiB into a new file)", flush=True)
    if args.warm:
        want = max(available_bytes() - int(args.leave_gib * GIB), 0)
        start = time.monotonic()
        touched = touch(want)
        print(f"touched {touched / GIB:.0f} GiB of memory in {time.monotonic() - start:.1f} s", flush=True)
        print(f"page-cache writes: {page_cache_cost():.2f} us of CPU per KiB (256 MiB into a new file)")


if __name__ == "__main__":
    main(sys.argv[1:])
