"""A secret in a file only this user can read: how `pdserve up` hands the operator the
cluster's admin token (LOG_DIR/admin-token) without printing it.

The file is made anew with mode 0600 (`O_EXCL`: never through a file or a link someone
else put there first, which matters for a --log-dir in a shared folder); the secret is
never on a command line or in a log.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_secret(path: Path, secret: str) -> Path:
    """Write `secret` (one line) to `path`, readable and writable by this user only;
    replaces a file of this user's that is there. Raises OSError when it cannot."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return path
