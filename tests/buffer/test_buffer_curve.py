"""CURVE on the buffer's sockets: allowed keys get through, anything else gets nothing."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
import zmq
import zmq.auth

from rollwire.services.buffer.client import BufferError, BufferProducer, BufferTrainerClient
from rollwire.services.buffer.server import BufferServer
from rollwire.services.buffer.state import BufferState
from rollwire.services.core.config import ConfigError, load_config, write_resolved_config
from rollwire.services.core.config.models import CurveClientConfig, CurveServerConfig
from rollwire.services.core.curve import DENIED_COUNTER, CurveError, keygen, server_keys
from rollwire.services.core.metrics import COUNTERS
from tests.helpers.trajectories import trajectory


@dataclass
class Keys:
    folder: Path

    def client(self, name: str) -> CurveClientConfig:
        return CurveClientConfig(
            server_public_key_file=self.folder / "buffer.pub",
            secret_key_file=self.folder / f"{name}.key",
        )


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    """Key pairs for the buffer, two allowed clients and a stranger; the allowed
    clients' public keys in their own folder."""
    for name in ("buffer", "orchestrator", "trainer", "stranger"):
        keygen(tmp_path, name)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("orchestrator", "trainer"):
        (allowed / f"{name}.pub").write_text((tmp_path / f"{name}.pub").read_text())
    return Keys(tmp_path)


@contextmanager
def serve(curve: CurveServerConfig) -> Iterator[BufferServer]:
    server = BufferServer(BufferState(group_size=2, max_staleness=0), curve=curve)
    thread = threading.Thread(target=server.serve, kwargs={"poll_ms": 10}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=5)
        assert not thread.is_alive()


@pytest.fixture
def curve_server(keys: Keys) -> Iterator[BufferServer]:
    config = CurveServerConfig(
        secret_key_file=keys.folder / "buffer.key", allowed_client_keys_dir=keys.folder / "allowed"
    )
    with serve(config) as server:
        yield server


def wait_for_denials(reason: str, before: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = COUNTERS.get(DENIED_COUNTER, reason=reason)
        if count > before:
            return count
        time.sleep(0.01)
    raise AssertionError(f"no {reason} denial counted within {timeout}s")


@pytest.mark.integration
async def test_allowed_clients_put_and_get_a_batch(curve_server, keys) -> None:
    endpoints = curve_server.endpoints
    producer = BufferProducer(endpoints["producer"], timeout=2, curve=keys.client("orchestrator"))
    trainer = BufferTrainerClient(endpoints["trainer"], timeout=2, curve=keys.client("trainer"))
    try:
        results = [await producer.put(trajectory("g", i, reward=i)) for i in range(2)]
        assert [r.accepted for r in results] == [True, True]
        batch = await asyncio.to_thread(trainer.get_batch, 0, 1, 1.0)
        assert [t.reward for t in batch.trajectories] == [0.0, 1.0]
        await asyncio.to_thread(trainer.ack, batch.batch_id, 1)
        assert (await producer.status()).trainer_version == 1
    finally:
        producer.close()
        trainer.close()


@pytest.mark.integration
async def test_a_key_not_allowed_gets_nothing_through(curve_server, keys) -> None:
    endpoints = curve_server.endpoints
    before = COUNTERS.get(DENIED_COUNTER, reason="key_not_allowed")
    producer = BufferProducer(
        endpoints["producer"], timeout=0.3, attempts=2, curve=keys.client("stranger")
    )
    trainer = BufferTrainerClient(endpoints["trainer"], timeout=0.3, curve=keys.client("stranger"))
    try:
        with pytest.raises(BufferError, match=r"did not answer 2 tries of 0.3s; CURVE is on"):
            await producer.put(trajectory("g", 0))
        with pytest.raises(BufferError, match=r"did not answer within 0.3s; CURVE is on"):
            await asyncio.to_thread(trainer.status)
    finally:
        producer.close()
        trainer.close()
    assert wait_for_denials("key_not_allowed", before) > before
    assert curve_server.state.accepted == 0 and not curve_server.state.partial


@pytest.mark.integration
async def test_a_client_without_curve_gets_nothing_through(curve_server) -> None:
    endpoints = curve_server.endpoints
    before = COUNTERS.get(DENIED_COUNTER, reason="handshake_failed")
    producer = BufferProducer(endpoints["producer"], timeout=0.3, attempts=2)
    trainer = BufferTrainerClient(endpoints["trainer"], timeout=0.3)
    try:
        with pytest.raises(BufferError, match=r"did not answer 2 tries of 0.3s$"):
            await producer.put(trajectory("g", 0))
        with pytest.raises(BufferError, match=r"did not answer within 0.3s$"):
            await asyncio.to_thread(trainer.get_batch, 0, 1, 0.0)
    finally:
        producer.close()
        trainer.close()
    assert wait_for_denials("handshake_failed", before) > before
    assert curve_server.state.accepted == 0 and curve_server.state.served_trajectories == 0


@pytest.mark.integration
async def test_zmq_auth_certificates_work_too(tmp_path) -> None:
    for folder in ("server", "clients"):
        (tmp_path / folder).mkdir()
    server_public, _ = zmq.auth.create_certificates(tmp_path / "server", "buffer")
    _, client_secret = zmq.auth.create_certificates(tmp_path / "clients", "trainer")
    with serve(
        CurveServerConfig(
            secret_key_file=Path(f"{server_public}_secret"),
            allowed_client_keys_dir=tmp_path
            / "clients",  # the public .key is read, not .key_secret
        )
    ) as server:
        client = BufferTrainerClient(
            server.endpoints["trainer"],
            timeout=2,
            curve=CurveClientConfig(
                server_public_key_file=Path(server_public), secret_key_file=Path(client_secret)
            ),
        )
        try:
            assert (await asyncio.to_thread(client.status)).accepted == 0
        finally:
            client.close()


def test_keygen_writes_a_private_secret_file(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollwire.services.core.curve", "keygen", str(tmp_path), "node"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    secret, public = tmp_path / "node.key", tmp_path / "node.pub"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    keys = server_keys(CurveServerConfig(secret_key_file=secret, allowed_client_keys=["0" * 40]))
    assert public.read_text().splitlines()[-1].encode() == keys.public_key
    with pytest.raises(CurveError, match="exists"):
        keygen(tmp_path, "node")


def test_a_secret_key_in_the_allowed_folder_is_an_error(keys) -> None:
    (keys.folder / "allowed" / "stranger.key").write_text(
        (keys.folder / "stranger.key").read_text()
    )
    config = CurveServerConfig(
        secret_key_file=keys.folder / "buffer.key", allowed_client_keys_dir=keys.folder / "allowed"
    )
    with pytest.raises(CurveError, match="holds a secret key"):
        server_keys(config)


def test_curve_config_rules_and_masked_secrets(tmp_path) -> None:
    public, secret = (key.decode() for key in zmq.curve_keypair())
    # Z85 uses YAML punctuation ([ { & * ! ...); quoted, any key reads back as text.
    config = load_config(
        overrides=[
            f"buffer.curve.secret_key='{secret}'",
            f"buffer.curve.allowed_client_keys=['{public}']",
            f"client.curve.secret_key='{secret}'",
            f"client.curve.server_public_key='{public}'",
        ],
        environ={},
    )
    assert config.buffer.curve.secret_key.get_secret_value() == secret
    text = write_resolved_config(config, tmp_path / "run").read_text()
    assert secret not in text and public in text
    data = yaml.safe_load(text)
    assert data["buffer"]["curve"]["secret_key"] == "**********"
    assert data["client"]["curve"]["secret_key"] == "**********"
    with pytest.raises(ConfigError, match="either secret_key or secret_key_file"):
        load_config(
            overrides=[
                f"buffer.curve.secret_key='{secret}'",
                "buffer.curve.secret_key_file=/k",
                f"buffer.curve.allowed_client_keys=['{public}']",
            ],
            environ={},
        )
    with pytest.raises(ConfigError, match="allowed_client_keys or allowed_client_keys_dir"):
        load_config(overrides=["buffer.curve.secret_key_file=/k"], environ={})
    with pytest.raises(ConfigError, match="not a CURVE key"):
        load_config(overrides=["client.curve.server_public_key=short"], environ={})
