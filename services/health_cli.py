"""``pdserve health``: exit 0 iff a pdserve server answers SERVING (a container health check)."""

from __future__ import annotations

import sys


def cmd_health(args) -> int:
    """Exit 0 iff the server at ``args.address`` says SERVING (a container health check)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if args.tls_ca is None:
        channel = grpc.insecure_channel(args.address)
    else:  # TLS; with --tls-cert/--tls-key, presenting our certificate (a mutual-TLS port)

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(
            read(args.tls_ca), read(args.tls_key), read(args.tls_cert)
        )
        options = [("grpc.ssl_target_name_override", args.tls_server_name)]
        channel = grpc.secure_channel(
            args.address, credentials, options=options if args.tls_server_name else None
        )
    try:
        with channel as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as e:
        print(f"pdserve health: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1
