"""Where `pdserve drill` finds the cluster's Redis for its audit log: the option, the
environment, the file `pdserve up` wrote, with the password from the environment put in
as every CLI does."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from drill.cli import redis_url_of


def test_the_option_then_the_environment_then_the_log_dir(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    for name in ("PDSERVE_REDIS_URL", "PDSERVE_REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(redis_url=None)
    assert redis_url_of(args, tmp_path) is None  # nothing known: no audit log
    (tmp_path / "redis-url").write_text("redis://:up-secret@127.0.0.1:7000/0\n")
    assert redis_url_of(args, tmp_path) == "redis://:up-secret@127.0.0.1:7000/0"
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://127.0.0.1:7001/0")
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", "env-secret")
    assert redis_url_of(args, tmp_path) == "redis://:env-secret@127.0.0.1:7001/0"
    args.redis_url = "redis://:given@127.0.0.1:7002/0"
    assert redis_url_of(args, tmp_path) == "redis://:given@127.0.0.1:7002/0"
