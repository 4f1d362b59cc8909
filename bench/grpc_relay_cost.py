"""The floor under the gateway's per-token CPU: what one grpc.aio process spends per message
to (a) read ``--streams`` server streams, (b) read them and stream each message on to a client,
as the gateway does, with no routing, accounting or detokenizing. A source process on core 1
streams ``--messages`` small messages per stream; the process measured runs on core 0; its CPU
time (all threads, from /proc) over the messages it handled.

    .venv/bin/python bench/grpc_relay_cost.py
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

from pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402


def _message(rid: str, i: int) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(request_id=rid, token_ids=[i], text=" word")


class Source(generation_pb2_grpc.GenerationServicer):
    def __init__(self, args) -> None:
        self.args = args

    async def Generate(self, request, context):
        for i in range(self.args.messages):
            await asyncio.sleep(self.args.step_s)
            yield _message(request.request_id, i)


class Relay(generation_pb2_grpc.GenerationServicer):
    def __init__(self, stub) -> None:
        self.stub = stub

    async def Generate(self, request, context):
        async for m in self.stub.Generate(request):
            yield _message(m.request_id, m.token_ids[0])


async def _serve(servicer, port_q) -> None:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


async def _read_all(port: int, streams: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(k: int) -> None:
            async for _ in stub.Generate(generation_pb2.GenerateRequest(request_id=f"s{k}")):
                pass

        await asyncio.gather(*(one(k) for k in range(streams)))


def source(args, port_q) -> None:
    os.sched_setaffinity(0, {1})
    asyncio.run(_serve(Source(args), port_q))


def reader(args, port: int) -> None:
    os.sched_setaffinity(0, {0})
    asyncio.run(_read_all(port, args.streams))


def relay(port: int, port_q) -> None:
    os.sched_setaffinity(0, {0})

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await _serve(Relay(generation_pb2_grpc.GenerationStub(ch)), port_q)

    asyncio.run(main())


def client(args, port: int) -> None:
    os.sched_setaffinity(0, {1})
    asyncio.run(_read_all(port, args.streams))


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--messages", type=int, default=200)
    p.add_argument("--step-s", type=float, default=0.02, help="between a stream's messages")
    args = p.parse_args()
    n = args.streams * args.messages
    port_q = mp.Queue()
    src = mp.Process(target=source, args=(args, port_q), daemon=True)
    src.start()
    port = port_q.get()
    # (a) reading only: a child process whose whole CPU time is the reading
    r = mp.Process(target=reader, args=(args, port))
    r.start()
    pid, start = r.pid, time.monotonic()
    while r.is_alive():
        used = cpu_s(pid)
        r.join(0.05)
    print(
        f"read:          {used / n * 1e3:.3f} ms CPU a message ({time.monotonic() - start:.1f} s)"
    )
    # (b) relaying: the relay's CPU from its first to its last message
    rl = mp.Process(target=relay, args=(port, port_q), daemon=True)
    rl.start()
    relay_port = port_q.get()
    before = cpu_s(rl.pid)
    c = mp.Process(target=client, args=(args, relay_port))
    c.start()
    c.join()
    print(f"read + resend: {(cpu_s(rl.pid) - before) / n * 1e3:.3f} ms CPU a message")


if __name__ == "__main__":
    main()
