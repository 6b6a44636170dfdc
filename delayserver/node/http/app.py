"""The node's HTTP API and console: a Starlette app over a `NodeOps`, served by hypercorn on trio.

Every JSON answer of /v1 carries `code` (a ResultCode name, as on the binary protocol) and, for
errors, `message`; the HTTP status follows the code (`HTTP_STATUS`). With the node's
`auth_secret` set, /v1 and /metrics want `Authorization: Bearer <secret>`; /healthz, /readyz,
/openapi.json and the console's static files do not (the console asks for the token and sends it).
A request body is read up to `max_body_bytes` and refused with 413 past it, before it is parsed
(the rest of a refused body is read and dropped, up to DRAIN_BYTES, so that the 413 reaches the client).
"""
from __future__ import annotations

import base64
import binascii
import datetime as dt
import functools
import hmac
import json
import logging
from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from delayserver.client import new_message_id
from delayserver.message import MAX_TIME_MS, MIN_TIME_MS, CancelOutcome, Handle, MessageState, ResultCode, TimeSpec
from delayserver.metrics import LATENESS_BUCKETS
from delayserver.node.http.openapi import openapi_document
from delayserver.node.http.ops import NodeOps
from delayserver.protocol import SendItem

log = logging.getLogger("delayserver.http")

HTTP_STATUS = {
    ResultCode.OK: 200,
    ResultCode.BAD_REQUEST: 400,
    ResultCode.MESSAGE_TOO_LARGE: 413,
    ResultCode.BAD_SUBJECT: 422,
    ResultCode.BAD_MESSAGE_ID: 422,
    ResultCode.BAD_SCHEDULE_TIME: 422,
    ResultCode.BAD_HEADERS: 422,
    ResultCode.NOT_MASTER: 421,
    ResultCode.DISK_FULL: 507,
    ResultCode.READ_ONLY: 503,
    ResultCode.BUSY: 503,
    ResultCode.UNAUTHORIZED: 401,
    ResultCode.NOT_FOUND: 404,
    ResultCode.INTERNAL: 500,
    ResultCode.NODE_ID_TAKEN: 409,
    ResultCode.UNAVAILABLE: 503,
    ResultCode.DUPLICATE: 200,
    # transactions
    ResultCode.TXN_NOT_FOUND: 404,
    ResultCode.TXN_RESOLVED: 409,
    ResultCode.NOT_ENOUGH_REPLICAS: 503,
    ResultCode.FENCED: 421,
    ResultCode.DIVERGED: 409,
}
assert set(HTTP_STATUS) == set(ResultCode)

MAX_BATCH = 10_000


class HandleConvertor(Convertor):
    """Anything after /v1/messages/, line breaks too: a message id may hold any character."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("handle", HandleConvertor())
STATIC = resources.files("delayserver.node.http") / "static"


class ApiError(Exception):
    def __init__(self, code: ResultCode, message: str):
        super().__init__(message)
        self.code = code


def _code_name(code: int) -> str:
    return ResultCode(code).name if code in ResultCode._value2member_map_ else str(code)


def error_response(code: ResultCode, message: str, **extra) -> JSONResponse:
    headers = {}
    if code == ResultCode.UNAUTHORIZED:
        headers["WWW-Authenticate"] = 'Bearer realm="delayserver"'
    elif code == ResultCode.BUSY:
        headers["Retry-After"] = "1"
    return JSONResponse({"code": code.name, "message": message, **extra}, HTTP_STATUS[code], headers=headers)


# --- request parsing ----------------------------------------------------------------------------


#: A refused request body is still read and dropped up to this many bytes before the 413 goes out:
#: closing a connection with unread bytes makes the kernel reset it, and the client may then lose
#: the answer before reading it. A declared body larger than this is refused unread.
DRAIN_BYTES = 16 << 20


async def _refuse_oversize(request: Request, limit: int, chunks=None, seen: int = 0):
    declared = request.headers.get("content-length")
    if not (declared is not None and declared.isdigit() and int(declared) > DRAIN_BYTES):
        async for chunk in (chunks if chunks is not None else request.stream()):
            seen += len(chunk)
            if seen > DRAIN_BYTES:
                break
    raise ApiError(ResultCode.MESSAGE_TOO_LARGE, f"request body over {limit} bytes")


async def read_json(request: Request, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        if not declared.isdigit():
            raise ApiError(ResultCode.MESSAGE_TOO_LARGE, f"request body over {limit} bytes")
        await _refuse_oversize(request, limit)
    body = bytearray()
    chunks = request.stream()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            await _refuse_oversize(request, limit, chunks, len(body))
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(ResultCode.BAD_REQUEST, f"the body is not valid JSON: {e}") from None


def _int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(ResultCode.BAD_REQUEST, f"{name}: expected an integer, got {json.dumps(value)[:60]}")
    return value


def _time_spec(obj: dict) -> TimeSpec:
    # A field given as null is given (and refused as the wrong type): the schema allows no null.
    given = [k for k in ("delay_ms", "deliver_at", "delay_level") if k in obj]
    if len(given) > 1:
        raise ApiError(ResultCode.BAD_REQUEST, f"give one of delay_ms, deliver_at, delay_level, not {given}")
    if not given:
        return TimeSpec.delay(0)
    key = given[0]
    value = obj[key]
    if key == "deliver_at" and isinstance(value, str):
        try:
            when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ApiError(ResultCode.BAD_SCHEDULE_TIME, f"deliver_at: not an ISO 8601 time: {value[:60]!r}") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        return TimeSpec.at(int(when.timestamp() * 1000))
    value = _int(value, key)
    if key == "delay_ms":
        if value < 0:
            raise ApiError(ResultCode.BAD_SCHEDULE_TIME, f"delay_ms must not be negative, got {value}")
        return TimeSpec.delay(min(value, MAX_TIME_MS))
    if key == "deliver_at":
        if not MIN_TIME_MS <= value <= MAX_TIME_MS:
            raise ApiError(ResultCode.BAD_SCHEDULE_TIME, f"deliver_at {value} is outside {MIN_TIME_MS}..{MAX_TIME_MS}")
        return TimeSpec.at(value)
    if not 0 < value < 1 << 31:
        raise ApiError(ResultCode.BAD_SCHEDULE_TIME, f"delay_level out of range: {value}")
    return TimeSpec.level(value)


def send_item(obj) -> SendItem:
    """A SendItem from one message object; ApiError names the field at fault."""
    if not isinstance(obj, dict):
        raise ApiError(ResultCode.BAD_REQUEST, "a message must be a JSON object")
    unknown = set(obj) - {"subject", "body", "body_base64", "delay_ms", "deliver_at", "delay_level", "id", "headers"}
    if unknown:
        raise ApiError(ResultCode.BAD_REQUEST, f"unknown field {sorted(unknown)[0]!r}")
    subject = obj.get("subject")
    if not isinstance(subject, str):
        raise ApiError(ResultCode.BAD_REQUEST, "subject: required, a string")
    if "body" in obj and "body_base64" in obj:
        raise ApiError(ResultCode.BAD_REQUEST, "give body (text) or body_base64, not both")
    if "body_base64" in obj:
        if not isinstance(obj["body_base64"], str):
            raise ApiError(ResultCode.BAD_REQUEST, "body_base64: expected a base64 string")
        try:
            body = base64.b64decode(obj["body_base64"], validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(ResultCode.BAD_REQUEST, "body_base64: not valid base64") from None
    else:
        text = obj.get("body", "")
        if not isinstance(text, str):
            raise ApiError(ResultCode.BAD_REQUEST, "body: expected a string (or use body_base64)")
        body = text.encode("utf-8", "surrogatepass")
    message_id = obj.get("id")
    if "id" not in obj:
        message_id = new_message_id()
    elif not isinstance(message_id, str):
        raise ApiError(ResultCode.BAD_REQUEST, "id: expected a string")
    headers = obj.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ApiError(ResultCode.BAD_REQUEST, "headers: expected an object of strings")
    return SendItem(message_id, subject, _time_spec(obj), body, headers)


def parse_handle(text: str) -> Handle:
    """The handle in a URL path, `<schedule_time>:<id>`, once the server has percent-decoded the
    path: so the id is raw here (a handle printed as `1795449600000:order%2F42` names `order/42`)."""
    time_text, sep, message_id = text.partition(":")
    if not sep or not time_text.isdigit() or not message_id:
        raise ApiError(ResultCode.BAD_REQUEST, f"not a handle (want <epoch ms>:<id>): {text[:80]!r}")
    schedule_time = int(time_text)
    if not MIN_TIME_MS <= schedule_time <= MAX_TIME_MS or not 1 <= len(message_id.encode("utf-8", "replace")) <= 128:
        raise ApiError(ResultCode.BAD_REQUEST, f"not a handle (time or id out of range): {text[:80]!r}")
    return Handle(schedule_time, message_id)


def _send_json(result) -> dict:
    out = {"code": _code_name(result.code), "message": result.message, "id": result.message_id}
    if result.code in (ResultCode.OK, ResultCode.DUPLICATE):
        out["handle"] = str(Handle(result.schedule_time, result.message_id))
        out["schedule_time"] = result.schedule_time
    return out


# --- the app ------------------------------------------------------------------------------------


def create_app(ops: NodeOps, *, secret: str = "", metrics=None, backlog=None, max_body_bytes: int = 8 << 20,
               clock=None) -> Starlette:
    """The ASGI app; `metrics` a NodeMetrics, `backlog` a Backlog (both optional)."""
    token = secret.encode("utf-8")

    def authorized(request: Request) -> bool:
        if not token:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "replace"), token)

    def api(handler):
        @functools.wraps(handler)
        async def endpoint(request: Request):
            if not authorized(request):
                return error_response(ResultCode.UNAUTHORIZED, "send Authorization: Bearer <the node's secret>")
            try:
                return await handler(request)
            except ApiError as e:
                return error_response(e.code, str(e))
            except Exception:
                log.exception("HTTP %s %s failed", request.method, request.url.path)
                return error_response(ResultCode.INTERNAL, "internal error (logged)")
        return endpoint

    async def send_one(request: Request):
        item = send_item(await read_json(request, max_body_bytes))
        [result] = await ops.send([item])
        if result.code not in (ResultCode.OK, ResultCode.DUPLICATE):
            return error_response(ResultCode(result.code), result.message, id=result.message_id)
        return JSONResponse(_send_json(result))

    async def send_batch(request: Request):
        body = await read_json(request, max_body_bytes)
        if isinstance(body, dict) and set(body) - {"messages"}:
            raise ApiError(ResultCode.BAD_REQUEST, f"unknown field {sorted(set(body) - {'messages'})[0]!r}")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ApiError(ResultCode.BAD_REQUEST, 'expected {"messages": [...]} with at least one message')
        if len(messages) > MAX_BATCH:
            raise ApiError(ResultCode.BAD_REQUEST, f"at most {MAX_BATCH} messages per batch, got {len(messages)}")
        # A malformed message (a missing field, a wrong type) refuses the whole batch: nothing is
        # stored. A well-formed message the node refuses (subject, id, time, size) gets its own code.
        results: list = [None] * len(messages)
        items, where = [], []
        for i, obj in enumerate(messages):
            try:
                items.append(send_item(obj))
                where.append(i)
            except ApiError as e:
                if e.code == ResultCode.BAD_REQUEST:
                    raise ApiError(e.code, f"messages[{i}]: {e}") from None
                results[i] = {"code": e.code.name, "message": str(e), "id": obj.get("id") or ""}
        for i, result in zip(where, await ops.send(items) if items else []):
            results[i] = _send_json(result)
        failed = sum(1 for r in results if r["code"] not in ("OK", "DUPLICATE"))
        return JSONResponse({"code": "OK", "accepted": len(results) - failed, "refused": failed, "results": results})

    async def status(request: Request):
        handle = parse_handle(request.path_params["handle"])
        result = await ops.status(handle)
        if result.code != ResultCode.OK:
            return error_response(ResultCode(result.code), result.message)
        state = MessageState(result.state).name.lower()
        body = {"code": "OK", "handle": str(handle), "id": handle.message_id, "schedule_time": handle.schedule_time,
                "state": state, "dispatch_time": result.dispatch_time or None,
                "broker_group": result.broker_group or None}
        if result.state == MessageState.UNKNOWN:
            return JSONResponse({**body, "code": "NOT_FOUND", "message": "no such message"}, 404)
        return JSONResponse(body)

    async def cancel(request: Request):
        handle = parse_handle(request.path_params["handle"])
        result = await ops.cancel(handle)
        if result.code != ResultCode.OK:
            return error_response(ResultCode(result.code), result.message)
        outcome = CancelOutcome(result.outcome).name.lower()
        body = {"code": "OK", "handle": str(handle), "outcome": outcome, "message": result.message}
        if result.outcome == CancelOutcome.UNKNOWN:
            return JSONResponse({**body, "code": "NOT_FOUND"}, 404)
        return JSONResponse(body)

    async def node(request: Request):
        return JSONResponse({"code": "OK", **ops.node()})

    async def group_nodes(request: Request):
        return JSONResponse({"code": "OK", "nodes": await ops.group_nodes()})

    async def broker_groups(request: Request):
        return JSONResponse({"code": "OK", "broker_groups": ops.broker_groups()})

    async def buckets(request: Request):
        if backlog is None:
            return JSONResponse({"code": "OK", "buckets": []})
        await backlog.fresh()
        return JSONResponse({"code": "OK", "buckets": backlog.rows()})

    async def buckets_history(request: Request):
        samples = [] if backlog is None else [{"time": t, "pending": p} for t, p in backlog.history]
        return JSONResponse({"code": "OK", "samples": samples})

    async def parked(request: Request):
        flags = request.query_params.getlist("all")
        if len(flags) > 1 or any(f not in ("true", "false") for f in flags):
            raise ApiError(ResultCode.BAD_REQUEST, "all: expected true or false")
        include = flags == ["true"]
        return JSONResponse({"code": "OK", "parked": ops.parked(include)})

    async def redrive(request: Request):
        result = await ops.redrive()
        if "error" in result:
            err = result["error"]
            return error_response(ResultCode(err["code"]), err["message"], redriven=result["redriven"],
                                  remaining=result["remaining"])
        return JSONResponse({"code": "OK", **result})

    async def overview(request: Request):
        out = {"code": "OK", "node": ops.node(), "delivery": ops.delivery(), "broker_groups": ops.broker_groups()}
        now = clock.now_ms() if clock is not None else int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)
        out["now"] = now
        if backlog is not None:
            await backlog.fresh()
            out.update(pending=backlog.total_pending(), due_next_minute=backlog.due_before(now + 60_000),
                       due_next_hour=backlog.due_before(now + 3_600_000))
        if metrics is not None:
            recent = metrics.recent_lateness
            counts = recent.counts(300)
            out["lateness"] = {"window_s": 300, "bounds_ms": [b * 1000 for b in LATENESS_BUCKETS], "counts": counts}
            out["delivery_rate_per_s"] = round(sum(recent.counts(60)) / 60, 2)
        return JSONResponse(out)

    async def prometheus(request: Request):
        if not authorized(request):
            return error_response(ResultCode.UNAUTHORIZED, "send Authorization: Bearer <the node's secret>")
        if metrics is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request):
        problems = ops.health_problems()
        return JSONResponse({"status": "unhealthy" if problems else "ok", "problems": problems},
                            503 if problems else 200)

    async def readyz(request: Request):
        problems = ops.readiness_problems()
        return JSONResponse({"status": "not ready" if problems else "ready", "problems": problems},
                            503 if problems else 200)

    document = openapi_document()

    async def openapi(request: Request):
        return JSONResponse(document)

    async def console(request: Request):
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    async def not_found(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return error_response(ResultCode.NOT_FOUND, f"no such path: {request.url.path}")
        return JSONResponse({"code": "BAD_REQUEST", "message": exc.detail}, exc.status_code)

    routes = [
        Route("/", console),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/openapi.json", openapi),
        Route("/metrics", prometheus),
        Route("/v1/messages", api(send_one), methods=["POST"]),
        Route("/v1/messages/batch", api(send_batch), methods=["POST"]),
        Route("/v1/messages/{handle:handle}", api(status), methods=["GET"]),
        Route("/v1/messages/{handle:handle}", api(cancel), methods=["DELETE"]),
        Route("/v1/node", api(node)),
        Route("/v1/nodes", api(group_nodes)),
        Route("/v1/broker-groups", api(broker_groups)),
        Route("/v1/buckets", api(buckets)),
        Route("/v1/buckets/history", api(buckets_history)),
        Route("/v1/parked", api(parked)),
        Route("/v1/parked/redrive", api(redrive), methods=["POST"]),
        Route("/v1/overview", api(overview)),
        Mount("/console", StaticFiles(directory=str(STATIC)), name="console"),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def metrics_app(metrics) -> Starlette:
    """The app of `metrics_listen`: /metrics alone, open as it always was (bind it where only the
    scraper reaches it; /metrics of the API port wants the token)."""

    async def prometheus(request: Request):
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: HTTPException):
        return Response("not found: try /metrics\n", exc.status_code, media_type="text/plain")

    return Starlette(routes=[Route("/metrics", prometheus)], exception_handlers={HTTPException: not_found})
