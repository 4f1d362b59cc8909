"""A small blocking client of the gateway's gRPC API.

from pdserve import Client, SamplingParams
with Client("127.0.0.1:50051") as c:
    for delta in c.generate_stream("Hello", SamplingParams(max_tokens=16)):
        print(delta.text, end="")

A gateway that serves TLS: ``Client(url, tls_ca="ca.pem")`` (the CA its certificate chains to).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pdserve.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.v1.convert import sampling_to_proto


def tls_credentials(ca_path: str) -> grpc.ChannelCredentials:
    """Credentials that trust the certificates ``ca_path`` (PEM) issued."""
    try:
        with open(ca_path, "rb") as f:
            ca = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the TLS CA {ca_path}: {e.strerror}") from None
    return grpc.ssl_channel_credentials(root_certificates=ca)


class Client:
    """``api_key``: sent with every call as ``authorization: Bearer <key>`` (a gateway with keys
    refuses calls without one, UNAUTHENTICATED). ``tls_ca``: dial over TLS, trusting the
    certificates this CA (PEM path) issued."""

    def __init__(
        self,
        url: str,
        timeout: float | None = None,
        api_key: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        self.url = url.removeprefix("grpc://")
        self.timeout = timeout
        self._auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if tls_ca is None:
            self._channel = grpc.insecure_channel(self.url)
        else:
            self._channel = grpc.secure_channel(self.url, tls_credentials(tls_ca))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def _request(
        self,
        prompt: str | list[int] | list[dict[str, str]],
        params: SamplingParams | None,
        request_id: str = "",
        affinity_key: str = "",
    ) -> generation_pb2.GenerateRequest:
        req = generation_pb2.GenerateRequest(
            sampling=sampling_to_proto(params or SamplingParams()),
            request_id=request_id,
            affinity_key=affinity_key,
        )
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt and isinstance(prompt[0], dict):
            req.chat.messages.extend(
                generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt
            )
        else:
            req.token_ids.ids.extend(prompt)
        return req

    def generate_stream(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str = "",
        metadata: tuple[tuple[str, str], ...] = (),
        affinity_key: str = "",
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """Streamed deltas; prompt is text (raw), token ids, or chat messages [{"role", "content"}].
        ``metadata`` goes with the call, e.g. ``(("traceparent", "00-<trace>-<span>-01"),)`` to make
        the request part of the caller's trace. ``affinity_key`` (a session, a user): requests
        with the same key go to the same prefill worker (routing policy ``cost``)."""
        return self._stub.Generate(
            self._request(prompt, params, request_id, affinity_key),
            timeout=self.timeout,
            metadata=(*self._auth, *metadata),
        )

    def complete(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str = "",
        metadata: tuple[tuple[str, str], ...] = (),
        affinity_key: str = "",
    ) -> generation_pb2.CompleteResponse:
        return self._stub.Complete(
            self._request(prompt, params, request_id, affinity_key),
            timeout=self.timeout,
            metadata=(*self._auth, *metadata),
        )

    def list_models(self) -> list[str]:
        return [
            m.id
            for m in self._stub.ListModels(
                generation_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self._auth
            ).models
        ]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
