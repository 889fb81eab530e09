"""The shared KV secret and the params it signs (kv_transfer/auth.py): a weak secret is refused,
and whatever a client puts in a signature is a 400, never a 500."""

from __future__ import annotations

import secrets
import time

import pytest

from agentrt.engine.args import EngineArgs
from agentrt.engine.errors import ConfigError
from agentrt.engine.kv_transfer.auth import (
    MIN_SECRET_BITS,
    KVAuthError,
    ParamsSigner,
    derive_key,
    secret_bits,
)

SECRET = secrets.token_hex(16)


# 64 random bits (a fixed token_hex(8): xdist workers must collect the same ids).
@pytest.mark.parametrize("weak", ["s3cret", "a" * 64, "0123456789", "9f2c4e07b1d83a65"])
def test_a_weak_secret_is_refused(weak: str) -> None:
    assert secret_bits(weak) < MIN_SECRET_BITS
    with pytest.raises(ConfigError, match="too weak"):
        derive_key(weak, "params")
    with pytest.raises(ConfigError, match="too weak"):
        ParamsSigner(weak)


def test_random_secrets_are_strong_enough() -> None:
    for secret in (secrets.token_hex(16), secrets.token_urlsafe(16), secrets.token_hex(32)):
        assert secret_bits(secret) >= MIN_SECRET_BITS
        derive_key(secret, "params")


@pytest.mark.parametrize("signature", ["é" * 64, "\ud800" * 64, "💥", ""])
def test_a_non_ascii_signature_is_an_auth_error_not_a_type_error(signature: str) -> None:
    # hmac.compare_digest raises TypeError on a str that is not ASCII: it was a 500.
    signer = ParamsSigner(SECRET)
    params = {"remote_key": "0" * 64, "expires": time.time() + 60, "signature": signature}
    with pytest.raises(KVAuthError, match="not signed"):
        signer.verify(params)


def test_the_storage_directory_is_capped_by_default() -> None:
    assert EngineArgs().kv_storage_max_gb is not None and EngineArgs().kv_storage_max_gb > 0
