"""Environment variables as option defaults: every `--some-option` of every `pdserve`
subcommand can also be set as `PDSERVE_SOME_OPTION`; the command line wins.

`EnvOptions` is the one way a CLI adds such options (`add`, `flag`); each option's help
ends with the variable's name. Read when a parser is built (at run time), never at import.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

# The shared secret of the internal control API and the KV transfer handshake.
INTERNAL_TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
# The gateway's /admin API (gateway/ops/admin_access.py): held by the gateways and the
# operator only, never by a worker or the agent.
ADMIN_TOKEN_ENV = "PDSERVE_ADMIN_TOKEN"
# What `pdserve up` writes into its log folder for the operator (mode 0600,
# launcher/secret_file.py): the admin token it generated, and its Redis's admin URL.
ADMIN_TOKEN_FILE = "admin-token"
REDIS_URL_FILE = "redis-url"
# The Redis password, for a --redis-url that carries none (state/redis_access.py). Read from
# the environment only, never an option: a command line is readable by every local process.
REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
# The help of --redis-url for the processes that need one, and of --redis-insecure, the same
# in every CLI that takes --redis-url.
REDIS_URL_HELP = ("Redis of the cluster (required), e.g. redis://:PASSWORD@127.0.0.1:6379/0 "
                  f"(the password may come from {REDIS_PASSWORD_ENV} instead)")
REDIS_INSECURE_HELP = ("use a Redis that answers without a password, with a warning (refused "
                       "by default: whoever reaches it can register workers that receive "
                       "the internal token and users' prompts)")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def env_name(option: str) -> str:
    """`--redis-url` -> `PDSERVE_REDIS_URL`."""
    return "PDSERVE_" + option.lstrip("-").replace("-", "_").upper()


def env_default(env: Mapping[str, str], option: str, default: str | None = None) -> str | None:
    """The PDSERVE_<OPTION> value for `--option`, else `default`."""
    return env.get(env_name(option), default)


def env_flag(env: Mapping[str, str], option: str) -> bool:
    """A boolean flag's default from the environment: 1/true/yes/on or 0/false/no/off/empty
    (any case); anything else is an error, so a typo never silently turns a flag on."""
    raw = env.get(env_name(option))
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SystemExit(f"pdserve: {env_name(option)}={raw!r} is not a boolean "
                     "(use 1/true/yes/on or 0/false/no/off)")


class EnvOptions:
    """Adds options to `parser` whose defaults come from the environment (`env`, default
    os.environ), each help text ending with the variable that sets it."""

    def __init__(self, parser: argparse.ArgumentParser,
                 env: Mapping[str, str] | None = None) -> None:
        self.parser = parser
        self.env = os.environ if env is None else env

    def add(self, option: str, default: object = None, *, help: str, secret: bool = False,
            show_default: bool = False, **argparse_kwargs: object) -> None:
        """`--option` with PDSERVE_OPTION as its default when set. `secret`: --help never
        shows its value; `show_default`: --help shows the default (else the help says it)."""
        shown = "; default: %(default)s" if show_default and not secret else ""
        self.parser.add_argument(option, default=self.env.get(env_name(option), default),
                                 help=f"{help} [env {env_name(option)}{shown}]",
                                 **argparse_kwargs)  # type: ignore[arg-type]

    def flag(self, option: str, *, help: str) -> None:
        """A boolean `--option`, on when given or when PDSERVE_OPTION is true."""
        self.parser.add_argument(option, action="store_true",
                                 default=env_flag(self.env, option),
                                 help=f"{help} [env {env_name(option)}=1]")
