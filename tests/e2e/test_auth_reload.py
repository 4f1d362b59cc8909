"""The `pdserve gateway` process re-reads its API key file on SIGHUP; a bad file leaves the old keys
in force and says so on stderr. A gateway alone suffices: ListModels needs a key too."""

from __future__ import annotations

import json
import signal
import subprocess
import threading

import grpc
from pdserve.services.gateway.auth import KeyLimits, add_key
from pdserve.services.launcher import start_process, stop_processes

from pdserve import Client
from tests.helpers import wait_until


def _refused(address: str, key: str) -> bool:
    with Client(address, timeout=10, api_key=key) as cl:
        try:
            cl.list_models()
            return False
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            return True


def test_sighup_reloads_the_key_file(tmp_path, default_model_dir):
    path = tmp_path / "keys.json"
    alice = add_key(path, "alice", KeyLimits(rpm=100))
    proc, address, *_ = start_process(
        [
            "gateway",
            "--model",
            str(default_model_dir),
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--http-port",
            "-1",
        ]
        + ["--api-keys", str(path), "--log-format", "json"],
        env={"PDSERVE_CLUSTER_TOKEN": "test-token"},
        stderr=subprocess.PIPE,
        timeout=120,
    )
    logs: list[dict] = []
    reader = threading.Thread(
        target=lambda: logs.extend(json.loads(line) for line in proc.stderr if line[:1] == "{"),
        daemon=True,
    )
    reader.start()
    try:
        assert not _refused(address, alice)
        bob = add_key(path, "bob", KeyLimits())
        assert _refused(address, bob)
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: not _refused(address, bob), 10, "bob's key after SIGHUP")

        path.write_text("{not json")
        proc.send_signal(signal.SIGHUP)
        wait_until(
            lambda: any(e.get("event") == "auth.reload_failed" for e in logs),
            10,
            "the failed reload to be logged",
        )
        assert not _refused(address, alice) and not _refused(address, bob)
    finally:
        stop_processes([proc])
    reader.join(timeout=10)
    events = [e["event"] for e in logs]
    assert "auth.keys_loaded" in events and "auth.keys_reloaded" in events
    assert "auth.disabled" not in events
    failed = next(e for e in logs if e["event"] == "auth.reload_failed")
    assert failed["level"] == "error" and "not JSON" in failed["error"]
    assert proc.returncode == 0
