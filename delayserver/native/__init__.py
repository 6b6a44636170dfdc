"""Compiled kernels of the hot path (Cython, built by `pip install`; see setup.py).

Each kernel has a Python reference in the module that owns what it computes, and the caller
falls back to that reference when the kernel is not built (no C compiler at install) or hands
back None for input it leaves to the reference. tests/test_native.py holds each kernel to its
reference, output for output.

- `records.walk`: the replayer's pass over message_log records (`delayserver.replayer.walk`);
- `records.sequence_framed`: the sequences and checksums of a request's records at append, framed
  by `admit` for a send, by `record.frame_records` for any other request
  (`delayserver.storage.record._sequence_framed_py`);
- `records.decode_scheduled`: a SCHEDULED payload decoded into its message_log offset and message
  (`delayserver.storage.record._decode_scheduled_py`);
- `send.decode_rows`: a SEND request's items (`delayserver.protocol._decode_send_request_py`);
- `send.encode_results`: a SEND response (`delayserver.protocol._encode_send_response_py`);
- `send.encode_items`, `send.decode_results`: a producer's SEND request and its response
  (`delayserver.protocol._encode_send_request_py`, `_decode_send_response_py`);
- `resp.xadd_commands`: the Redis transport's XADD commands of a batch
  (`delayserver.sender.redis_streams._xadd_commands_py`);
- `records.id_keys`, `records.time_keys`: the id and time index keys of a replayed append, in an
  array "Q" (`delayserver.storage.id_index._id_keys`, `delayserver.storage.time_index._time_keys`);
- `dedupe.remember_many`: the dedupe table's bookkeeping of a request's accepted ids, its keys' saved
  hashes taken in C (libxxhash)
  (`delayserver.dedupe.DedupeTable._remember_many_py`);
- `idmap.IdMap`: the dedupe table's map of ids to positions, probed from C by `remember_many`
  and `admit` (the dict of `delayserver.dedupe._positions_dict`);
- `receive.admit`: the receiver's pass over a request's messages (`delayserver.node.receiver._admit`);
- `receive.mark_committing`, `unmark_committing`, `stored_results`: the
  receiver's passes over a stored request's accepted messages
  (`delayserver.node.receiver._mark_committing` and the two after it);
- `wheel.dispatch_fields`, `records.dispatch_data`: the sender's pass over an acknowledged batch
  and its DISPATCH records in one piece (`delayserver.sender.sender._dispatch_fields_py`,
  `delayserver.storage.record._encode_dispatch_data_py`);
- `wheel.add_entries`: the timing wheel's adds of a bucket's replayed records
  (`delayserver.wheel.timingwheel.TimingWheel._add_entries_py`).
- `wheel.add`: the timing wheel's add of one entry, as a bucket loading adds its records
  (`delayserver.wheel.timingwheel.TimingWheel._add_py`).

The crc32c of the records kernels is crc32c.h: SSE4.2 when the processor has it (checked at
import), in three streams joined by table shifts over a buffer of three short parts (96 bytes) or
more, else a table; the same values as the crc32c package, which the rest of the code uses
(`records.crc32c_each_way` gives each way's, for the tests).
"""
