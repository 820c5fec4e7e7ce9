"""The HTTP server's own options (`python -m engine.serve`), checked before the engine is built.

`check_server_options` checks the values (port range, host, log level, waiting-request cap, body
size cap); `check_listen` binds the address once and lets it go. Both raise a ValueError naming the
option, so a bad option is one line at startup, not a failure after the engine is up (minutes with
real weights) or a server listening elsewhere than it says.
"""
from __future__ import annotations

import argparse
import errno
import socket

from engine.serving.guards import check_max_body_bytes
from engine.serving.server import LOOPBACK

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's (any case)
MAX_PORT = 65535


def check_server_options(ns: argparse.Namespace) -> None:
    """The HTTP server's own options, checked before anything is built; ValueError naming the option.
    Port 0 (any free port) is refused: the server announces its URL before it binds."""
    from engine.online.async_llm_engine import check_max_waiting_requests  # the engine's own check

    if not 1 <= ns.port <= MAX_PORT:
        raise ValueError(f"port={ns.port} is invalid: a TCP port in [1, {MAX_PORT}]")
    if not ns.host:
        raise ValueError(f"host={ns.host!r} is invalid: an address to bind, e.g. {LOOPBACK} (loopback only) "
                         "or 0.0.0.0 (every interface)")
    if ns.log_level.lower() not in LOG_LEVELS:
        raise ValueError(f"log_level={ns.log_level!r} is invalid: one of {', '.join(LOG_LEVELS)}")
    check_max_waiting_requests(ns.max_waiting_requests)
    if ns.max_request_body_bytes is not None:
        check_max_body_bytes(ns.max_request_body_bytes)


def check_listen(host: str, port: int) -> None:
    """Bind every address `host` resolves to at `port` once, as the server will (uvicorn's
    `loop.create_server`), and let go: an unknown host, an address not of this machine, a port in
    use or one needing privileges is a ValueError now, not after the engine is built (minutes with
    real weights). An address of a family this machine lacks is skipped if another one binds."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"host={host!r} is invalid: it names no address ({exc.strerror})") from None
    bound, missing = 0, None
    for family, kind, proto, _, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # a family this machine does not have
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise ValueError(f"port={port} is invalid: cannot listen at {address[0]} port {port} "
                                     f"({exc.strerror})") from None
                missing = exc
                continue
        bound += 1
    if not bound:
        why = f" ({missing.strerror})" if missing is not None else ""
        raise ValueError(f"host={host!r} is invalid: not an address of this machine{why}")
