"""What both ends of the meta protocol agree on: the default port, frame limits, addresses.

Requests are META frames carrying a JSON object ``{"op": ..., ...arguments}`` and answered by a
META response ``{"code": ResultCode, "message": ..., ...results}`` (the operations are in
`service`). Addresses are ``HOST:PORT``, an IPv6 host in brackets (`message.parse_address`).
"""
from __future__ import annotations

#: The meta server's default port (the delay server's is 20801).
DEFAULT_META_PORT = 20800
#: Meta requests are small JSON documents; nothing near this size is legitimate.
MAX_REQUEST_BYTES = 1024 * 1024
#: Responses (a listing of a large cluster) may be bigger than requests.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
