"""`pdserve agent` refuses bad option values before it connects to anything: exit code 2
and one line that names the option; `--help` explains every option."""

from __future__ import annotations

import pytest

from launcher.cli import build_parser, main

BASE = ["agent", "--redis-url", "redis://127.0.0.1:1/0", "--port", "0"]


@pytest.mark.parametrize("args, message", [
    (["--period-s", "0"], "--period-s must be in (0, 60]"),
    (["--slow-factor", "1"], "--slow-factor must be > 1"),
    (["--leak-after-s", "0.5"], "--leak-after-s must be in [1, 3600]"),
    (["--error-rate", "1.5"], "--error-rate must be in (0, 1]"),
    (["--error-min-requests", "0"], "--error-min-requests must be >= 1"),
    (["--max-eject-fraction", "0"], "--max-eject-fraction must be in (0, 1]"),
    (["--probation-s", "-1"], "--probation-s must be > 0"),
    (["--eject-hold-s", "5"], "--eject-hold-s must be >= 10"),
    (["--hung-after-s", "0"], "--hung-after-s must be > 0"),
    (["--slow-for-s", "0"], "--slow-for-s must be in (0, 600]"),
])
def test_out_of_range_values_exit_2_naming_the_option(args, message, capsys) -> None:
    assert main(BASE + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("args, option", [
    (["--period-s", "soon"], "--period-s"),
    (["--restart", "reboot"], "--restart"),
    (["--rebalance", "maybe"], "--rebalance"),
])
def test_values_of_the_wrong_type_are_usage_errors(args, option, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(BASE + args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and option in err


def test_a_missing_redis_url_is_explained(capsys, monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    assert main(["agent"]) == 2
    assert "--redis-url" in capsys.readouterr().err


def test_help_explains_every_option() -> None:
    parser = build_parser()
    agent = parser._subparsers._group_actions[0].choices["agent"]  # type: ignore[union-attr]
    for action in agent._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings


def test_local_restarts_need_the_supervisor_that_started_the_workers(capsys) -> None:
    """`--restart local` goes through `pdserve up`'s restart line, never a pid: without the
    line (given by `pdserve up` alone) the agent does not start."""
    assert main(BASE + ["--restart", "local"]) == 2
    err = capsys.readouterr().err
    assert "--restart local" in err and "supervisor" in err and err.count("\n") == 1
