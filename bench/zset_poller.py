"""The poller of the sorted-set delay queue that `ops/bench compare` measures us against.

This is the pattern behind rq-scheduler, RQ's built-in scheduler and Sidekiq: producers ZADD each
message into one sorted set with its due time (epoch ms) as score, and a poller moves what is due
into the queue the consumers read, here a Redis stream in the same redis-server. One move is a Lua
script, so it is atomic (taking due members, XADDing them with the fields our redis transport
writes, and ZREMing them happen together or not at all):

    ZRANGEBYSCORE schedule -inf now LIMIT 0 limit -> XADD each to the stream -> ZREM them

The poller runs the script again at once while it moves a full `limit`, and otherwise sleeps
`poll_ms` (RQ's scheduler sleeps 1 s between passes; Sidekiq polls about every 5 s; rq-scheduler
every 60 s). A Redis that is down or restarting is retried at the next poll, as those pollers do.

    python -m bench.zset_poller HOST:PORT SCHEDULE_KEY STREAM POLL_MS LIMIT
"""
from __future__ import annotations

import sys
import time

import redis

MOVE_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, member in ipairs(due) do
  local m = cjson.decode(member)
  redis.call('XADD', KEYS[2], '*', 'id', m.id, 'subject', m.subject, 'body', m.body,
             'schedule_time', m.schedule_time, 'dispatch_time', ARGV[1], 'attempt', '1')
end
if #due > 0 then
  redis.call('ZREM', KEYS[1], unpack(due))
end
return #due
"""


def poll_forever(client: redis.Redis, key: str, stream: str, poll_ms: int, limit: int) -> None:
    move_due = client.register_script(MOVE_DUE)
    while True:
        try:
            moved = move_due(keys=[key, stream], args=[time.time_ns() // 1_000_000, limit])
        except redis.RedisError:
            moved = 0
        if moved < limit:
            time.sleep(poll_ms / 1000)


def main(argv: list[str]) -> None:
    address, key, stream, poll_ms, limit = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    host, port = address.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port), socket_timeout=5, socket_connect_timeout=1)
    poll_forever(client, key, stream, poll_ms, limit)


if __name__ == "__main__":
    main(sys.argv[1:])
