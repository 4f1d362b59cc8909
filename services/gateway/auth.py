"""API keys and per-key limits of the gateway: who may call, and how much.

    authorization: Bearer <key> ──> KeyStore.authenticate ──> ApiKey (id, limits)
                                    (UNAUTHENTICATED: missing, malformed, unknown)
    tokenized request ──> Limiter.admit(key, prompt_tokens, max_tokens) ──> Grant
                          concurrency, requests/min, tokens/min (prompt + max_tokens reserved)
                          (RESOURCE_EXHAUSTED + retry_after_s; INVALID_ARGUMENT: can never fit)
    request ends (any way) ──> Grant.release(used_tokens): the unused tokens are refunded

Keys are stored hashed (``sha256:<hex>`` of the key): the file never holds a key, and a key is
found by its hash, so no comparison ever runs over the secret itself. Keys are 256-bit random
strings, so a plain (unsalted, fast) hash is enough: there is nothing to guess by brute force.

The token window is sliding: every admission is logged with its time and its tokens, and a
request is admitted only if the tokens of the admissions of the last 60 s, its own included, stay
within the key's budget. A refund lowers its admission's entry to the tokens actually used.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from pdserve import envs
from pdserve.metrics import GatewayMetrics
from pdserve.rpc import StatusError

WINDOW_S = 60.0
KEY_PREFIX = "pds_"
_LIMITS = ("rpm", "tpm", "concurrency")


class KeyFileError(ValueError):
    """An API key file (or $PDSERVE_API_KEYS) that cannot be read or used; says where and why."""


class Unauthenticated(StatusError):
    """No key, a malformed authorization header, or a key that is not configured (``reason``:
    missing, malformed, invalid)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAUTHENTICATED, message)
        self.reason = reason


class RateLimited(StatusError):
    """A key is over one of its limits (``reason``: rpm, tpm, concurrency); retrying after
    ``retry_after_s`` seconds may succeed. gRPC sends it as the trailing metadata ``retry-after``
    (whole seconds, as HTTP's Retry-After header)."""

    def __init__(self, key_id: str, reason: str, retry_after_s: float, message: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.key_id = key_id
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after", str(max(1, math.ceil(self.retry_after_s)))),)


class RequestTooLarge(StatusError):
    """A request whose reservation alone exceeds its key's tokens per minute: no wait makes it
    fit, so it is INVALID_ARGUMENT (HTTP 400), not a 429 that clients would retry forever."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; None is unlimited. ``rpm``: requests admitted per 60 s; ``tpm``: tokens
    (prompt + max_tokens, reserved at admission) per 60 s; ``concurrency``: requests at once."""

    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        for name in _LIMITS:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or absent, got {v!r}")


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    hash: str  # "sha256:<hex>"
    limits: KeyLimits


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_keys(text: str, source: str) -> dict[str, ApiKey]:
    """hash -> ApiKey from a key file's JSON: ``{"keys": [{"id": "alice", "hash": "sha256:<hex>",
    "rpm": 60, "tpm": 10000, "concurrency": 4}, ...]}`` (limits optional). KeyFileError, naming
    ``source``, for anything else."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise KeyFileError(f"{source}: not JSON: {e}") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise KeyFileError(f'{source}: expected {{"keys": [...]}}')
    keys: dict[str, ApiKey] = {}
    ids: set[str] = set()
    for i, e in enumerate(entries):
        where = f"{source}: keys[{i}]"
        if not isinstance(e, dict):
            raise KeyFileError(f"{where}: expected an object")
        unknown = set(e) - {"id", "hash", *_LIMITS}
        if unknown:
            raise KeyFileError(f"{where}: unknown fields {sorted(unknown)}")
        key_id, h = e.get("id"), e.get("hash")
        if not isinstance(key_id, str) or not key_id:
            raise KeyFileError(f"{where}: 'id' must be a non-empty string")
        if key_id in ids:
            raise KeyFileError(f"{where}: duplicate id {key_id!r}")
        if not (
            isinstance(h, str)
            and h.startswith("sha256:")
            and len(h) == 71
            and all(c in "0123456789abcdef" for c in h[7:])
        ):
            raise KeyFileError(f"{where} ({key_id}): 'hash' must be 'sha256:' + 64 lower-case hex")
        if h in keys:
            raise KeyFileError(f"{where} ({key_id}): same key as {keys[h].key_id!r}")
        try:
            limits = KeyLimits(**{n: e.get(n) for n in _LIMITS})
        except ValueError as err:
            raise KeyFileError(f"{where} ({key_id}): {err}") from None
        ids.add(key_id)
        keys[h] = ApiKey(key_id, h, limits)
    return keys


class KeyStore:
    """The configured keys. With none and no file (``KeyStore({})``) the gateway is open: every
    caller is admitted, unlimited. ``path``: the file they came from (None: the environment),
    read again by ``reload``; a key file with no keys admits nobody (it never opens the gateway)."""

    def __init__(self, keys: dict[str, ApiKey], path: Path | None = None) -> None:
        self.keys = keys
        self.path = path

    @classmethod
    def from_file(cls, path: str | Path) -> KeyStore:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise KeyFileError(f"cannot read the API key file {p}: {e.strerror}") from None
        return cls(parse_keys(text, str(p)), p)

    @property
    def enabled(self) -> bool:
        return self.path is not None or bool(self.keys)

    def reload(self) -> int:
        """Read ``path`` again; KeyFileError (the old keys stay) when it cannot be used.
        Returns the number of keys."""
        if self.path is None:
            raise KeyFileError("no API key file was given (--api-keys): nothing to reload")
        self.keys = KeyStore.from_file(self.path).keys
        return len(self.keys)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key an ``authorization`` header value (``Bearer <key>``) names; None when no keys
        are configured (an open gateway). Unauthenticated otherwise."""
        if not self.enabled:
            return None
        if not authorization:
            raise Unauthenticated(
                "missing",
                "missing API key: send the header (gRPC metadata) 'authorization: Bearer <key>'",
            )
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed", "malformed authorization: expected 'Bearer <key>'")
        found = self.keys.get(hash_key(key.strip()))
        if found is None:
            raise Unauthenticated("invalid", "invalid API key")
        return found


def load_keys(path: str | None) -> KeyStore:
    """The keys of the file at ``path``, else of $PDSERVE_API_KEYS, else none (open)."""
    if path:
        return KeyStore.from_file(path)
    text = envs.api_keys()
    if text:
        return KeyStore(parse_keys(text, "$PDSERVE_API_KEYS"))
    return KeyStore({})


@dataclass
class _Entry:
    """One admission in a key's token window."""

    at: float
    tokens: int
    live: bool = True  # still in the window (not yet expired)


class _KeyState:
    def __init__(self) -> None:
        self.running = 0
        self.requests: deque[float] = deque()  # admission times in the window
        self.entries: deque[_Entry] = deque()  # token reservations in the window
        self.window_tokens = 0  # sum of entries' tokens


class Grant:
    """One admitted request's seat and reservation; ``release(used_tokens)`` (idempotent) gives
    the seat back and refunds ``reserved - used_tokens``."""

    def __init__(
        self, limiter: Limiter, key_id: str, state: _KeyState, entry: _Entry | None
    ) -> None:
        self.key_id = key_id
        self.reserved = entry.tokens if entry is not None else 0
        self._limiter = limiter
        self._state = state
        self._entry = entry
        self._released = False

    def release(self, used_tokens: int) -> None:
        if self._released:
            return
        self._released = True
        self._limiter._release(self, used_tokens)


class Limiter:
    """Per-key concurrency, requests per minute and tokens per minute (by reservation), over a
    sliding 60 s window. ``clock`` (monotonic seconds) is injectable for tests. Its state is kept
    per key id, so a reloaded key file keeps its keys' windows."""

    def __init__(
        self, metrics: GatewayMetrics | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self._state: dict[str, _KeyState] = {}

    def window_tokens(self, key_id: str) -> int:
        """Tokens reserved (net of refunds) by ``key_id`` in the last 60 s."""
        state = self._state.get(key_id)
        if state is None:
            return 0
        self._expire(state, self.clock())
        return state.window_tokens

    def admit(self, key: ApiKey, prompt_tokens: int, max_tokens: int) -> Grant:
        """A Grant for one request of ``key``, or RateLimited / RequestTooLarge (then nothing is
        taken: a refused request counts against no limit)."""
        lim, kid = key.limits, key.key_id
        state = self._state.setdefault(kid, _KeyState())
        now = self.clock()
        self._expire(state, now)
        cost = prompt_tokens + max_tokens
        if lim.tpm is not None and cost > lim.tpm:
            self._rejected(kid, "too_large")
            raise RequestTooLarge(
                f"this request needs {cost} tokens (prompt {prompt_tokens} + max_tokens "
                f"{max_tokens}) but key {kid!r} may use {lim.tpm} tokens per minute; "
                "lower max_tokens or shorten the prompt"
            )
        if lim.concurrency is not None and state.running >= lim.concurrency:
            self._rejected(kid, "concurrency")
            raise RateLimited(
                kid,
                "concurrency",
                1.0,  # a running request ends at an unknown time: ask again soon
                f"key {kid!r} has {state.running} requests running, its limit; retry when one ends",
            )
        if lim.rpm is not None and len(state.requests) >= lim.rpm:
            wait = state.requests[-lim.rpm] + WINDOW_S - now
            self._rejected(kid, "rpm")
            raise RateLimited(
                kid,
                "rpm",
                wait,
                f"key {kid!r} is over its limit of {lim.rpm} requests per minute; "
                f"retry in {wait:.1f} s",
            )
        if lim.tpm is not None and state.window_tokens + cost > lim.tpm:
            wait = self._tokens_free_in(state, cost, lim.tpm, now)
            self._rejected(kid, "tpm")
            raise RateLimited(
                kid,
                "tpm",
                wait,
                f"key {kid!r} is over its limit of {lim.tpm} tokens per minute "
                f"({state.window_tokens} reserved in the last minute, this request needs {cost}); "
                f"retry in {wait:.1f} s",
            )
        state.running += 1
        if lim.rpm is not None:
            state.requests.append(now)
        entry = None
        if lim.tpm is not None:
            entry = _Entry(now, cost)
            state.entries.append(entry)
            state.window_tokens += cost
        m = self.metrics
        if m is not None:
            m.key_requests.labels(kid).inc()
            m.key_tokens_reserved.labels(kid).inc(cost)
            m.key_running.labels(kid).inc()
        return Grant(self, kid, state, entry)

    def _release(self, grant: Grant, used_tokens: int) -> None:
        state, entry = grant._state, grant._entry
        state.running -= 1
        if entry is not None and entry.live:
            refund = max(0, entry.tokens - max(0, used_tokens))
            entry.tokens -= refund
            state.window_tokens -= refund
        m = self.metrics
        if m is not None:
            m.key_running.labels(grant.key_id).dec()
            m.key_tokens_used.labels(grant.key_id).inc(max(0, used_tokens))

    def _rejected(self, key_id: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.key_rejected.labels(key_id, reason).inc()

    @staticmethod
    def _expire(state: _KeyState, now: float) -> None:
        start = now - WINDOW_S
        while state.requests and state.requests[0] <= start:
            state.requests.popleft()
        while state.entries and state.entries[0].at <= start:
            e = state.entries.popleft()
            e.live = False
            state.window_tokens -= e.tokens

    @staticmethod
    def _tokens_free_in(state: _KeyState, cost: int, tpm: int, now: float) -> float:
        """Seconds until enough of the window's entries expire for ``cost`` more tokens."""
        excess = state.window_tokens + cost - tpm
        for e in state.entries:
            excess -= e.tokens
            if excess <= 0:
                return max(0.0, e.at + WINDOW_S - now)
        return WINDOW_S  # unreachable while cost <= tpm


def write_keys(path: Path, keys: list[ApiKey]) -> None:
    """Write a key file atomically (a reader, or a SIGHUP reload, sees the old or the new file),
    readable by its owner only."""
    doc = {
        "keys": [
            {"id": k.key_id, "hash": k.hash}
            | {n: v for n, v in asdict(k.limits).items() if v is not None}
            for k in keys
        ]
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_key(path: Path, key_id: str, limits: KeyLimits) -> str:
    """Add a new key named ``key_id`` to the file at ``path`` (created if missing) and return the
    key: the only time it exists outside its holder's hands."""
    keys = list(KeyStore.from_file(path).keys.values()) if path.exists() else []
    if any(k.key_id == key_id for k in keys):
        raise ValueError(f"{path}: a key named {key_id!r} exists; remove it first")
    if not key_id:
        raise ValueError("a key id must be a non-empty string")
    key = new_key()
    write_keys(path, [*keys, ApiKey(key_id, hash_key(key), limits)])
    return key


def remove_key(path: Path, key_id: str) -> None:
    keys = list(KeyStore.from_file(path).keys.values())
    kept = [k for k in keys if k.key_id != key_id]
    if len(kept) == len(keys):
        raise ValueError(f"{path}: no key named {key_id!r}")
    write_keys(path, kept)
