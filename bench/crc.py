"""`ops/bench crc [--rounds N]`: what the records kernels' crc32c (delayserver/native/crc32c.h)
costs per buffer, each way it computes it: three streams joined by table shifts (what the kernels
use where the processor has SSE4.2), one chain of the crc32 instruction, and the table, at the
sizes a record has on the hot paths (a 256-byte delivery's record is about 300 bytes, ingest's
1 KiB message about 1,100) and a request's 70 KB.

Each figure is the least of five timings of `records.crc32c_rounds`, a compiled loop of N crcs
of one buffer, each from the last's value, so that no interpreter step sits between two.
"""
from __future__ import annotations

import argparse
import os
import time

from delayserver.native import records

SIZES = (64, 150, 300, 600, 1100, 4096, 70_000)
WAYS = ("three streams", "one chain", "table")


def ns_per_crc(data: bytes, rounds: int, way: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        records.crc32c_rounds(data, rounds, way)
        best = min(best, time.perf_counter() - start)
    return best * 1e9 / rounds


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench crc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200_000, help="crcs per timing of a 1,100-byte buffer "
                        "(scaled by size for the others)")
    args = parser.parse_args(argv)
    ways = range(3) if records.CRC32C_HARDWARE else (2,)
    print(f"crc32c of crc32c.h, three-stream parts {records.CRC32C_PARTS[0]} and {records.CRC32C_PARTS[1]} bytes; "
          f"SSE4.2 {'yes' if records.CRC32C_HARDWARE else 'no (the table only)'}")
    for size in SIZES:
        data = os.urandom(size)
        rounds = max(1000, args.rounds * 1100 // size)
        figures = ", ".join(f"{WAYS[w]} {ns_per_crc(data, rounds, w):,.1f} ns" for w in ways)
        print(f"  {size:>6,} bytes: {figures}")
