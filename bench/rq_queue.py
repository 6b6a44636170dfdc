"""The real rq-scheduler, as `ops/bench compare` runs it beside our server and the sorted-set poller.

Three parts, each the package's own code in its own process, on one redis-server:

- producers (`python -m bench.workload send rq ...`): `Scheduler.enqueue_at(due, arrive, ...)` per
  message, as an application schedules an RQ job for later (a job hash, then a ZADD of its id into
  `rq:scheduler:scheduled_jobs` with the due time as score; rq-scheduler keeps whole seconds);
- the scheduler: `rqscheduler --interval 1`, which every second moves the jobs whose second has
  come into the RQ queue, one job at a time;
- a real RQ worker (`rq worker`, the SimpleWorker class: one process that runs jobs without forking
  per job) running `arrive`, which XADDs the message into the stream the benchmark reads, with the
  fields our redis transport writes: the entry id's milliseconds are its arrival time, as for the
  other systems.
"""
from __future__ import annotations

import datetime
import threading
import time

QUEUE = "default"


def arrive(message_id: str, subject: str, schedule_time: int, body: str) -> None:
    """The job each message is: record its arrival in the stream `subject` (the worker runs it)."""
    from rq import get_current_job

    connection = get_current_job().connection
    connection.xadd(subject, {"id": message_id, "subject": subject, "body": body,
                              "schedule_time": str(schedule_time), "dispatch_time": str(time.time_ns() // 1_000_000),
                              "attempt": "1"})


def due_datetime(schedule_ms: int) -> datetime.datetime:
    """The naive UTC datetime rq-scheduler expects for epoch milliseconds `schedule_ms`."""
    return datetime.datetime.fromtimestamp(schedule_ms / 1000, datetime.UTC).replace(tzinfo=None)


def send(address: str, batches_per_producer: list[list[list[int]]], times: list[int], body: str,
         unacked: list[int]) -> None:
    """Each producer (a thread with its own connection) schedules its messages one `enqueue_at` each."""
    import redis
    from rq_scheduler import Scheduler

    from bench.workload import SUBJECT, message_id

    host, port = address.rsplit(":", 1)
    lock = threading.Lock()

    def producer(batches: list[list[int]]) -> None:
        connection = redis.Redis(host=host, port=int(port), socket_timeout=60)
        scheduler = Scheduler(queue_name=QUEUE, connection=connection)
        try:
            for batch in batches:
                for i in batch:
                    try:
                        scheduler.enqueue_at(due_datetime(times[i]), arrive, message_id(i), SUBJECT, times[i], body,
                                             job_id=message_id(i), job_result_ttl=0)
                    except redis.RedisError:
                        with lock:
                            unacked.append(i)
        finally:
            connection.close()

    threads = [threading.Thread(target=producer, args=(b,)) for b in batches_per_producer]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
