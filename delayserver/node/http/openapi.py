"""The OpenAPI 3.0 document of the HTTP API, served at /openapi.json."""
from __future__ import annotations

from delayserver.message import ResultCode

CODES = [c.name for c in ResultCode]
SUBJECT_PATTERN = r"^[A-Za-z0-9._:%|-]+$"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERROR_TEXT = {
    400: "BAD_REQUEST: malformed JSON, a missing or mistyped field, a bad handle",
    401: "UNAUTHORIZED: no bearer token or a wrong one",
    404: "NOT_FOUND",
    413: "MESSAGE_TOO_LARGE: body over the limit",
    421: "NOT_MASTER: this node is not its delay group's master",
    422: "BAD_SUBJECT, BAD_MESSAGE_ID, BAD_SCHEDULE_TIME or BAD_HEADERS",
    500: "INTERNAL: a server fault (logged)",
    503: "READ_ONLY or BUSY (Retry-After)",
    507: "DISK_FULL: nothing was stored",
}


def _errors(*statuses: int) -> dict:
    return {str(s): _json(_ref("Error"), _ERROR_TEXT[s]) for s in statuses}


_COMMON = (401, 500)
_WRITE = (400, 401, 413, 421, 422, 500, 503, 507)


def _op(summary: str, ok: dict, *errors: int, **extra) -> dict:
    return {"summary": summary, "responses": {"200": ok, **_errors(*sorted(set(errors) | set(_COMMON)))}, **extra}


_HANDLE = {"name": "handle", "in": "path", "required": True,
           "description": "The message's handle, `<schedule_time>:<id>` as send returned it (percent-encoded id)",
           "schema": {"type": "string", "pattern": "^[0-9]{1,15}:.+$"}}

SCHEMAS = {
    "Error": {"type": "object", "required": ["code", "message"],
              "properties": {"code": {"type": "string", "enum": CODES}, "message": {"type": "string"}}},
    "Message": {
        "type": "object", "required": ["subject"], "additionalProperties": False,
        "description": "One message. At most one of delay_ms, deliver_at, delay_level (none: at once); body or "
                       "body_base64. The node checks the values (subject, id, time, size) and answers a refusal "
                       "with its code: BAD_SUBJECT, BAD_MESSAGE_ID, BAD_SCHEDULE_TIME, MESSAGE_TOO_LARGE, BAD_HEADERS.",
        "properties": {
            "subject": {"type": "string", "description": f"1-255 bytes matching {SUBJECT_PATTERN}"},
            "body": {"type": "string", "description": "The body as text (stored as UTF-8)"},
            "body_base64": {"type": "string", "format": "byte", "description": "The body, base64 (instead of body)"},
            "delay_ms": {"type": "integer", "description": "milliseconds from now, not negative"},
            "deliver_at": {"oneOf": [{"type": "integer"}, {"type": "string"}],
                           "description": "Epoch milliseconds (UTC) or an ISO 8601 time"},
            "delay_level": {"type": "integer", "description": "RocketMQ-style level, from 1 (1s)"},
            "id": {"type": "string", "description": "1-128 bytes of UTF-8; generated (time-ordered) when absent"},
            "headers": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    },
    "SendResult": {
        "type": "object", "required": ["code", "message", "id"],
        "properties": {"code": {"type": "string", "enum": CODES}, "message": {"type": "string"},
                       "id": {"type": "string"}, "handle": {"type": "string"},
                       "schedule_time": {"type": "integer"}},
    },
    "Batch": {"type": "object", "required": ["messages"], "additionalProperties": False,
              "properties": {"messages": {"type": "array", "minItems": 1, "maxItems": 10000,
                                          "items": _ref("Message")}}},
    "BatchResult": {"type": "object", "required": ["code", "accepted", "refused", "results"],
                    "properties": {"code": {"type": "string", "enum": ["OK"]},
                                   "accepted": {"type": "integer"}, "refused": {"type": "integer"},
                                   "results": {"type": "array", "items": _ref("SendResult")}}},
    "Status": {
        "type": "object", "required": ["code", "handle", "state"],
        "properties": {"code": {"type": "string", "enum": ["OK", "NOT_FOUND"]}, "handle": {"type": "string"},
                       "id": {"type": "string"}, "schedule_time": {"type": "integer"},
                       "state": {"type": "string", "enum": ["pending", "delivered", "cancelled", "unknown"]},
                       "dispatch_time": {"type": "integer", "nullable": True},
                       "broker_group": {"type": "string", "nullable": True}},
    },
    "Cancel": {
        "type": "object", "required": ["code", "handle", "outcome"],
        "properties": {"code": {"type": "string", "enum": ["OK", "NOT_FOUND"]}, "handle": {"type": "string"},
                       "message": {"type": "string"},
                       "outcome": {"type": "string",
                                   "enum": ["cancelled", "already_cancelled", "already_delivered", "unknown"]}},
    },
    "Node": {
        "type": "object", "required": ["code", "node_id", "group", "role"],
        "properties": {"code": {"type": "string"}, "node_id": {"type": "string"}, "group": {"type": "string"},
                       "role": {"type": "string", "enum": ["master", "slave", "none"]},
                       "epoch": {"type": "integer"}, "master": {"type": "string"}, "meta": {"type": "string"},
                       "read_only": {"type": "boolean"}, "disk_full": {"type": "boolean"},
                       "may_deliver": {"type": "boolean"}, "message_log": {"type": "object"},
                       "loading_cursor": {"type": "object"},
                       "replication": {"type": "object", "properties": {
                           "mode": {"type": "string", "enum": ["async", "sync"]},
                           "sync": {"type": "object", "properties": {
                               "accepting_writes": {"type": "boolean"}, "in_sync_slaves": {"type": "integer"},
                               "min_insync_replicas": {"type": "integer"}, "timeouts": {"type": "integer"}}},
                           "slaves": {"type": "array", "items": {"type": "object", "properties": {
                               "node_id": {"type": "string"}, "offset": {"type": "integer"},
                               "lag_bytes": {"type": "integer"}, "pinning": {"type": "boolean"}}}},
                           "from_master": {"type": "object"}}}},
    },
    "GroupNodes": {"type": "object", "required": ["code", "nodes"],
                   "properties": {"code": {"type": "string"}, "nodes": {"type": "array", "items": {
                       "type": "object", "required": ["node_id", "role"],
                       "properties": {"node_id": {"type": "string"}, "role": {"type": "string"},
                                      "address": {"type": "string"}, "group": {"type": "string"}}}}}},
    "BrokerGroup": {
        "type": "object", "required": ["name", "breaker", "inflight", "delivered"],
        "properties": {"name": {"type": "string"}, "transport": {"type": "string"}, "weight": {"type": "integer"},
                       "subjects": {"type": "array", "items": {"type": "string"}, "nullable": True},
                       "breaker": {"type": "string", "enum": ["closed", "half-open", "open"]},
                       "queued": {"type": "integer"}, "inflight": {"type": "integer"},
                       "delivered": {"type": "integer"}, "retried": {"type": "integer"},
                       "parked": {"type": "integer"}, "failed_batches": {"type": "integer"}},
    },
    "BrokerGroups": {"type": "object", "required": ["code", "broker_groups"],
                     "properties": {"code": {"type": "string"},
                                    "broker_groups": {"type": "array", "items": _ref("BrokerGroup")}}},
    "Buckets": {"type": "object", "required": ["code", "buckets"],
                "properties": {"code": {"type": "string"}, "buckets": {"type": "array", "items": {
                    "type": "object", "required": ["bucket", "pending"],
                    "properties": {"bucket": {"type": "string", "pattern": "^[0-9]{12}$"},
                                   "start": {"type": "integer"}, "scheduled": {"type": "integer"},
                                   "dispatched": {"type": "integer"}, "cancelled": {"type": "integer"},
                                   "parked": {"type": "integer"}, "pending": {"type": "integer"}, "error": {"type": "string"}}}}}},
    "BucketHistory": {"type": "object", "required": ["code", "samples"],
                      "properties": {"code": {"type": "string"}, "samples": {"type": "array", "items": {
                          "type": "object", "required": ["time", "pending"],
                          "properties": {"time": {"type": "integer"},
                                         "pending": {"type": "object",
                                                     "additionalProperties": {"type": "integer"}}}}}}},
    "Parked": {"type": "object", "required": ["code", "parked"],
               "properties": {"code": {"type": "string"}, "parked": {"type": "array", "items": {
                   "type": "object", "required": ["offset", "id", "subject", "handle", "reason"],
                   "properties": {"offset": {"type": "integer"}, "id": {"type": "string"},
                                  "subject": {"type": "string"}, "handle": {"type": "string"},
                                  "schedule_time": {"type": "integer"}, "parked_time": {"type": "integer"},
                                  "attempt": {"type": "integer"}, "reason": {"type": "string"},
                                  "body_bytes": {"type": "integer"}, "redriven": {"type": "boolean"}}}}}},
    "Redrive": {"type": "object", "required": ["code", "redriven", "remaining"],
                "properties": {"code": {"type": "string"}, "redriven": {"type": "integer"},
                               "remaining": {"type": "integer"}}},
    "Overview": {"type": "object", "required": ["code", "node", "delivery", "broker_groups"],
                 "properties": {"code": {"type": "string"}, "node": {"type": "object"},
                                "delivery": {"type": "object"}, "now": {"type": "integer"},
                                "broker_groups": {"type": "array", "items": _ref("BrokerGroup")},
                                "pending": {"type": "integer"}, "due_next_minute": {"type": "integer"},
                                "due_next_hour": {"type": "integer"},
                                "delivery_rate_per_s": {"type": "number"},
                                "lateness": {"type": "object", "properties": {
                                    "window_s": {"type": "integer"},
                                    "bounds_ms": {"type": "array", "items": {"type": "number"}},
                                    "counts": {"type": "array", "items": {"type": "integer"}}}}}},
    "Health": {"type": "object", "required": ["status", "problems"],
               "properties": {"status": {"type": "string"},
                              "problems": {"type": "array", "items": {"type": "string"}}}},
}


def _with(op: dict, *, parameters: list, responses: dict) -> dict:
    return {**op, "parameters": parameters, "responses": {**op["responses"], **responses}}


def openapi_document() -> dict:
    bearer = [{"bearer": []}]
    paths = {
        "/healthz": {"get": {"summary": "Alive and able to take writes (no failed fsync, replication not stopped)",
                             "security": [],
                             "responses": {"200": _json(_ref("Health"), "healthy"),
                                           "503": _json(_ref("Health"), "unhealthy, with the problems")}}},
        "/readyz": {"get": {"summary": "Ready: replayed, loaded, master or a slave in sync",
                            "security": [],
                            "responses": {"200": _json(_ref("Health"), "ready"),
                                          "503": _json(_ref("Health"), "not ready, with the reasons")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format)",
                             "responses": {"200": {"description": "metrics",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **_errors(401)}}},
        "/v1/messages": {"post": _op(
            "Send one message", _json(_ref("SendResult"), "stored (durable)"), *_WRITE,
            requestBody={"required": True, "content": {"application/json": {"schema": _ref("Message")}}})},
        "/v1/messages/batch": {"post": _op(
            "Send a batch: one result per message", _json(_ref("BatchResult"), "per-message results"), *_WRITE,
            requestBody={"required": True, "content": {"application/json": {"schema": _ref("Batch")}}})},
        "/v1/messages/{handle}": {
            "get": _with(_op("Status of a message", _json(_ref("Status"), "pending, delivered or cancelled"),
                             400, 503), parameters=[_HANDLE],
                         responses={"404": _json(_ref("Status"), "NOT_FOUND: no such message (state unknown)")}),
            "delete": _with(_op("Cancel a pending message", _json(_ref("Cancel"), "the outcome"),
                                400, 421, 503, 507), parameters=[_HANDLE],
                            responses={"404": _json(_ref("Cancel"), "NOT_FOUND: no such message (outcome unknown)")}),
        },
        "/v1/node": {"get": _op("This node: role, epoch, cursors, replication", _json(_ref("Node"), "the node"))},
        "/v1/nodes": {"get": _op("The delay group's nodes and roles (from the meta server)",
                                 _json(_ref("GroupNodes"), "nodes"))},
        "/v1/broker-groups": {"get": _op("Broker groups: breaker, in flight, delivered, retried, parked",
                                         _json(_ref("BrokerGroups"), "broker groups"))},
        "/v1/buckets": {"get": _op("Per bucket: scheduled, dispatched, cancelled, parked, pending",
                                   _json(_ref("Buckets"), "buckets"))},
        "/v1/buckets/history": {"get": _op("Pending per bucket over the last half hour",
                                           _json(_ref("BucketHistory"), "samples"))},
        "/v1/parked": {"get": {**_op("Messages a broker rejected for good", _json(_ref("Parked"), "parked"), 400),
                               "parameters": [{"name": "all", "in": "query", "required": False,
                                               "schema": {"type": "boolean"},
                                               "description": "include those already redriven"}]}},
        "/v1/parked/redrive": {"post": _op("Send every parked message again, due at once",
                                           _json(_ref("Redrive"), "how many"), *_WRITE)},
        "/v1/overview": {"get": _op("What the console's overview shows", _json(_ref("Overview"), "overview"))},
    }
    for path, item in paths.items():
        if path.startswith("/v1/"):
            for op in item.values():
                op.setdefault("security", bearer)
    return {
        "openapi": "3.0.3",
        "info": {"title": "delayserver node API", "version": "1",
                 "description": "Send, status and cancel messages; inspect the node. Errors carry the "
                                "binary protocol's result code name in `code`."},
        "paths": paths,
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "the node's auth_secret"}}},
        "security": bearer,
    }
