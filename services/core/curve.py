"""ZeroMQ CURVE for the buffer: key files, socket options and the allow-list check.

Key files come in two formats, and both are read everywhere a key file is taken:

- ours, written by `python -m rollwire.services.core.curve keygen DIR NAME`: `NAME.key`
  (mode 0600) holds the secret key and `NAME.pub` the public key, each as the
  first line that is not a `#` comment, in Z85 (40 characters);
- `zmq.auth.create_certificates`' certificates: `NAME.key` with a `public-key`,
  `NAME.key_secret` with both keys.

The allow-list is enforced by a ZAP handler (ZeroMQ's authentication protocol,
RFC 27) answered from the buffer's own poll loop, so a client whose key is not
allowed fails its handshake: none of its messages reaches the buffer. A public
key is not secret; a secret key never leaves its file, and a secret given inline
is a SecretStr, masked in the resolved config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from rollwire.services.core.config.models import (
    CurveClientConfig,
    CurveServerConfig,
    check_curve_key,
)
from rollwire.services.core.metrics import COUNTERS

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends a socket's authentication requests (fixed by RFC 27)."""
DENIED_COUNTER = "buffer_curve_denied"
"""Connections refused on a CURVE buffer, labelled by `reason`."""


class CurveError(ValueError):
    """A key or key file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class ServerKeys:
    public_key: bytes
    secret_key: bytes
    allowed_client_keys: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    server_public_key: bytes
    public_key: bytes
    secret_key: bytes


def _certificate_keys(path: Path) -> tuple[bytes | None, bytes | None]:
    """(public, secret) from a key file of either format; either may be None."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise CurveError(f"cannot read CURVE key file {path}: {error}") from None
    if "public-key" in text or "secret-key" in text:
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (ValueError, OSError) as error:
            raise CurveError(f"{path}: not a zmq.auth certificate: {error}") from None
        return public, secret
    lines = [line.strip() for line in text.splitlines()]
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise CurveError(f"{path} holds no CURVE key")
    try:
        key = check_curve_key(keys[0], f"the key in {path}").encode()
    except ValueError as error:
        raise CurveError(str(error)) from None
    return (None, key) if path.suffix == ".key" else (key, None)


def read_secret_key(path: Path) -> bytes:
    """The secret key in `path` (our `NAME.key` or a zmq.auth `.key_secret`)."""
    _, secret = _certificate_keys(path)
    if secret is None:
        raise CurveError(f"{path} holds a public key, not a secret one")
    return secret


def read_public_key(path: Path) -> bytes:
    """The public key in `path` (our `NAME.pub` or a zmq.auth certificate)."""
    public, _ = _certificate_keys(path)
    if public is None:
        raise CurveError(f"{path} holds a secret key where a public key was expected")
    return public


def _secret(inline, file: Path | None) -> bytes:
    if inline is not None:
        return inline.get_secret_value().strip().encode()
    assert file is not None  # the config allows no other case
    return read_secret_key(file)


def _public(secret: bytes) -> bytes:
    try:
        return zmq.curve_public(secret)
    except (ValueError, zmq.ZMQError) as error:
        raise CurveError(f"the CURVE secret key is not usable: {error}") from None


def server_keys(config: CurveServerConfig) -> ServerKeys:
    """Reads the buffer's key and the allowed client keys named by `config`."""
    secret = _secret(config.secret_key, config.secret_key_file)
    allowed = {key.encode() for key in config.allowed_client_keys}
    folder = config.allowed_client_keys_dir
    if folder is not None:
        if not folder.is_dir():
            raise CurveError(f"allowed_client_keys_dir {folder} is not a folder")
        for path in sorted(folder.iterdir()):
            if path.suffix in (".pub", ".key") and path.is_file():
                allowed.add(read_public_key(path))
    if not allowed:
        raise CurveError(f"no allowed client keys: {folder} holds no *.pub or *.key files")
    return ServerKeys(_public(secret), secret, frozenset(allowed))


def client_keys(config: CurveClientConfig) -> ClientKeys:
    """Reads this client's key pair and the buffer's public key named by `config`."""
    if config.server_public_key is not None:
        server = config.server_public_key.strip().encode()
    else:
        assert config.server_public_key_file is not None
        server = read_public_key(config.server_public_key_file)
    secret = _secret(config.secret_key, config.secret_key_file)
    return ClientKeys(server, _public(secret), secret)


def secure_client(socket: zmq.Socket, keys: ClientKeys) -> None:
    """Makes `socket` (before connect) a CURVE client of the server with `keys.server_public_key`."""
    socket.curve_serverkey = keys.server_public_key
    socket.curve_publickey = keys.public_key
    socket.curve_secretkey = keys.secret_key


def secure_server(socket: zmq.Socket, keys: ServerKeys, domain: str) -> None:
    """Makes `socket` (before bind) a CURVE server; its handshakes go to the ZAP handler."""
    socket.curve_server = True
    socket.curve_secretkey = keys.secret_key
    socket.zap_domain = domain.encode()


class ZapHandler:
    """Answers ZAP requests for one context: CURVE clients with an allowed key get in.

    Bind it before any CURVE socket of the context binds: a handshake that finds no
    handler is let through by libzmq. Call `handle` whenever `socket` is readable.
    """

    def __init__(self, context: zmq.Context, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed
        self._logged: set[bytes] = set()
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)

    def handle(self) -> None:
        for _ in range(1000):
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._answer(request))

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6 or request[0] != b"1.0":
            COUNTERS.inc(DENIED_COUNTER, reason="bad_zap_request")
            request_id = request[1] if len(request) > 1 else b""
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        _, request_id, domain, address, _, mechanism, *credentials = request
        if mechanism == b"CURVE" and credentials and len(credentials[0]) == 32:
            client_key = z85.encode(credentials[0])
            if client_key in self.allowed:
                return [b"1.0", request_id, b"200", b"OK", client_key, b""]
            reason = "key_not_allowed"
        else:
            client_key, reason = mechanism, "not_curve"
        COUNTERS.inc(DENIED_COUNTER, reason=reason)
        if client_key not in self._logged:  # clients reconnect every 100 ms: log a key once
            self._logged.add(client_key)
            log.warning(
                "refused a connection: %s (client key %s from %s on the %s socket); "
                "further attempts are counted in %s, not logged",
                reason,
                client_key.decode(errors="replace"),
                address.decode(errors="replace"),
                domain.decode(errors="replace"),
                DENIED_COUNTER,
            )
        return [b"1.0", request_id, b"400", reason.encode(), b"", b""]

    def close(self) -> None:
        self.socket.close(0)


def keygen(folder: Path, name: str) -> tuple[Path, Path]:
    """Writes a new key pair: `NAME.key` (secret, mode 0600) and `NAME.pub`; never overwrites."""
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"key name {name!r} must be a plain file name")
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    secret_path, public_path = folder / f"{name}.key", folder / f"{name}.pub"
    for path in (secret_path, public_path):
        if path.exists():
            raise CurveError(f"{path} exists; remove it first to replace the key pair")
    descriptor = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        os.fchmod(out.fileno(), 0o600)  # exactly 0600, whatever the umask
        out.write(f"# rollwire CURVE secret key {name!r}: keep it private\n{secret.decode()}\n")
    public_path.write_text(f"# rollwire CURVE public key {name!r}\n{public.decode()}\n")
    return secret_path, public_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rollwire.services.core.curve", description="CURVE keys for the buffer."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("keygen", help="write DIR/NAME.key (secret) and DIR/NAME.pub")
    generate.add_argument("folder", type=Path, metavar="DIR")
    generate.add_argument("name", metavar="NAME")
    args = parser.parse_args(argv)
    try:
        secret_path, public_path = keygen(args.folder, args.name)
    except (CurveError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"secret key: {secret_path}\npublic key: {public_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
