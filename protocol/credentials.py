"""A spawned worker's credentials and their private hand-off from the router.

The router makes fresh :class:`WorkerCredentials` for every worker it spawns and
hands them over through an inherited pipe (``python -m worker --auth-fd N``):
never on the command line or in the environment, which other local processes
can read (``/proc/<pid>/cmdline``, ``/proc/<pid>/environ``). The router writes
the record and closes its end before the worker starts; the worker reads to
end-of-file and closes the descriptor (:func:`read_credentials`).

* ``secret``: 32 random bytes (hex). The worker proves it in ``Hello.auth``; the
  router compares with :func:`hmac.compare_digest` (:func:`secret_matches`) and
  accepts no other peer for that worker's socket.
* ``server_public``, ``public``, ``secret_key``: ZeroMQ CURVE keys (Z85 text), set
  for ``transport = "tcp"``: the router's per-service public key, and a keypair
  made for this worker alone. A peer that does not know the server key cannot
  even complete the ZeroMQ handshake, and the traffic is encrypted.

Imports neither the router nor the worker; both import it.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from dataclasses import dataclass

#: Largest credentials record read from the pipe, bytes (a record is ~250).
MAX_CREDENTIALS_BYTES = 4096


@dataclass(frozen=True, kw_only=True)
class WorkerCredentials:
    """What one spawned worker knows and no other process does (see the module docstring)."""

    secret: str
    server_public: str | None = None  # CURVE (Z85): the router's public key
    public: str | None = None  # CURVE (Z85): this worker's keypair
    secret_key: str | None = None

    @property
    def curve(self) -> bool:
        return self.server_public is not None

    @classmethod
    def new(cls, curve: tuple[str, str, str] | None = None) -> WorkerCredentials:
        """Fresh credentials; ``curve`` = (server public key, worker public key, worker
        secret key), Z85, when the socket uses CURVE."""
        if curve is None:
            return cls(secret=secrets.token_hex(32))
        server_public, public, secret_key = curve
        return cls(secret=secrets.token_hex(32), server_public=server_public, public=public,
                   secret_key=secret_key)

    def to_bytes(self) -> bytes:
        return json.dumps({"secret": self.secret, "server_public": self.server_public,
                           "public": self.public, "secret_key": self.secret_key}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> WorkerCredentials:
        """Parse a record. Raises ValueError if it is not one."""
        try:
            obj = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"credentials are not JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("secret"), str) or len(obj["secret"]) < 32:
            raise ValueError("credentials lack a secret")
        keys = [obj.get(k) for k in ("server_public", "public", "secret_key")]
        if not (all(k is None for k in keys) or all(isinstance(k, str) and len(k) == 40 for k in keys)):
            raise ValueError("credentials: CURVE keys must be all absent or all 40-character Z85 strings")
        return cls(secret=obj["secret"], server_public=keys[0], public=keys[1], secret_key=keys[2])


def write_credentials(creds: WorkerCredentials) -> int:
    """A pipe holding ``creds``: returns its read end (inheritable, for ``pass_fds``);
    the write end is already closed, so the reader gets end-of-file after the record."""
    data = creds.to_bytes()
    r, w = os.pipe()
    try:
        os.write(w, data)  # far below the pipe buffer (64 KiB): never blocks
    finally:
        os.close(w)
    os.set_inheritable(r, True)
    return r


def read_credentials(fd: int) -> WorkerCredentials:
    """Read the record from ``fd`` to end-of-file and close ``fd``. Raises ValueError."""
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            chunk = os.read(fd, 1024)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_CREDENTIALS_BYTES:
                raise ValueError(f"credentials record over {MAX_CREDENTIALS_BYTES} bytes")
            chunks.append(chunk)
    except OSError as e:
        raise ValueError(f"cannot read credentials from fd {fd}: {e}") from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    return WorkerCredentials.from_bytes(b"".join(chunks))


def secret_matches(expected: str, given: str) -> bool:
    """Constant-time comparison of a presented secret (an empty one never matches)."""
    return bool(given) and hmac.compare_digest(expected.encode(), given.encode())
