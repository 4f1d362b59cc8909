"""When does a message a grpc.aio server streams reach its client: when the server's handler
yields it, or only once its write has completed (the handler's generator is resumed)?

The gateway measures what it adds to a token from the worker's message arriving to the answer
being handed to the client's stream (services/gateway/accounting.py). Over gRPC, "handed" can be
read at the yield or at the generator's resumption; the two differ by the write's completion
round trip, which goes through the server's event loop behind every other ready callback. This
measures, with no model and no gateway, which of the two the client sees.

A server on core 0 streams ``--messages`` messages to each of ``--streams`` clients; every
stream's message i is released at the same moment (as one decode step's tokens reach the
gateway together), and each costs the server ``--work-ms`` of CPU before it is yielded (the
gateway's per-message work). The client, on core 1, stamps each message's arrival. Both sides
read ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process of a host).

    .venv/bin/python bench/grpc_send_timing.py --work-ms 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.bench_serve import percentiles  # noqa: E402
from pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402


class Streamer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, args) -> None:
        self.args = args
        self.steps = [asyncio.Event() for _ in range(args.messages)]
        self.opened = 0
        self.all_open = asyncio.Event()
        self.log: list[tuple[str, int, float, float]] = []  # (stream, i, yielded, resumed)

    async def Generate(self, request, context):
        self.opened += 1
        if self.opened == self.args.streams:
            self.all_open.set()
        for i, step in enumerate(self.steps):
            await step.wait()
            end = time.perf_counter() + self.args.work_ms / 1e3
            while time.perf_counter() < end:  # the per-message work, holding the loop
                pass
            last = i == len(self.steps) - 1
            resp = generation_pb2.GenerateResponse(
                request_id=request.request_id, token_ids=[i], finish_reason="length" if last else ""
            )
            yielded = time.perf_counter()
            yield resp
            self.log.append((request.request_id, i, yielded, time.perf_counter()))


def serve(args, port_q, log_q) -> None:
    os.sched_setaffinity(0, {0})

    async def main() -> None:
        s = Streamer(args)
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(s, server)
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await s.all_open.wait()
        for step in s.steps:
            await asyncio.sleep(args.step_s)
            step.set()
        while len(s.log) < args.streams * args.messages:
            await asyncio.sleep(0.01)
        log_q.put(s.log)
        await server.stop(None)

    asyncio.run(main())


def receive(args, port: int, out_q) -> None:
    os.sched_setaffinity(0, {1})

    async def main() -> None:
        got = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            async def one(k: int) -> None:
                req = generation_pb2.GenerateRequest(request_id=f"s{k}")
                async for m in stub.Generate(req):
                    got.append((m.request_id, m.token_ids[0], time.perf_counter()))

            await asyncio.gather(*(one(k) for k in range(args.streams)))
        out_q.put(got)

    asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--messages", type=int, default=16)
    p.add_argument("--work-ms", type=float, default=0.3)
    p.add_argument("--step-s", type=float, default=0.1, help="between two steps' releases")
    args = p.parse_args()
    port_q, log_q, out_q = mp.Queue(), mp.Queue(), mp.Queue()
    server = mp.Process(target=serve, args=(args, port_q, log_q))
    server.start()
    client = mp.Process(target=receive, args=(args, port_q.get(), out_q))
    client.start()
    arrived = {(rid, i): t for rid, i, t in out_q.get()}
    log = log_q.get()
    client.join()
    server.join()
    print(f"{args.streams} streams x {args.messages} messages, {args.work_ms} ms of work each (ms)")
    for label, which in (("every message", None), ("last message", args.messages - 1)):
        rows = [r for r in log if which is None or r[1] == which]
        seen = [(arrived[(rid, i)] - y) * 1e3 for rid, i, y, _ in rows]
        resumed = [(r - y) * 1e3 for _, _, y, r in rows]
        first = sum(arrived[(rid, i)] < r for rid, i, _, r in rows)
        a, b = percentiles(seen), percentiles(resumed)
        print(
            f"{label:13s}: client has it {a['p50']:.2f} / {a['p99']:.2f} ms after the yield "
            f"(p50 / p99); the generator resumed {b['p50']:.2f} / {b['p99']:.2f} ms after it; "
            f"client first in {first} of {len(rows)}"
        )


if __name__ == "__main__":
    main()
