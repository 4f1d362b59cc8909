"""grpc.aio server and channel factories: health, reflection and limits installed in one place."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Requests larger than this are refused by gRPC itself with RESOURCE_EXHAUSTED (a 10 MB prompt
# is never legitimate: the longest context is far smaller).
MAX_MESSAGE_BYTES = 4 << 20

_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


class Server:
    """A grpc.aio server with the standard health service (overall status "" plus one per service)
    and reflection."""

    def __init__(self, service_names: list[str]) -> None:
        self.server = grpc.aio.server(options=_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = service_names
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )

    def bind(self, address: str) -> int:
        """Listen on ``address`` ("host:port", port 0 picks one); returns the port."""
        port = self.server.add_insecure_port(address)
        if port == 0:
            raise ValueError(f"cannot listen on {address}")
        return port

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self.server.stop(grace)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=_OPTIONS)
