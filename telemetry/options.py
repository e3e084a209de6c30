"""Environment variables as option defaults: every `--some-option` of every `pdserve`
subcommand can also be set as `PDSERVE_SOME_OPTION`; the command line wins.

Read when a parser is built (at run time), never at import.
"""

from __future__ import annotations

from collections.abc import Mapping

# The shared secret of the internal control API and the KV transfer handshake.
INTERNAL_TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"

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
