"""Transactional (half) messages, as RocketMQ has them: PREPARE stores a message the producer has
not committed yet; COMMIT schedules it, ROLLBACK drops it; a checker on the master asks the
producer group about half messages left unresolved, and parks those it never gets an answer for.

- `state`: the half messages of a node, rebuilt by replay from message_log and checkpointed with it;
- `sessions`: producer connections by producer group, and the CHECK requests sent over them;
- `operations`: prepare, commit, rollback, check and park, each a record through the receiver;
- `checker`: the master's check-back loop.
"""
