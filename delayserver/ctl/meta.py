"""`delayctl meta`: look at and change what the meta server holds.

    delayctl meta [--meta HOST:PORT[,HOST:PORT...]] [--tls-ca PEM] groups|nodes|broker-groups|routes [--json]
    delayctl meta broker-group add NAME --transport spool|redis|http|rabbitmq|nats --address A
                               [--weight N] [--read-only] [--option KEY=VALUE ...]
    delayctl meta broker-group update NAME [--transport T] [--address A] [--weight N]
                               [--read-only | --writable] [--option KEY=VALUE ...] [--remove-option KEY ...]
    delayctl meta broker-group remove NAME
    delayctl meta route add PATTERN GROUP [GROUP ...]
    delayctl meta route remove PATTERN
    delayctl meta group read-only NAME on|off
    delayctl meta resolve SUBJECT [--json]
    delayctl meta epochs GROUP [--json]

The cluster secret, when the meta servers require one, is read from $DELAYSERVER_CLUSTER_SECRET.

An option VALUE is read as JSON when it is JSON (1000, true, "text", [1,2]) and as a string
otherwise. Exit codes: 0 done, 1 the meta server refused (its message on stderr) or could not be
reached, 2 a usage error.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import ssl
import sys
from typing import Any

import trio

from delayserver.meta.client import MetaClient, MetaError, MetaUnavailable
from delayserver.meta.wire import DEFAULT_META_PORT, parse_address_list
from delayserver.sender.groups import TransportKind

LISTINGS = {
    # listing: (op, result key, columns)
    "groups": ("list_groups", "groups",
               ("name", "read_only", "master_epoch", "master", "master_address", "master_state")),
    "nodes": ("list_nodes", "nodes", ("group", "node_id", "role", "state", "address", "epoch", "want_role",
                                      "last_heartbeat")),
    "broker-groups": ("list_broker_groups", "broker_groups", ("name", "transport", "address", "weight", "read_only",
                                                              "options")),
    "routes": ("list_routes", "routes", ("pattern", "broker_groups")),
    "epochs": ("epoch_history", "epochs", ("epoch", "node_id", "granted")),
}

LISTING_HELP = {"groups": "delay groups and their masters", "nodes": "delay-server nodes",
                "broker-groups": "broker groups", "routes": "subject routes",
                "epochs": "grants of mastership of a delay group"}


def register(subparsers) -> None:
    p = subparsers.add_parser("meta", help="list and change groups, nodes, broker groups and routes",
                              description="Look at and change what the meta server holds.",
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("--meta", default=f"127.0.0.1:{DEFAULT_META_PORT}", type=_address, metavar="HOST:PORT[,...]",
                   help=f"the meta servers, tried in turn (default 127.0.0.1:{DEFAULT_META_PORT})")
    p.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, checking the meta servers' certificates "
                                                 "against this CA")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    commands = p.add_subparsers(metavar="WHAT", required=True)

    for name in LISTINGS:
        listing = commands.add_parser(name, help=f"list the {LISTING_HELP[name]}")
        if name == "epochs":
            listing.add_argument("group", help="the delay group")
        listing.add_argument("--json", action="store_true", help="JSON lines, one object per line")
        listing.set_defaults(run=run, build=lambda args, name=name: _list_request(name, args))

    broker_group = commands.add_parser("broker-group", help="add, update or remove a broker group")
    actions = broker_group.add_subparsers(metavar="ACTION", required=True)
    add = actions.add_parser("add", help="add a broker group")
    add.add_argument("name")
    add.add_argument("--transport", required=True, choices=[k.value for k in TransportKind])
    add.add_argument("--address", required=True)
    add.add_argument("--weight", type=int, default=1)
    add.add_argument("--read-only", action="store_true", help="send nothing to it for now")
    add.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE")
    add.set_defaults(run=run, build=_add_broker_group)
    update = actions.add_parser("update", help="change some fields of a broker group")
    update.add_argument("name")
    update.add_argument("--transport", choices=[k.value for k in TransportKind])
    update.add_argument("--address")
    update.add_argument("--weight", type=int)
    writable = update.add_mutually_exclusive_group()
    writable.add_argument("--read-only", dest="read_only", action="store_true", default=None)
    writable.add_argument("--writable", dest="read_only", action="store_false")
    update.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE")
    update.add_argument("--remove-option", action="append", default=[], metavar="KEY")
    update.set_defaults(run=run, build=_update_broker_group)
    remove = actions.add_parser("remove", help="remove a broker group no route uses")
    remove.add_argument("name")
    remove.set_defaults(run=run, build=lambda args: ("remove_broker_group", {"name": args.name}))

    route = commands.add_parser("route", help="add (or replace) or remove a subject route")
    actions = route.add_subparsers(metavar="ACTION", required=True)
    add = actions.add_parser("add", help="route subjects matching PATTERN to these broker groups")
    add.add_argument("pattern", help="an exact subject, or a glob such as 'orders.*'")
    add.add_argument("groups", nargs="+", metavar="GROUP")
    add.set_defaults(run=run, build=lambda args: ("add_route", {"pattern": args.pattern, "broker_groups": args.groups}))
    remove = actions.add_parser("remove", help="remove the route of PATTERN")
    remove.add_argument("pattern")
    remove.set_defaults(run=run, build=lambda args: ("remove_route", {"pattern": args.pattern}))

    group = commands.add_parser("group", help="change a delay group")
    actions = group.add_subparsers(metavar="ACTION", required=True)
    read_only = actions.add_parser("read-only", help="stop (on) or resume (off) producers sending to a delay group")
    read_only.add_argument("name")
    read_only.add_argument("state", choices=["on", "off"])
    read_only.set_defaults(run=run, build=lambda args: (
        "set_group_read_only", {"group": args.name, "read_only": args.state == "on"}))

    resolve = commands.add_parser("resolve", help="which broker groups serve a subject, and by which route")
    resolve.add_argument("subject")
    resolve.add_argument("--json", action="store_true")
    resolve.set_defaults(run=run, build=lambda args: ("resolve", {"subject": args.subject}))


def run(args) -> int:
    op, request = args.build(args)
    try:
        tls = ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca else None
    except (OSError, ssl.SSLError) as exc:
        print(f"error: --tls-ca {args.tls_ca}: {exc}", file=sys.stderr)
        return 1
    try:
        response = trio.run(_request, args.meta, args.timeout, op, request, tls)
    except (MetaError, MetaUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "listing", None):
        _print_listing(args.listing, response, args.json)
    elif op == "resolve":
        _print_resolved(response, args.json)
    else:
        print(response["message"] if response["message"] != "ok" else "done")
    return 0


async def _request(addresses: str, timeout: float, op: str, request: dict, tls: ssl.SSLContext | None) -> dict:
    secret = os.environ.get("DELAYSERVER_CLUSTER_SECRET", "")
    async with MetaClient(addresses, timeout_s=timeout, secret=secret, tls=tls) as client:
        return await client.request(op, **request)


def _list_request(name: str, args) -> tuple[str, dict]:
    args.listing = name
    return LISTINGS[name][0], ({"group": args.group} if name == "epochs" else {})


def _add_broker_group(args) -> tuple[str, dict]:
    return "add_broker_group", {
        "name": args.name, "transport": args.transport, "address": args.address, "weight": args.weight,
        "read_only": args.read_only, "options": dict(args.option),
    }


def _update_broker_group(args) -> tuple[str, dict]:
    request: dict[str, Any] = {"name": args.name}
    for key in ("transport", "address", "weight", "read_only"):
        if getattr(args, key) is not None:
            request[key] = getattr(args, key)
    options = dict(args.option)
    options.update({key: None for key in args.remove_option})  # null removes the key
    if options:
        request["options"] = options
    return "update_broker_group", request


def _print_listing(name: str, response: dict, as_json: bool) -> None:
    _, key, columns = LISTINGS[name]
    rows = response[key]
    if as_json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return
    _print_table(columns, [[_cell(row, column) for column in columns] for row in rows])


def _print_resolved(response: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"route": response["route"], "broker_groups": response["broker_groups"]}, sort_keys=True))
        return
    print(f"route: {response['route'] if response['route'] is not None else '(none: every broker group)'}")
    columns = LISTINGS["broker-groups"][2]
    _print_table(columns, [[_cell(row, column) for column in columns] for row in response["broker_groups"]])


def _cell(row: dict, column: str) -> str:
    master = row.get("master") or {}
    if column == "master":
        return master.get("node_id", "-")
    if column in ("master_address", "master_state"):
        return master.get(column.removeprefix("master_"), "-")
    if column in ("last_heartbeat", "granted"):
        when = datetime.datetime.fromtimestamp(row[f"{column}_ms"] / 1000, datetime.timezone.utc)
        return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    value = row[column]
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True) if value else "-"
    return str(value)


def _print_table(columns, rows: list[list[str]]) -> None:
    headings = [c.upper() for c in columns]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headings)]
    for line in [headings] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())


def _address(text: str) -> str:
    try:
        parse_address_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE, not {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value
