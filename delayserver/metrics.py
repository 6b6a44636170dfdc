"""Metrics in Prometheus text format, served over plain HTTP at /metrics.

    curl -s 127.0.0.1:20802/metrics
"""
from __future__ import annotations

import logging

import trio

from delayserver.storage.segment import storage_failures

log = logging.getLogger("delayserver.metrics")


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an already sorted list (0 when empty)."""
    if not sorted_values:
        return 0
    rank = max(0, min(len(sorted_values) - 1, int(round(q * len(sorted_values) + 0.5)) - 1))
    return sorted_values[rank]


def collect(server) -> dict[str, float]:
    ticks, receiver, replayer = server.ticks, server.receiver, server.replayer
    values = {
        "delayserver_received_total": receiver.appended,
        "delayserver_commit_batches_total": receiver.batches,
        "delayserver_read_only": int(bool(receiver.read_only_reason)),
        "delayserver_message_log_end_offset": server.store.message_log.end_offset,
        "delayserver_message_log_durable_offset": receiver.durable_offset,
        "delayserver_replay_offset": replayer.offset,
        "delayserver_replay_checkpoint_offset": replayer.checkpointed_offset,
        "delayserver_replayed_total": replayer.replayed,
        "delayserver_wheel_entries": len(ticks.wheel),
        "delayserver_fired_total": ticks.fired,
        "delayserver_cancelled_dropped_total": ticks.cancelled_drops,
        "delayserver_loading_cursor_bucket": ticks.loading_bucket or 0,
        "delayserver_loading_cursor_end_offset": ticks.loading_end,
        "delayserver_loaded_cursor_offset": ticks.loaded_offset,
        "delayserver_connections": server.connections,
        "delayserver_storage_failures": len(storage_failures(server.store.root)),
        "delayserver_quarantined_buckets": len(server.store.quarantined()),
    }
    values.update(server.sender.metrics())
    lateness = sorted(server.sender.lateness_ms)
    for q in (0.5, 0.9, 0.99, 0.999):
        values[f'delayserver_lateness_ms{{quantile="{q}"}}'] = percentile(lateness, q)
    return values


def render(values: dict[str, float]) -> str:
    lines, typed = [], set()
    for name, value in values.items():
        base = name.split("{", 1)[0]
        if base not in typed:
            typed.add(base)
            kind = "counter" if base.endswith("_total") else ("summary" if "quantile" in name else "gauge")
            lines.append(f"# TYPE {base} {kind}")
        lines.append(f"{name} {value}")
    return "\n".join(lines) + "\n"


async def serve_metrics(server, host: str, port: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(5):
                request = b""
                while b"\r\n\r\n" not in request and len(request) < 8192:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    request += chunk
                path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
                if path == b"/metrics":
                    body, status = render(collect(server)).encode(), b"200 OK"
                else:
                    body, status = b"not found: try /metrics\n", b"404 Not Found"
                await stream.send_all(b"HTTP/1.0 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    await trio.serve_tcp(handle, port, host=host, task_status=task_status)
