"""The status code each exception ends an RPC of pdserve's services with: one table, given to every
server (``rpc.Server(..., errors=STATUS_CODES)``) and read by the gateway's request accounting.

The nearest class in an exception's MRO that the table names decides; a ``rpc.StatusError`` (the
gateway's ``GatewayError``) carries its own code; anything else is INTERNAL. The message is the
exception's text.
"""

from __future__ import annotations

import grpc
from pdserve.services.gateway.registry import LayoutMismatchError

from pdserve.exceptions import (
    AdmissionError,
    EngineDeadError,
    HeaderMismatchError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.rpc import ErrorTable

STATUS_CODES: ErrorTable = {
    # a bad request: sampling parameters, prompt, request id, block ids
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    # a worker whose KV layout differs from its peers' (registration, or one transfer's header;
    # HeaderMismatchError is a ValueError and a TransferError too: its own entry decides)
    LayoutMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    HeaderMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    # a full decode worker refuses at once: the gateway tries another, or queues the request
    AdmissionError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    # a TransferError and a TimeoutError: its own entry decides
    TransferTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    TransferError: grpc.StatusCode.UNAVAILABLE,
    TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    # a worker whose engine thread died: the gateway tries another (before the first token)
    EngineDeadError: grpc.StatusCode.UNAVAILABLE,
}
