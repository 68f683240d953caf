"""A key no learner kernel can read: what ``grade --resume`` may trust, and which cases the grader draws.

A kernel could forge a results file (or an attacker leave one where the grader writes). So the grader signs
the results it writes with an HMAC-SHA256 key kept in the instructor's HOME (``~/.config/gpipe_ref/grader.key``,
mode 0600, made on first use; ``GPIPE_GRADER_KEY`` names another file); a sandboxed kernel sees neither that
HOME nor the file. ``--resume`` keeps only the results whose signature checks. The same key seeds the
cases drawn for each submission (:func:`draw_seed`), so their inputs cannot be known before they are sent.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["draw_seed", "key_file", "sign", "signed", "verified"]

FIELD = "signature"


def key_file() -> Path:
    """Where the grader's key lives: ``GPIPE_GRADER_KEY``, else ``~/.config/gpipe_ref/grader.key``."""
    return Path(os.environ.get("GPIPE_GRADER_KEY") or Path.home() / ".config" / "gpipe_ref" / "grader.key")


def _key() -> bytes:
    path = key_file()
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # refuses a file put there meanwhile
    with os.fdopen(handle, "w") as out:
        out.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


def sign(results: Any) -> str:
    """The HMAC-SHA256 of ``results`` in a canonical JSON form."""
    text = json.dumps(results, sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(_key(), text.encode(), hashlib.sha256).hexdigest()


def draw_seed(*parts: str) -> int:
    """A seed for the cases drawn for ``parts`` (an exercise, a submission's digest): the same submission
    draws the same cases at every run of this grader, and no kernel, without the key, can know them."""
    digest = hmac.new(_key(), "\0".join(("drawn cases", *parts)).encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big")


def signed(summary: dict) -> dict:
    """``summary`` with its signature over everything but the signature."""
    body = {k: v for k, v in summary.items() if k != FIELD}
    return {**body, FIELD: sign(body)}


def verified(summary: Any) -> bool:
    """Whether ``summary`` carries this grader's signature over the rest of it."""
    if not isinstance(summary, dict) or not isinstance(summary.get(FIELD), str):
        return False
    body = {k: v for k, v in summary.items() if k != FIELD}
    return hmac.compare_digest(summary[FIELD], sign(body))
