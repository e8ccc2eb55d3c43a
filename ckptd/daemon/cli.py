"""``ckptd serve`` and ``ckptd health``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ckptd.daemon.config import DEFAULT_SOCKET, add_serve_arguments


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="run the per-node checkpoint daemon",
        description="Run the per-node checkpoint daemon. Every flag can also be set as "
                    "CKPTD_<FLAG> (e.g. CKPTD_STORAGE, CKPTD_STAGING_BYTES); flags win.")
    add_serve_arguments(p)
    p.set_defaults(func=_serve)

    h = sub.add_parser(
        "health", help="exit 0 iff the daemon's gRPC health service says SERVING",
        description="Ask the daemon's standard grpc.health.v1 service; exit 0 iff SERVING.")
    where = h.add_mutually_exclusive_group()
    where.add_argument("--socket", help=f"daemon Unix socket (default $CKPTD_SOCKET or "
                                        f"{DEFAULT_SOCKET})")
    where.add_argument("--address", help="daemon TCP address HOST:PORT (TLS)")
    h.add_argument("--tls-ca", default=os.environ.get("CKPTD_TLS_CA") or None,
                   help="PEM CA bundle to verify the daemon's TLS certificate (default "
                        "$CKPTD_TLS_CA, as for clients; else the system's roots)")
    h.add_argument("--tls-server-name", default=os.environ.get("CKPTD_TLS_SERVER_NAME") or None,
                   help="expected TLS server name (default $CKPTD_TLS_SERVER_NAME, else the "
                        "host)")
    h.add_argument("--service", default="", help="health service name (default: overall)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    h.set_defaults(func=_health)


def _serve(args: argparse.Namespace) -> int:
    from ckptd.daemon.config import from_args
    from ckptd.daemon.server import serve

    cfg = from_args(args)
    return serve(cfg, verbose=getattr(args, "verbose", False))


def check_health(target: str, *, tls_ca: bytes | None = None, server_name: str | None = None,
                 secure: bool = False, service: str = "", timeout: float = 5.0) -> str:
    """The health status name (SERVING, NOT_SERVING, ...) or the error that prevented it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    if secure:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(tls_ca), options)
    else:
        channel = grpc.insecure_channel(target, options)
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    finally:
        channel.close()


def _health(args: argparse.Namespace) -> int:
    if args.address:
        ca = None
        if args.tls_ca:
            try:
                with open(args.tls_ca, "rb") as f:
                    ca = f.read()
            except OSError as exc:
                from ckptd.errors import ConfigError

                raise ConfigError(f"--tls-ca {args.tls_ca} cannot be read ({exc.strerror}); "
                                  "pass the PEM CA bundle that signed the daemon's "
                                  "certificate") from None
        status = check_health(args.address, tls_ca=ca, server_name=args.tls_server_name,
                              secure=True, service=args.service, timeout=args.timeout)
        where = args.address
    else:
        path = args.socket or os.environ.get("CKPTD_SOCKET") or DEFAULT_SOCKET
        status = check_health("unix:" + path, service=args.service, timeout=args.timeout)
        where = "unix:" + path
    print(f"{where}: {status}", file=sys.stdout if status == "SERVING" else sys.stderr)
    return 0 if status == "SERVING" else 1
