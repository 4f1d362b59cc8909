"""Per-RPC cost of TLS on a gRPC plane: health Check round trips on one channel, and new-channel
connects (handshakes), plaintext vs mutual TLS, interleaved rounds.

    .venv/bin/python bench/tls_rpc_cost.py
"""

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc, tls
from pdserve.certs import make_cluster_certs


async def main():
    d = Path(tempfile.mkdtemp())
    c = make_cluster_certs(d)
    cfg = {n: tls.TLSConfig(str(f.cert), str(f.key), str(f.ca)) for n, f in c.items()}
    servers = {}
    keep = []
    for mode in ("plain", "mtls"):
        s = rpc.Server([], errors={})
        creds = tls.server_credentials(cfg["gateway"], True) if mode == "mtls" else None
        port = s.bind("127.0.0.1:0", creds)
        await s.start()
        await s.set_serving(True)
        servers[mode] = port
        keep.append(s)

    def chan(mode):
        cr = tls.channel_credentials(cfg["worker"]) if mode == "mtls" else None
        return rpc.channel(f"127.0.0.1:{servers[mode]}", cr)

    req = health_pb2.HealthCheckRequest()
    res = {m: {"rpc_us": [], "connect_ms": []} for m in servers}
    for rnd in range(3):
        for mode in ("plain", "mtls") if rnd % 2 == 0 else ("mtls", "plain"):
            ch = chan(mode)
            stub = health_pb2_grpc.HealthStub(ch)
            await stub.Check(req)
            t = time.perf_counter()
            for _ in range(2000):
                await stub.Check(req)
            res[mode]["rpc_us"].append((time.perf_counter() - t) / 2000 * 1e6)
            await ch.close()
            t = time.perf_counter()
            for _ in range(50):
                ch = chan(mode)
                await health_pb2_grpc.HealthStub(ch).Check(req)
                await ch.close()
            res[mode]["connect_ms"].append((time.perf_counter() - t) / 50 * 1e3)
    for m, r in res.items():
        print(
            m,
            "rpc us/call",
            [round(x) for x in r["rpc_us"]],
            "median",
            round(statistics.median(r["rpc_us"])),
            "| new channel + first call ms",
            [round(x, 2) for x in r["connect_ms"]],
            "median",
            round(statistics.median(r["connect_ms"]), 2),
        )
    for server in keep:
        await server.stop(0)
    shutil.rmtree(d)


asyncio.run(main())
