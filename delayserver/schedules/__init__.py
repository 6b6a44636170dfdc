"""Recurring schedules: named rules (cron with a time zone, or ``@every <duration>``) that produce
ordinary delayed messages, one per occurrence.

- `rules`: a rule's next occurrence after a time (croniter for cron, arithmetic for @every).
- `spec`: what a schedule is (name, subject, body, headers, rule, time zone, start, end, count,
  catch-up policy) and its checks.
- `registry`: the schedules of a node, followed from message_log (SCHEDULE records and the
  occurrence messages), saved beside the checkpoints and rebuilt at start.
- `emitter`: which occurrences to send now (pure), and the master's task that sends them.
- `service`: the requests (put, pause, resume, delete, list) a node answers.
"""
