"""Compiled kernels of the hot path (Cython, built by `pip install`; see setup.py).

Each kernel has a Python reference in the module that owns what it computes, and the caller
falls back to that reference when the kernel is not built (no C compiler at install) or hands
back None for input it leaves to the reference. tests/test_native.py holds each kernel to its
reference, output for output.

- `replay.walk`: the replayer's pass over message_log records (`delayserver.replayer.walk`);
- `send.decode_rows`: a SEND request's items (`delayserver.protocol._decode_send_request_py`).
"""
