"""`pdserve gateway` refuses bad option values before it connects to anything: exit code 2
and one line that names the option."""

from __future__ import annotations

import pytest

from launcher.cli import main

# A Redis URL nothing listens on: reaching it would fail differently (exit code 1).
BASE = ["gateway", "--redis-url", "redis://127.0.0.1:1/0", "--port", "0"]


@pytest.mark.parametrize("args, message", [
    (["--kv-wait-s", "-1"], "--kv-wait-s must be within 0..600"),
    (["--kv-wait-s", "600.5"], "--kv-wait-s must be within 0..600"),
    (["--expect-workers", "-3"], "--expect-workers must be >= 0"),
    (["--worker-wait-s", "-0.5"], "--worker-wait-s must be >= 0"),
    (["--max-attempts", "0"], "--max-attempts"),
    (["--replicas", "0"], "--replicas must be >= 1"),
])
def test_out_of_range_values_exit_2_naming_the_option(args, message, capsys) -> None:
    assert main(BASE + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("args, option", [
    (["--kv-wait-s", "soon"], "--kv-wait-s"),
    (["--expect-workers", "2.5"], "--expect-workers"),
    (["--admission", "loose"], "--admission"),
    (["--shared-limits", "maybe"], "--shared-limits"),
    (["--replicas", "two"], "--replicas"),
])
def test_values_of_the_wrong_type_are_usage_errors(args, option, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(BASE + args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and option in err


def test_a_missing_redis_url_is_explained(capsys, monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    assert main(["gateway", "--port", "0"]) == 2
    assert "--redis-url (or PDSERVE_REDIS_URL) is required" in capsys.readouterr().err
