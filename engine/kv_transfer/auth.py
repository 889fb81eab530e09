"""What instances that exchange KV trust each other with: one shared secret (`kv_secret`, or
the AGENTRT_KV_SECRET environment variable), and HMAC-SHA256 under keys derived from it.

- `kv_transfer_params` a p2p producer hands out (through its HTTP response, so through any
  client) carry an expiry and a signature over every field: a consumer accepts them only
  when the signature checks out, so a client can pass on what a producer gave it but cannot
  forge or alter a field (another host or port, request id, block ids or content key).
  `check_client_params` is what the engine's Processor runs on every request's params.
- The p2p wire messages carry a MAC (`mac`), both ways.
- The storage connector's files carry a MAC over their tokens and data, and their names are
  keyed too (storage.py).

Each use has its own key (`derive_key(secret, purpose)`), so a MAC made for one can never
pass for another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from typing import Any

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.errors import ConfigError, InvalidRequestError

SIGNATURE = "signature"  # the field of signed kv_transfer_params that holds the signature
EXPIRES = "expires"  # ... and their expiry, in Unix seconds
# What a proxy asks a producer for: the one form of kv_transfer_params that needs no signature.
REMOTE_DECODE = {"do_remote_decode": True}


class KVAuthError(ValueError):
    """A message, params or a file is not signed with this instance's secret."""


# The least strength a shared secret may have: a guessable one lets anyone forge params, read
# KV off the wire and plant storage files.
MIN_SECRET_BITS = 128


def secret_bits(secret: str) -> float:
    """A generous estimate of a secret's strength: its length times log2 of the alphabet its
    character classes span (a hex token of 32 chars: 165 bits; "s3cret": 31)."""
    classes = ((str.isdigit, 10), (str.islower, 26), (str.isupper, 26))
    pool = sum(size for test, size in classes if any(test(c) for c in secret))
    if any(not (c.isdigit() or c.islower() or c.isupper()) for c in secret):
        pool += 33  # punctuation, spaces, anything else
    if len(set(secret)) < 8:  # "aaaa...": no length makes up for it
        return 0.0
    return len(secret) * math.log2(max(pool, 2))


def check_secret(secret: str) -> None:
    """Raise ConfigError unless `secret` has at least MIN_SECRET_BITS."""
    if secret_bits(secret) < MIN_SECRET_BITS:
        raise ConfigError(
            f"kv_secret is too weak (about {secret_bits(secret):.0f} bits, at least "
            f"{MIN_SECRET_BITS} needed): use a random one, e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(16))'`, shared by the "
            "instances that exchange KV."
        )


def derive_key(secret: str, purpose: str) -> bytes:
    """The key of one use of the shared secret ("params", "wire", "storage", ...). Raises
    ConfigError for a secret weaker than MIN_SECRET_BITS."""
    check_secret(secret)
    return hmac.new(secret.encode(), f"agentrt kv {purpose}".encode(), hashlib.sha256).digest()


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes a MAC covers: JSON with sorted keys and no spaces (one spelling per value)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def mac(key: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 of the parts, each length-prefixed (so parts cannot be re-cut), as hex."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def verify(key: bytes, expected: object, *parts: bytes) -> bool:
    """Whether `expected` is the MAC of the parts (a constant-time comparison). Compared as
    bytes: `compare_digest` raises TypeError on a str that is not ASCII (a client's)."""
    if not isinstance(expected, str):
        return False
    given = expected.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, mac(key, *parts).encode())


class ParamsSigner:
    """Signs and checks `kv_transfer_params` with the key derived from the secret."""

    def __init__(self, secret: str) -> None:
        self._key = derive_key(secret, "params")

    def sign(self, params: dict[str, Any], ttl_s: float) -> dict[str, Any]:
        """`params` with an expiry `ttl_s` from now and the signature over every field."""
        signed = {**params, EXPIRES: round(time.time() + ttl_s, 3)}
        return {**signed, SIGNATURE: mac(self._key, canonical(signed))}

    def verify(self, params: dict[str, Any]) -> dict[str, Any]:
        """The signed fields (without the signature). Raises KVAuthError if the signature
        does not check out (a field added, removed or changed) or the params expired."""
        fields = {k: v for k, v in params.items() if k != SIGNATURE}
        try:
            body = canonical(fields)
        except (TypeError, ValueError) as exc:
            raise KVAuthError(f"they are not plain JSON ({exc})") from None
        if not verify(self._key, params.get(SIGNATURE), body):
            raise KVAuthError(
                "they are not signed by a producer that shares this instance's kv_secret, or "
                "a field was changed"
            )
        expires = fields.get(EXPIRES)
        if not isinstance(expires, int | float) or expires < time.time():
            raise KVAuthError("they expired (the producer has freed the blocks)")
        return fields


def check_client_params(params: dict[str, Any], config: KVTransferConfig | None) -> None:
    """Refuse `kv_transfer_params` this instance must not act on: anything without a p2p
    connector; `{"do_remote_decode": true}` (the one unsigned form) on an instance that
    serves no prefills; anything else unless a producer sharing the secret signed it.
    Raises InvalidRequestError naming the field."""

    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"kv_transfer_params refused: {why}.", field="kv_transfer_params", value=None
        )

    if config is None or config.connector != "p2p":
        raise refuse(
            "this instance runs no p2p KV connector (start it with --kv-connector p2p and "
            "--kv-secret); clients never set this field themselves, a disaggregation proxy does"
        )
    if params == REMOTE_DECODE:
        if not config.saves:
            raise refuse(
                f"do_remote_decode asks a producer, and this one's kv_role is {config.role}"
            )
        return
    if not config.loads:
        raise refuse(f"only a consumer takes a remote prefill; this one's kv_role is {config.role}")
    assert config.secret is not None  # KVTransferConfig requires it for p2p
    try:
        ParamsSigner(config.secret).verify(params)
    except KVAuthError as exc:
        raise refuse(f"{exc}; pass on what the producer returned, unchanged") from None
