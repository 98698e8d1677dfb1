"""Consent before loading a file that can run code: HMAC signatures of the models this package wrote.

Loading a Stable-Baselines3 ``.zip`` unpickles parts of it, so a crafted file runs code. A SHA-256
recorded next to the model only catches accidents (whoever replaces the model can rewrite the
hash). Every model and checkpoint this package writes is therefore signed with an HMAC-SHA256
under a per-user key kept outside the run directory, and a model is loaded only when

* its signature (``<file>.sig`` beside it) verifies under this user's key: the file was written
  by this package for this user; or
* the caller consents explicitly: ``trust=True`` in the Python API, ``--trust-model`` on the
  command line (:func:`consent`). Consent means "I know where this file comes from; loading it
  may run code from it with my permissions".

Otherwise :class:`~hdamoe_env.config.errors.UntrustedFileError` is raised before the file is
opened by SB3.

The key is ``$HDAMOE_SIGNING_KEY`` when set (any text; tests and shared CI runners set it), else
the file ``$XDG_CONFIG_HOME/hdamoe-env/signing.key`` (default ``~/.config``), 32 random bytes
created with mode 0600 on first use. Copying a run to another user or machine therefore needs
``--trust-model`` once there (or the same key).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from hdamoe_env.config.errors import UntrustedFileError

__all__ = ["KEY_ENV", "consent", "consented", "key_path", "sign_bytes", "signature_path",
           "signing_key", "verify_file", "write_signature"]

#: Environment variable whose text, when set, is the signing key.
KEY_ENV = "HDAMOE_SIGNING_KEY"
_FORMAT = "hdamoe-signature"
_CONSENT: contextvars.ContextVar[bool] = contextvars.ContextVar("hdamoe_trust", default=False)


def key_path() -> Path:
    """Return the path of the per-user key file (``$XDG_CONFIG_HOME/hdamoe-env/signing.key``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "hdamoe-env" / "signing.key"


def signing_key() -> bytes:
    """Return this user's signing key, creating the key file (mode 0600) on first use.

    Raises:
        UntrustedFileError: The key file cannot be created or read (the message says where).
    """
    text = os.environ.get(KEY_ENV)
    if text:
        return text.encode("utf-8")
    path = key_path()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise UntrustedFileError(f"cannot read the signing key {str(path)!r} ({exc.strerror}); "
                                 f"fix its permissions or set {KEY_ENV}") from None
    key = secrets.token_bytes(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:                         # another process created it first
        return path.read_bytes()
    except OSError as exc:
        raise UntrustedFileError(f"cannot create the signing key {str(path)!r} "
                                 f"({exc.strerror}); set {KEY_ENV} or XDG_CONFIG_HOME") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(key)
    return key


def sign_bytes(data: bytes, key: bytes | None = None) -> str:
    """Return the hex HMAC-SHA256 of ``data`` under ``key`` (default: :func:`signing_key`)."""
    return hmac.new(signing_key() if key is None else key, data, hashlib.sha256).hexdigest()


def _file_hmac(path: Path, key: bytes) -> str:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            mac.update(block)
    return mac.hexdigest()


def signature_path(path: str | os.PathLike[str]) -> Path:
    """Return the signature file of ``path`` (``model.zip`` -> ``model.zip.sig``)."""
    path = Path(path)
    return path.with_name(path.name + ".sig")


def write_signature(path: str | os.PathLike[str], data: bytes) -> Path:
    """Sign the bytes written to ``path`` and store the signature beside it.

    Args:
        path: The file that holds ``data``.
        data: Its content.

    Returns:
        The signature file.
    """
    from hdamoe_env.config.fileio import atomic_write

    record = {"format": _FORMAT, "hmac_sha256": sign_bytes(data), "file": Path(path).name}
    text = json.dumps(record, indent=1) + "\n"
    return atomic_write(signature_path(path), lambda fh: fh.write(text))


@contextlib.contextmanager
def consent(given: bool = True) -> Iterator[None]:
    """Within the block, loading unsigned models is allowed when ``given`` (``--trust-model``)."""
    token = _CONSENT.set(bool(given) or _CONSENT.get())
    try:
        yield
    finally:
        _CONSENT.reset(token)


def consented() -> bool:
    """Return whether the caller consented to loading unsigned models (:func:`consent`)."""
    return _CONSENT.get()


def verify_file(path: str | os.PathLike[str], *, trust: bool = False,
                what: str = "model") -> None:
    """Allow loading ``path`` only when it is signed by this user's key, or with consent.

    Args:
        path: A file that can run code when loaded (an SB3 ``.zip``).
        trust: Explicit consent (``trust=True`` / ``--trust-model``): the file may run code.
        what: What the file is, for the message.

    Raises:
        UntrustedFileError: No signature, a signature of another key, or a file changed after
            signing; and no consent.
    """
    if trust or consented():
        return
    path = Path(path)
    sig = signature_path(path)
    reason = ""
    try:
        record = json.loads(sig.read_text())
        expected = str(record["hmac_sha256"]) if isinstance(record, dict) else ""
    except FileNotFoundError:
        reason = f"it has no signature ({sig.name}): it was not written by hdamoe-env for you"
    except (OSError, ValueError, KeyError):
        reason = f"its signature {sig.name} is unreadable"
    else:
        if not hmac.compare_digest(_file_hmac(path, signing_key()), expected):
            reason = ("its signature does not match (the file changed after it was written, or "
                      "another user or machine signed it)")
    if reason:
        raise UntrustedFileError(
            f"{what} {str(path)!r} is not loaded: {reason}. Loading an SB3 model runs code from "
            "the file; if you trust its origin, pass --trust-model (Python: trust=True)")
