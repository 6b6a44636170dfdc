"""Fuzz target: the frame decoder (protocol.FrameDecoder) and every payload decoder behind it.

Whatever the bytes, and however they are cut into reads, the decoder gives frames or raises
RemoteProtocolError (and then raises it again on every call); each frame's payload decodes or
raises RemoteProtocolError: never another exception, never a buffer beyond what was fed.

    python -m tests.fuzz frames -max_total_time=600 /tmp/frames-corpus tests/fuzz/corpus/frames
"""
from __future__ import annotations

from delayserver import protocol as p

MAX_FRAME_BYTES = 2048

_DECODERS = {
    p.Command.SEND: (p.decode_send_request, p.decode_send_response),
    p.Command.CANCEL: (p.decode_handle, p.decode_cancel_response),
    p.Command.STATUS: (p.decode_handle, p.decode_status_response),
    p.Command.ERROR: (p.decode_error, p.decode_error),
    p.Command.META: (p.decode_json, p.decode_json),
}


def test_one_input(data: bytes) -> None:
    if not data:
        return
    step, stream = 1 + data[0] % 64, data[1:]
    decoder = p.FrameDecoder(max_frame_bytes=MAX_FRAME_BYTES)
    fed = 0
    for start in range(0, len(stream), step):
        chunk = stream[start : start + step]
        decoder.feed(chunk)
        fed += len(chunk)
        while True:
            try:
                frame = decoder.next_frame()
            except p.RemoteProtocolError as e:
                assert isinstance(e.code, int)
                try:
                    decoder.next_frame()
                except p.RemoteProtocolError:
                    return
                raise AssertionError("a broken decoder must stay broken")
            if frame is p.NEED_DATA:
                break
            assert len(frame.payload) <= MAX_FRAME_BYTES
            again = p.FrameDecoder(max_frame_bytes=MAX_FRAME_BYTES)
            again.feed(p.encode(frame, MAX_FRAME_BYTES))
            assert again.next_frame() == frame and again.buffered_bytes == 0
            decoders = _DECODERS.get(frame.command)
            if decoders is not None:
                try:
                    decoders[frame.is_response](frame.payload)
                except p.RemoteProtocolError:
                    pass
        assert decoder.buffered_bytes <= fed
