"""What both ends of the meta protocol agree on: the default port, frame limits, addresses.

Requests are META frames carrying a JSON object ``{"op": ..., ...arguments}`` and answered by a
META response ``{"code": ResultCode, "message": ..., ...results}`` (the operations are in
`service`). Addresses are ``HOST:PORT``, an IPv6 host in brackets (`message.parse_address`).
"""
from __future__ import annotations

from delayserver.message import parse_address

#: The meta server's default port (the delay server's is 20801).
DEFAULT_META_PORT = 20800
#: Meta requests are small JSON documents; nothing near this size is legitimate.
MAX_REQUEST_BYTES = 1024 * 1024
#: Responses (a listing of a large cluster) may be bigger than requests.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024


def parse_address_list(text: str | list | tuple) -> list[str]:
    """The addresses of ``A,B,C`` (or a list of them), each checked by `parse_address`.

    Raises ValueError for an empty list, a bad address or one named twice.
    """
    items = text.split(",") if isinstance(text, str) else list(text)
    addresses = [item.strip() for item in items if isinstance(item, str) and item.strip()]
    if not addresses or len(addresses) != len(items):
        raise ValueError(f"want HOST:PORT[,HOST:PORT...], not {text!r}")
    for address in addresses:
        parse_address(address)
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"an address is named twice in {text!r}")
    return addresses
