"""The fast tier: gateway, prefill and decode workers in this process, on one asyncio event loop.

Real grpc.aio servers on 127.0.0.1 (ports picked by the OS), workers registering with the gateway
as processes do, KV over the in-process loopback transport, and a tiny random-weight Llama with
the default model's tokenizer, so that a request costs milliseconds. The loop runs in a thread of
its own; tests drive the cluster from the main thread with the blocking ``pdserve.Client`` and
``tests.helpers.assert_no_leaks``, exactly as the real-process tier (tests/e2e) does.
"""

from __future__ import annotations

import asyncio
import gc
import json
import secrets
import shutil
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.server import GatewayOptions, GatewayServer
from pdserve.services.main import WorkerOptions, WorkerServer
from safetensors.torch import save_file

from pdserve.certs import CertFiles
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.tls import TLSConfig

T = TypeVar("T")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
KV_CACHE_BYTES = 8 << 20  # 1,024 blocks of 16 tokens with TINY in fp32


def build_tiny_model(folder: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A random-weight Llama with the vocabulary (and tokenizer files) of ``tokenizer_from``."""
    base = json.loads((tokenizer_from / "config.json").read_text())
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": base["vocab_size"],
        "bos_token_id": base["bos_token_id"],
        "eos_token_id": base["eos_token_id"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        **TINY,
    }
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2  # peaky logits: greedy far from ties

    weights = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(folder / "model.safetensors"))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", default_model_dir)


class LoopThread:
    """An asyncio event loop running in a thread; ``run`` hands it a coroutine and waits.

    What the loop would log as unhandled (a task's or future's exception nobody retrieved) is kept
    in ``errors`` instead, and the cluster's test fails on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, context: self.errors.append(context))
        self._thread = threading.Thread(target=self.loop.run_forever, name="servers", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class Cluster:
    """A gateway and named workers in this process. ``live()`` is what ``assert_no_leaks`` takes.

    Workers register with a cluster token; with ``certs`` (``pdserve.certs.make_cluster_certs``)
    and no token instead: the gateway serves TLS, its Registry on a port of its own that requires
    a cluster certificate, and every process talks mutual TLS to the others."""

    def __init__(
        self,
        model: Path,
        policy: str,
        queue_timeout_s: float,
        api_keys_file: str | None = None,
        http: bool = False,
        lease_s: float = GatewayConfig.lease_s,
        certs: dict[str, CertFiles] | None = None,
        decode_prefill_budget_s: float = 0.0,
        config: dict[str, float] | None = None,
    ) -> None:
        self.model = model
        self.certs = certs
        self.token = None if certs else secrets.token_urlsafe(16)  # workers register with it
        self.loop = LoopThread()
        self.gateway = self.loop.run(
            GatewayServer.start(
                GatewayOptions(
                    model=str(model),
                    port=0,
                    config=GatewayConfig(
                        policy=policy,
                        queue_timeout_s=queue_timeout_s,
                        api_keys_file=api_keys_file,
                        lease_s=lease_s,
                        # tests see the roles they started: every prompt disaggregated, unless a
                        # test of placement.py asks otherwise
                        decode_prefill_budget_s=decode_prefill_budget_s,
                        # hang detection off without a config (its probes would race the tests
                        # that stop workers and count retries), and no waiting for stopped
                        # workers to come back; a config has both at their defaults
                        **(
                            {"probe_interval_s": 0.0, "outage_wait_s": 0.0}
                            if config is None
                            else config
                        ),
                    ),
                    metrics_port=-1,
                    http_port=0 if http else -1,
                    cluster_token=self.token,
                    tls=self._tls("gateway"),
                    registry_port=0 if certs else None,
                )
            )
        )
        self.workers: dict[str, WorkerServer] = {}
        self.stopped: dict[str, WorkerServer] = {}

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def http_address(self) -> str:
        """The OpenAI-compatible HTTP API's host:port (a cluster started with ``http=True``)."""
        return self.gateway.http_address

    def _tls(self, name: str) -> TLSConfig | None:
        if self.certs is None:
            return None
        f = self.certs[name]
        return TLSConfig(cert=str(f.cert), key=str(f.key), ca=str(f.ca))

    def worker_options(
        self,
        role: str,
        max_num_seqs: int = 64,
        block_size: int = 16,
        gateway: str | None = None,
        prefix_caching: bool = True,
        roofline: bool = False,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        kv_cache_bytes: int = KV_CACHE_BYTES,
        **options: Any,
    ) -> WorkerOptions:
        """A worker of the cluster's model registering with ``gateway`` (default: this cluster's
        Registry, with its cluster token or certificate); ``roofline``: measure the machine at
        start (off: it costs every worker ~0.5 s, tests/serve/test_roofline_metrics.py has it on)."""
        engine = EngineConfig(
            model=str(self.model),
            dtype="float32",
            threads=1,
            cache=CacheConfig(block_size, kv_cache_bytes, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
        )
        return WorkerOptions(
            role=role,
            engine=engine,
            port=0,
            gateway=gateway or self.gateway.registry_address,
            transport="loopback",
            metrics_port=-1,
            cluster_token=self.token,
            tls=self._tls("worker"),
            roofline=roofline,
            **options,
        )

    def start_worker(self, name: str, role: str, **options: Any) -> WorkerServer:
        """Started and registered; ``options`` as ``worker_options`` takes them."""
        self.workers[name] = self.loop.run(WorkerServer.start(self.worker_options(role, **options)))
        return self.workers[name]

    def stop_worker(self, name: str) -> None:
        """The worker's server goes away (the gateway still lists it until its lease ends)."""
        server = self.workers.pop(name)
        self.loop.run(server.stop(grace=0))
        self.stopped[name] = server

    def live(self) -> dict[str, tuple[str, str]]:
        return {name: (w.address, w.role) for name, w in self.workers.items()}

    def served(self, name: str, outcome: str = "ok") -> int:
        """Requests that ended with ``outcome`` on worker ``name``."""
        w = self.workers.get(name) or self.stopped[name]
        value = w.worker.metrics.registry.get_sample_value(
            "pdserve_requests_total", {"outcome": outcome}
        )
        return int(value or 0)

    def gateway_metric(self, name: str, **labels: str) -> float:
        value = self.gateway.gateway.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    def close(self) -> None:
        """Stop everything; fails if the servers' loop had an exception nobody handled."""
        try:
            for w in self.workers.values():
                self.loop.run(w.stop(grace=0))
            self.loop.run(self.gateway.stop(grace=0))
        finally:
            self.loop.close()
        gc.collect()  # a future's unretrieved exception is reported when it is collected
        unhandled = [f"{e.get('message')}: {e.get('exception')!r}" for e in self.loop.errors]
        assert not unhandled, f"unhandled in the servers' event loop: {unhandled}"


def start_cluster(
    model: Path,
    prefill: int = 2,
    decode: int = 2,
    colocated: int = 0,
    policy: str = "least_loaded",
    decode_seqs: int = 64,
    queue_timeout_s: float = GatewayConfig.queue_timeout_s,
    api_keys_file: str | None = None,
    http: bool = False,
    lease_s: float = GatewayConfig.lease_s,
    certs: dict[str, CertFiles] | None = None,
    decode_prefill_budget_s: float = 0.0,
    config: dict[str, float] | None = None,
) -> Cluster:
    """A gateway and workers named prefill-0.., decode-0.., colocated-0.., each registered;
    ``http``: the gateway serves its OpenAI-compatible HTTP API too; ``config``: more
    GatewayConfig fields (None: also hang detection off)."""
    c = Cluster(
        model,
        policy,
        queue_timeout_s,
        api_keys_file,
        http,
        lease_s,
        certs,
        decode_prefill_budget_s,
        config,
    )
    try:
        for i in range(prefill):
            c.start_worker(f"prefill-{i}", "prefill")
        for i in range(decode):
            c.start_worker(f"decode-{i}", "decode", max_num_seqs=decode_seqs)
        for i in range(colocated):
            c.start_worker(f"colocated-{i}", "colocated")
    except BaseException:
        c.close()
        raise
    return c


def _clusters(model: Path):
    """A ``make(**start_cluster's options)`` factory; closes what it made when resumed."""
    made: list[Cluster] = []

    def make(**options: Any) -> Cluster:
        made.append(start_cluster(model, **options))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster(tiny_model_dir):
    """cluster(**start_cluster's options) -> a Cluster of its own, closed when the test ends."""
    yield from _clusters(tiny_model_dir)


@pytest.fixture(scope="module")
def module_cluster(tiny_model_dir):
    """module_cluster(**start_cluster's options) -> a Cluster shared by the module's tests."""
    yield from _clusters(tiny_model_dir)


@pytest.fixture(scope="module")
def shared_cluster(tiny_model_dir):
    """2 prefill + 2 decode workers (least_loaded), shared by a module's tests that leave every
    worker serving and idle (each ends with ``assert_no_leaks``)."""
    c = start_cluster(tiny_model_dir)
    yield c
    c.close()
