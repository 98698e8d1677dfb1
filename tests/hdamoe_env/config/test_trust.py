"""Consent before loading files that can run code (hdamoe_env/config/trust.py)."""

from __future__ import annotations

import os
import stat

import pytest

from hdamoe_env.config import trust
from hdamoe_env.config.errors import UntrustedFileError


def _signed(tmp_path, data=b"model bytes"):
    path = tmp_path / "model.zip"
    path.write_bytes(data)
    trust.write_signature(path, data)
    return path


def test_signed_file_verifies_and_any_change_is_refused(tmp_path):
    path = _signed(tmp_path)
    trust.verify_file(path)                                   # signed by this key: fine
    path.write_bytes(b"model bytes, edited")
    with pytest.raises(UntrustedFileError, match="does not match"):
        trust.verify_file(path)
    trust.verify_file(path, trust=True)                       # explicit consent


def test_unsigned_file_needs_consent(tmp_path):
    path = tmp_path / "evil.zip"
    path.write_bytes(b"PK")
    with pytest.raises(UntrustedFileError, match="--trust-model"):
        trust.verify_file(path)
    with trust.consent():
        trust.verify_file(path)
    with pytest.raises(UntrustedFileError):
        trust.verify_file(path)                               # consent ends with the block
    with trust.consent(False):
        with pytest.raises(UntrustedFileError):
            trust.verify_file(path)


def test_signature_of_another_key_is_refused(tmp_path, monkeypatch):
    path = _signed(tmp_path)
    monkeypatch.setenv(trust.KEY_ENV, "someone else's key")
    with pytest.raises(UntrustedFileError, match="another user"):
        trust.verify_file(path)


def test_recomputed_hash_sidecar_does_not_help(tmp_path):
    import hashlib
    import json

    path = tmp_path / "model.zip"
    path.write_bytes(b"crafted")
    sig = trust.signature_path(path)
    sig.write_text(json.dumps({"hmac_sha256": hashlib.sha256(b"crafted").hexdigest()}))
    with pytest.raises(UntrustedFileError):
        trust.verify_file(path)


def test_key_file_is_created_private_once(tmp_path, monkeypatch):
    monkeypatch.delenv(trust.KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    key = trust.signing_key()
    path = trust.key_path()
    assert path == tmp_path / "cfg" / "hdamoe-env" / "signing.key" and len(key) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert trust.signing_key() == key
