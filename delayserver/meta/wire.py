"""What both ends of the meta protocol agree on: the default port, frame limits, addresses.

Requests are META frames carrying a JSON object ``{"op": ..., ...arguments}`` and answered by a
META response ``{"code": ResultCode, "message": ..., ...results}`` (the operations are in
`service`). Addresses are ``HOST:PORT``, an IPv6 host in brackets.
"""
from __future__ import annotations

#: The meta server's default port (the delay server's is 20801).
DEFAULT_META_PORT = 20800
#: Meta requests are small JSON documents; nothing near this size is legitimate.
MAX_REQUEST_BYTES = 1024 * 1024
#: Responses (a listing of a large cluster) may be bigger than requests.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024


def parse_address(text: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` or ``[IPv6]:PORT``.

    Raises ValueError for anything else, or a port outside 1..65535 (0..65535 with
    `allow_port_zero`, for a listener that lets the system pick).
    """
    if not isinstance(text, str):
        raise ValueError(f"an address must be a str, not {type(text).__name__}")
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"bad address {text!r}: write an IPv6 host in brackets, [::1]:{DEFAULT_META_PORT}")
    if not sep or not host or not port_text.isascii() or not port_text.isdigit():
        raise ValueError(f"bad address {text!r}: want HOST:PORT")
    port = int(port_text)
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ValueError(f"bad address {text!r}: port {port} is out of range")
    return host, port


def format_address(host: str, port: int) -> str:
    """The text `parse_address` reads back as (host, port)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
