"""delayctl: operator tools for a delay server's data directory and, later, a running node.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its parser and
sets `run(args) -> exit code`. Exit codes: 0 healthy or done, 1 something damaged or failed, 2 a
usage error (argparse).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from delayserver.ctl import browse, buckets, diverged, inspect, meta, parked, producer, salvage, schedules, spool, verify

COMMANDS = [inspect, verify, buckets, producer, browse, schedules, spool, parked, meta, salvage, diverged]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="delayctl", description="Operator tools for the delay server.")
    subparsers = parser.add_subparsers(metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`delayctl inspect ... | head`): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
