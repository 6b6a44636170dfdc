"""The webhook transport: one HTTP POST per batch.

Request: ``POST <address>`` with ``Content-Type: application/json``, the static `headers` option
added, and this body::

    {"messages": [{"id": str, "subject": str, "body": base64 str, "headers": {str: str},
                   "schedule_time": epoch ms, "dispatch_time": epoch ms, "attempt": int}]}

Response:

- 2xx with a JSON object holding ``"results": [{"id": str, "status": "ok"|"retry"|"rejected",
  "detail": str}]``: per-message results, matched by id. A message without a result, or with an
  unknown status, is RETRY; a "results" that is not a list of such objects makes the whole batch RETRY.
- 2xx with any other body: every message ACKED.
- 4xx other than 408 and 429: every message REJECTED.
- Anything else (5xx, 408, 429, 1xx, 3xx: redirects are not followed), a connection error, or no
  whole response within `timeout_ms` (default 5000, covering the whole request): every message RETRY.
"""
from __future__ import annotations

import base64
import json
import logging
import urllib.parse
from typing import Any, Mapping, Sequence

import attrs
import httpx
import trio

from delayserver.sender.transport import ACKED, DeliveryResult, OutboundMessage, Outcome, Transport, check_option_names, int_option

log = logging.getLogger("delayserver.sender.http")

DEFAULT_TIMEOUT_MS = 5000
_RETRYABLE_4XX = frozenset({408, 429})
_STATUSES = {"ok": Outcome.ACKED, "retry": Outcome.RETRY, "rejected": Outcome.REJECTED}


def request_body(messages: Sequence[OutboundMessage]) -> bytes:
    """The JSON document POSTed for `messages` (see the module docstring)."""
    return json.dumps(
        {
            "messages": [
                {
                    "id": m.message_id,
                    "subject": m.subject,
                    "body": base64.b64encode(m.body).decode("ascii"),
                    "headers": dict(m.headers),
                    "schedule_time": m.schedule_time,
                    "dispatch_time": m.dispatch_time,
                    "attempt": m.attempt,
                }
                for m in messages
            ]
        }
    ).encode("utf-8")


def results_of(response_status: int, response_body: bytes, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
    """The per-message results a webhook response means (see the module docstring)."""
    if not 200 <= response_status < 300:
        detail = f"HTTP {response_status}: {response_body[:200].decode('utf-8', 'replace')}"
        rejected = 400 <= response_status < 500 and response_status not in _RETRYABLE_4XX
        return [DeliveryResult(Outcome.REJECTED if rejected else Outcome.RETRY, detail)] * len(messages)
    try:
        document = json.loads(response_body)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return [ACKED] * len(messages)
    if not isinstance(document, dict) or "results" not in document:
        return [ACKED] * len(messages)
    by_id = _results_by_id(document["results"])
    if by_id is None:
        return [DeliveryResult(Outcome.RETRY, "malformed 'results' in the webhook response")] * len(messages)
    return [by_id.get(m.message_id, DeliveryResult(Outcome.RETRY, "no result for this message")) for m in messages]


def _results_by_id(results: Any) -> dict[str, DeliveryResult] | None:
    """The results keyed by message id, or None when `results` is not a list of result objects."""
    if not isinstance(results, list):
        return None
    by_id = {}
    for item in results:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            return None
        detail = str(item.get("detail", ""))
        status = item.get("status")
        outcome = _STATUSES.get(status) if isinstance(status, str) else None
        if outcome is None:
            by_id[item["id"]] = DeliveryResult(Outcome.RETRY, f"unknown status {status!r}")
        else:
            by_id[item["id"]] = DeliveryResult(outcome, detail)
    return by_id


def _check_headers(headers: Any) -> dict[str, str]:
    if not isinstance(headers, Mapping) or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in headers.items()):
        raise ValueError(f"http transport: option 'headers' must map header names to strings, got {headers!r}")
    return dict(headers)


def _check_url(address: Any) -> str:
    parts = urllib.parse.urlsplit(address) if isinstance(address, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"http transport: address must be an http:// or https:// URL, got {address!r}")
    return address


@attrs.define(eq=False)
class HttpTransport(Transport):
    """POSTs each batch to the webhook at `url`."""

    url: str
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    headers: Mapping[str, str] = attrs.field(factory=dict)
    _client: httpx.AsyncClient = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # The trio deadline in send_batch bounds the whole request; httpx's own timeouts would only
        # bound each phase.
        self._client = httpx.AsyncClient(headers=self.headers, timeout=None, follow_redirects=False)

    @classmethod
    def from_config(cls, address: str, options: Mapping[str, Any]) -> HttpTransport:
        """Raises ValueError naming the address or the option that is wrong."""
        check_option_names("http", options, {"timeout_ms", "headers"})
        return cls(
            url=_check_url(address),
            timeout_ms=int_option("http", options, "timeout_ms", DEFAULT_TIMEOUT_MS),
            headers=_check_headers(options.get("headers", {})),
        )

    @property
    def name(self) -> str:
        parts = urllib.parse.urlsplit(self.url)
        # Only scheme, host and path: the query or user part may hold a secret.
        return f"http {parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"

    async def send_batch(self, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
        if not messages:
            return []
        failure = f"{self.name}: no response within {self.timeout_ms} ms"
        with trio.move_on_after(self.timeout_ms / 1000):
            try:
                response = await self._client.post(
                    self.url, content=request_body(messages), headers={"Content-Type": "application/json"}
                )
                return results_of(response.status_code, response.content, messages)
            except httpx.HTTPError as e:
                failure = f"{self.name}: {type(e).__name__}: {e}"
        log.warning("batch of %d failed, will retry: %s", len(messages), failure)
        return [DeliveryResult(Outcome.RETRY, failure)] * len(messages)

    async def aclose(self) -> None:
        await self._client.aclose()
