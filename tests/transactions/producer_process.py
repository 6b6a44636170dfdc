"""A producer process for the end-to-end tests of half messages (run as a script).

    producer_process.py prepare ADDRESS GROUP SUBJECT DELAY_MS     prepare, print the handle, die (no commit)
    producer_process.py answer ADDRESS GROUP commit|rollback|unknown
        register for GROUP's checks, print "ready", then one line "check <id> <n>" per check, until killed
"""
from __future__ import annotations

import os
import sys
import threading

from delayserver.client import Producer
from delayserver.message import TransactionState


class Answer:
    def __init__(self, state: TransactionState):
        self.state = state
        self.lock = threading.Lock()

    def execute_local_transaction(self, message, arg):
        return TransactionState.UNKNOWN

    def check_local_transaction(self, message):
        with self.lock:  # checks are answered on worker threads: one line at a time
            print(f"check {message.message_id} {message.checks}", flush=True)
        return self.state


def main(argv: list[str]) -> None:
    mode, address, group = argv[:3]
    if mode == "prepare":
        subject, delay_ms = argv[3], int(argv[4])
        producer = Producer(address, timeout=20)
        handle = producer.prepare(subject, f"prepared by {os.getpid()}".encode(), group=group, delay=delay_ms)
        print(handle, flush=True)
        os._exit(0)  # the process dies before its local transaction ends: no commit, no rollback
    state = {"commit": TransactionState.COMMIT, "rollback": TransactionState.ROLLBACK,
             "unknown": TransactionState.UNKNOWN}[argv[3]]
    with Producer(address, timeout=20, group=group, transaction_listener=Answer(state)) as producer:
        producer.ping()  # connected, so registered for the group's checks
        print("ready", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
