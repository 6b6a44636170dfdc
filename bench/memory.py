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


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="ops/bench memory")
    parser.add_argument("--warm", action="store_true", help="touch the available memory once, then measure again")
    parser.add_argument("--leave-gib", type=float, default=2.0, metavar="N",
                        help="with --warm: GiB of the available memory left untouched (default 2)")
    args = parser.parse_args(argv)
    if args.leave_gib < 0:
        parser.error("--leave-gib takes a number of GiB of at least 0")
    print(f"page-cache writes: {page_cache_cost():.2f} us of CPU per KiB (256 MiB into a new file)", flush=True)
    if args.warm:
        want = max(available_bytes() - int(args.leave_gib * GIB), 0)
        start = time.monotonic()
        touched = touch(want)
        print(f"touched {touched / GIB:.0f} GiB of memory in {time.monotonic() - start:.1f} s", flush=True)
        print(f"page-cache writes: {page_cache_cost():.2f} us of CPU per KiB (256 MiB into a new file)")


if __name__ == "__main__":
    main(sys.argv[1:])
