"""API keys and the per-key limiter, without servers: the key file (hashed, validated, edited
atomically), authentication, and the limiter's windows on an injected clock (no sleeps)."""

from __future__ import annotations

import json
import random
import stat

import grpc
import pytest
from pdserve.services.admin_cli import cmd_keys
from pdserve.services.gateway.auth import (
    ApiKey,
    KeyLimits,
    KeyStore,
    Limiter,
    RateLimited,
    RequestTooLarge,
    Unauthenticated,
    add_key,
    hash_key,
    load_keys,
    parse_keys,
    remove_key,
)

from pdserve.metrics import GatewayMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(key_id: str = "alice", **limits: int) -> ApiKey:
    return ApiKey(key_id, hash_key(key_id), KeyLimits(**limits))


# ---- the key file ----------------------------------------------------------------------------


def test_the_key_file_holds_the_hash_and_never_the_key(tmp_path):
    path = tmp_path / "keys.json"
    k = add_key(path, "alice", KeyLimits(rpm=60, tpm=10_000, concurrency=4))
    assert k.startswith("pds_") and len(k) > 40
    text = path.read_text()
    assert k not in text and k.removeprefix("pds_") not in text
    assert json.loads(text) == {
        "keys": [{"id": "alice", "hash": hash_key(k), "rpm": 60, "tpm": 10_000, "concurrency": 4}]
    }
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    bob = add_key(path, "bob", KeyLimits())
    store = KeyStore.from_file(path)
    assert store.authenticate(f"Bearer {k}").key_id == "alice"
    assert store.authenticate(f"bearer  {bob} ").limits == KeyLimits()
    with pytest.raises(ValueError, match="a key named 'alice' exists"):
        add_key(path, "alice", KeyLimits())
    remove_key(path, "alice")
    with pytest.raises(Unauthenticated, match="invalid API key"):
        KeyStore.from_file(path).authenticate(f"Bearer {k}")
    with pytest.raises(ValueError, match="no key named 'alice'"):
        remove_key(path, "alice")


def test_keys_add_prints_the_key_once_and_refuses_bad_limits(tmp_path, capsys):
    import argparse

    path = tmp_path / "k.json"
    args = argparse.Namespace(
        keys_command="add", file=str(path), id="ci", rpm=5, tpm=None, concurrency=None
    )
    assert cmd_keys(args) == 0
    out, err = capsys.readouterr()
    printed = out.strip()
    assert KeyStore.from_file(path).authenticate(f"Bearer {printed}").key_id == "ci"
    assert "not stored anywhere" in err and printed not in err
    args.id, args.rpm = "zero", 0
    assert cmd_keys(args) == 2
    assert "rpm must be an integer >= 1 or absent, got 0" in capsys.readouterr().err


def keyfile(*entries: dict) -> str:
    return json.dumps({"keys": list(entries)})


X, Y = hash_key("x"), hash_key("y")


@pytest.mark.parametrize(
    "doc, message",
    [
        ("{", "not JSON"),
        ("[]", 'expected {"keys": [...]}'),
        (keyfile({"hash": X}), "'id' must be a non-empty string"),
        (keyfile({"id": "a", "hash": "pds_plaintext"}), "'hash' must be 'sha256:'"),
        (keyfile({"id": "a", "hash": X, "tpm": -1}), "tpm must be an integer >= 1"),
        (keyfile({"id": "a", "hash": X, "rpm": 1.5}), "rpm must be an integer >= 1"),
        (keyfile({"id": "a", "hash": X, "key": "x"}), "unknown fields"),
        (keyfile({"id": "a", "hash": X}, {"id": "a", "hash": Y}), "duplicate id 'a'"),
        (keyfile({"id": "a", "hash": X}, {"id": "b", "hash": X}), "same key as 'a'"),
    ],
)
def test_a_bad_key_file_is_refused_with_where_and_why(doc, message):
    with pytest.raises(ValueError, match="keys.json") as e:
        parse_keys(doc, "keys.json")
    assert message in str(e.value)


def test_reload_keeps_the_old_keys_when_the_new_file_is_bad(tmp_path):
    path = tmp_path / "keys.json"
    k = add_key(path, "alice", KeyLimits())
    store = KeyStore.from_file(path)
    path.write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        store.reload()
    assert store.authenticate(f"Bearer {k}").key_id == "alice"
    path.unlink()
    with pytest.raises(ValueError, match="cannot read the API key file"):
        store.reload()
    assert store.authenticate(f"Bearer {k}").key_id == "alice"


def test_keys_from_the_environment_and_none_at_all(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    assert not load_keys(None).enabled
    assert load_keys(None).authenticate(None) is None  # open
    doc = json.dumps({"keys": [{"id": "env", "hash": hash_key("s3cret"), "rpm": 1}]})
    monkeypatch.setenv("PDSERVE_API_KEYS", doc)
    store = load_keys(None)
    assert store.authenticate("Bearer s3cret") == ApiKey("env", hash_key("s3cret"), KeyLimits(1))
    with pytest.raises(ValueError, match=r"no API key file was given \(--api-keys\)"):
        store.reload()
    monkeypatch.setenv("PDSERVE_API_KEYS", "{}")
    with pytest.raises(ValueError, match=r"\$PDSERVE_API_KEYS"):
        load_keys(None)
    # a key file with no keys admits nobody: it never opens the gateway
    empty = tmp_path / "empty.json"
    empty.write_text('{"keys": []}')
    with pytest.raises(Unauthenticated, match="invalid API key"):
        load_keys(str(empty)).authenticate("Bearer anything")


@pytest.mark.parametrize(
    "header, reason, message",
    [
        (None, "missing", "missing API key"),
        ("", "missing", "missing API key"),
        ("Basic abc", "malformed", "expected 'Bearer <key>'"),
        ("Bearer ", "malformed", "expected 'Bearer <key>'"),
        ("Bearer wrong", "invalid", "invalid API key"),
    ],
)
def test_authentication_failures(header, reason, message):
    store = KeyStore({hash_key("good"): key()})
    with pytest.raises(Unauthenticated) as e:
        store.authenticate(header)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert (e.value.reason, message in str(e.value)) == (reason, True)


# ---- the limiter ----------------------------------------------------------------------------


def test_requests_per_minute_slide_with_the_clock():
    clock = Clock()
    lim = Limiter(clock=clock)
    k = key(rpm=2)
    lim.admit(k, 1, 1).release(2)
    clock.now += 59
    lim.admit(k, 1, 1).release(2)
    with pytest.raises(RateLimited) as e:
        lim.admit(k, 1, 1)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (e.value.reason, e.value.retry_after_s) == ("rpm", pytest.approx(1.0))
    assert e.value.trailing_metadata == (("retry-after", "1"),)
    clock.now += 1  # the first admission leaves the window
    lim.admit(k, 1, 1)
    # a fixed window would start afresh at a minute boundary; the sliding one still holds the
    # admission of 1 s ago
    with pytest.raises(RateLimited) as e:
        lim.admit(k, 1, 1)
    assert e.value.retry_after_s == pytest.approx(59.0)
    assert e.value.trailing_metadata == (("retry-after", "59"),)


def test_tokens_are_reserved_at_admission_and_the_unused_part_refunded():
    clock = Clock()
    lim = Limiter(clock=clock)
    k = key(tpm=100)
    first = lim.admit(k, 10, 50)  # 60 reserved
    assert (first.reserved, lim.window_tokens("alice")) == (60, 60)
    clock.now += 10
    with pytest.raises(RateLimited, match="60 reserved in the last minute") as e:
        lim.admit(k, 10, 50)
    assert (e.value.reason, e.value.retry_after_s) == ("tpm", pytest.approx(50.0))
    first.release(15)  # stopped early: 10 prompt + 5 completion tokens used
    assert lim.window_tokens("alice") == 15
    second = lim.admit(k, 10, 50)
    assert lim.window_tokens("alice") == 75
    second.release(75)
    second.release(0)  # idempotent: no second refund
    assert lim.window_tokens("alice") == 75
    clock.now += 50  # the first admission (now 15 tokens) leaves the window
    assert lim.window_tokens("alice") == 60


def test_a_refund_after_its_admission_left_the_window_changes_nothing():
    clock = Clock()
    lim = Limiter(clock=clock)
    k = key(tpm=100)
    long_running = lim.admit(k, 10, 90)
    clock.now += 60
    other = lim.admit(k, 10, 90)
    long_running.release(10)
    assert lim.window_tokens("alice") == 100
    other.release(100)


def test_a_request_larger_than_the_budget_is_invalid_not_retryable():
    lim = Limiter(clock=Clock())
    with pytest.raises(RequestTooLarge) as e:
        lim.admit(key(tpm=100), 30, 71)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs 101 tokens (prompt 30 + max_tokens 71)" in str(e.value)
    assert "may use 100 tokens per minute" in str(e.value)
    assert lim.window_tokens("alice") == 0


def test_concurrency_and_refused_requests_take_nothing():
    clock = Clock()
    metrics = GatewayMetrics()
    lim = Limiter(metrics, clock)
    k = key(concurrency=2, rpm=10, tpm=1000)
    a, b = lim.admit(k, 1, 9), lim.admit(k, 1, 9)
    for _ in range(3):
        with pytest.raises(RateLimited, match="2 requests running") as e:
            lim.admit(k, 1, 9)
        assert e.value.reason == "concurrency"
    assert lim.window_tokens("alice") == 20  # the refused ones reserved nothing
    a.release(10)
    c = lim.admit(k, 1, 9)
    for g in (b, c):
        g.release(3)

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"key": "alice", **labels})

    assert sample("pdserve_key_requests_total") == 3
    assert sample("pdserve_key_rejected_total", reason="concurrency") == 3
    assert sample("pdserve_key_tokens_reserved_total") == 30
    assert sample("pdserve_key_tokens_used_total") == 16
    assert sample("pdserve_key_requests_running") == 0


def test_the_token_window_never_exceeds_the_budget_under_random_traffic():
    """Random admissions, early stops and clock steps; after every event the tokens admitted in
    the last 60 s (recomputed from our own log) stay within tpm, and equal the limiter's sum."""
    rng = random.Random(7)
    clock = Clock()
    lim = Limiter(clock=clock)
    tpm = 1000
    k = key(tpm=tpm, concurrency=8)
    log: list[list] = []  # [admitted at, tokens]
    running: list[tuple] = []
    admitted = refused = 0
    for _ in range(3000):
        clock.now += rng.choice([0, 0, 0.5, 3, 17])
        if running and rng.random() < 0.45:
            grant, entry, prompt = running.pop(rng.randrange(len(running)))
            used = prompt + rng.randint(0, entry[1] - prompt)
            grant.release(used)
            entry[1] = used
        else:
            prompt, max_tokens = rng.randint(1, 200), rng.randint(1, 300)
            try:
                grant = lim.admit(k, prompt, max_tokens)
            except RateLimited:
                refused += 1
                continue
            admitted += 1
            entry = [clock.now, prompt + max_tokens]
            log.append(entry)
            running.append((grant, entry, prompt))
        in_window = sum(t for at, t in log if at > clock.now - 60)
        assert in_window <= tpm
        assert lim.window_tokens("alice") == in_window
    assert admitted > 100 and refused > 100
