"""SLO tiers and API keys: the tiers file, `resolve` (pure) from a key and tier header to
the caller, and `classify` (pure) from the caller and the prompt to how it is served.

Tiers file (TOML, `--tiers`); every table and field is optional:

    default_tier = "standard"          # tier of requests whose key names none

    [tiers.interactive]                # overrides fields of a built-in tier ...
    ttft_ms = 300
    [tiers.gold]                       # ... or defines a new one (then every field is needed)
    priority = 0                       # smaller is served first
    ttft_ms = 200                      # time-to-first-token target
    tpot_ms = 40                       # time-per-output-token target
    max_queued = 32                    # requests waiting for admission, per tier
    max_wait_ms = 300000               # how long one may wait for admission before a 429;
                                       #   omitted: ttft_ms (a request that cannot start
                                       #   within its TTFT target is turned away at once)
    max_running = 128                  # requests admitted and not finished, per tier
    tokens_per_min = 200000            # per API key, prompt + max_tokens; omit: no limit
    local_prefill_max_tokens = 256     # optional override: shorter prompts are prefilled by
                                       #   their decode worker, longer ones on the prefill
                                       #   pool; omitted: the router predicts per request

    [[keys]]
    key = "sk-..."                     # or key_env = "NAME": read the key from the environment
    name = "alice"                     # shown in logs and metrics instead of the key
    tier = "interactive"
    allow_tier_header = false          # may pick its tier with the `x-pdserve-tier` header
    admin = false                      # may call /admin/*

Keys also come from the environment: `PDSERVE_API_KEYS="KEY[:TIER[:FLAGS]],..."` with
FLAGS a `+`-joined subset of `header`, `admin`. The loader is handed the environment as a
mapping; nothing here reads `os.environ`.

With no keys configured the API is open: any (or no) key is accepted, the tier header is
honoured, and every caller is an admin. Keys are held only as SHA-256 digests, so a
lookup does not compare secrets byte by byte.
"""

from __future__ import annotations

import enum
import hashlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import TypeVar

from gateway.routing.plan_model import Targets

T = TypeVar("T")
TIER_HEADER = "x-pdserve-tier"
KEYS_ENV = "PDSERVE_API_KEYS"


class TierConfigError(ValueError):
    """The tiers file or the key environment variable is invalid (a start-up error)."""


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    priority: int  # smaller is served first
    ttft_ms: float
    tpot_ms: float
    max_queued: int
    max_running: int
    tokens_per_min: int | None  # per API key; None: unlimited
    local_prefill_max_tokens: int | None = None  # None: the router decides (gateway/routing/router.py)
    # How long a request may wait for admission; None: ttft_ms. Longer than ttft_ms, a
    # request the queue cannot start in time is served late instead of refused (429).
    max_wait_ms: float | None = None

    @property
    def wait_limit_ms(self) -> float:
        return self.ttft_ms if self.max_wait_ms is None else self.max_wait_ms

    def __post_init__(self) -> None:
        if not self.name:
            raise TierConfigError("a tier needs a name")
        for name in ("ttft_ms", "tpot_ms", "max_wait_ms"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise TierConfigError(f"tier {self.name}: {name} must be positive")
        for name in ("max_queued", "max_running", "local_prefill_max_tokens"):
            if (getattr(self, name) or 0) < 0:
                raise TierConfigError(f"tier {self.name}: {name} must be >= 0")
        if self.tokens_per_min is not None and self.tokens_per_min <= 0:
            raise TierConfigError(f"tier {self.name}: tokens_per_min must be positive or omitted")


# Interactive requests that cannot start within their TTFT target are refused at once
# (429): a late answer is of no use to a person waiting. Standard and batch requests wait
# up to five and ten minutes for admission: a burst is served late, not refused.
DEFAULT_TIERS: tuple[TierSpec, ...] = (
    TierSpec("interactive", priority=0, ttft_ms=500, tpot_ms=50, max_queued=64,
             max_running=256, tokens_per_min=None),
    TierSpec("standard", priority=1, ttft_ms=2_000, tpot_ms=100, max_queued=256,
             max_running=256, tokens_per_min=None, max_wait_ms=300_000),
    TierSpec("batch", priority=2, ttft_ms=60_000, tpot_ms=500, max_queued=4_096,
             max_running=128, tokens_per_min=None, max_wait_ms=600_000),
)


@dataclass(frozen=True, slots=True)
class KeyGrant:
    key_id: str  # a name safe to log
    tier: str
    allow_tier_header: bool = False
    is_admin: bool = False


@dataclass(frozen=True, slots=True)
class TierConfig:
    tiers: Mapping[str, TierSpec]
    default_tier: str
    keys: Mapping[str, KeyGrant]  # SHA-256 hex digest of the key -> grant

    def __post_init__(self) -> None:
        if self.default_tier not in self.tiers:
            raise TierConfigError(f"default_tier {self.default_tier!r} is not a tier "
                                  f"(tiers: {', '.join(sorted(self.tiers))})")
        for grant in self.keys.values():
            if grant.tier not in self.tiers:
                raise TierConfigError(f"key {grant.key_id}: unknown tier {grant.tier!r}")

    @property
    def is_open(self) -> bool:
        return not self.keys

    @property
    def strictest_tpot_ms(self) -> float:
        """The smallest TPOT target of any tier: what the requests already running need."""
        return min(t.tpot_ms for t in self.tiers.values())


class TierErrorKind(enum.Enum):
    """Why a caller has no tier; the value is the OpenAI error `code`."""

    MISSING_KEY = "missing_api_key"
    INVALID_KEY = "invalid_api_key"
    UNKNOWN_TIER = "invalid_tier"
    TIER_NOT_ALLOWED = "tier_not_allowed"

    @property
    def status(self) -> int:
        return 401 if self in (TierErrorKind.MISSING_KEY, TierErrorKind.INVALID_KEY) else 400


@dataclass(frozen=True, slots=True)
class TierError:
    kind: TierErrorKind
    message: str


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as its API key and tier header say."""

    tier: TierSpec
    key_id: str | None  # None: open API
    is_admin: bool


@dataclass(frozen=True, slots=True)
class TierDecision:
    """How one request is served: everything the rest of the gateway reads of its tier,
    computed once here."""

    tier: TierSpec
    key_id: str | None  # None: open API
    local_prefill: bool | None  # the tier's override (True: shorter than its threshold,
    # False: not), or None: no threshold set, the router decides
    targets: Targets  # what the router plans for (gateway/routing/plan_model.py)
    wire_priority: int  # the protocol's priority: larger runs first (a tier's smaller first)


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


def resolve(api_key: str | None, tier_header: str | None,
            config: TierConfig) -> Caller | TierError:
    """The caller's tier, key id and rights; side-effect free. Runs before the body is read,
    so a caller without a valid key learns it before sending a large body."""
    grant = None
    if not config.is_open:
        if not api_key:
            return TierError(TierErrorKind.MISSING_KEY,
                             "You didn't provide an API key (Authorization: Bearer <key>).")
        grant = config.keys.get(hash_key(api_key))
        if grant is None:
            return TierError(TierErrorKind.INVALID_KEY, "Incorrect API key provided.")
    tier_name = grant.tier if grant is not None else config.default_tier
    if tier_header is not None:
        if tier_header not in config.tiers:
            return TierError(TierErrorKind.UNKNOWN_TIER,
                             f"Unknown tier {tier_header!r} in {TIER_HEADER}; tiers: "
                             f"{', '.join(sorted(config.tiers))}.")
        if grant is not None and not grant.allow_tier_header:
            return TierError(TierErrorKind.TIER_NOT_ALLOWED,
                             f"This API key may not choose its tier with {TIER_HEADER}.")
        tier_name = tier_header
    return Caller(tier=config.tiers[tier_name], key_id=grant.key_id if grant else None,
                  is_admin=grant.is_admin if grant else config.is_open)


def classify(caller: Caller, prompt_len: int, max_tokens: int,
             config: TierConfig) -> TierDecision:
    """How a request of `prompt_len` tokens asking for up to `max_tokens` from `caller` is
    served; side-effect free."""
    tier = caller.tier
    threshold = tier.local_prefill_max_tokens
    targets = Targets(ttft_s=tier.ttft_ms / 1000, tpot_s=tier.tpot_ms / 1000,
                      strictest_tpot_s=config.strictest_tpot_ms / 1000,
                      max_tokens=max(1, max_tokens))
    return TierDecision(tier=tier, key_id=caller.key_id,
                        local_prefill=None if threshold is None else prompt_len < threshold,
                        targets=targets, wire_priority=-tier.priority)


# ---------------------------------------------------------------- loading

_TIER_FIELDS = {f.name: f.type for f in fields(TierSpec) if f.name != "name"}
_KEY_FIELDS = {"key", "key_env", "name", "tier", "allow_tier_header", "admin"}


def load_tier_config(toml_text: str | None, env: Mapping[str, str]) -> TierConfig:
    """Built-in tiers, overridden by `toml_text` (None: no file), plus keys from `env`."""
    try:
        doc = tomllib.loads(toml_text) if toml_text else {}
    except tomllib.TOMLDecodeError as exc:
        raise TierConfigError(f"tiers file: {exc}") from exc
    _check_keys(doc, {"default_tier", "tiers", "keys"}, "tiers file")
    tiers = {t.name: t for t in DEFAULT_TIERS}
    for name, table in _typed(doc.get("tiers", {}), dict, "tiers").items():
        tiers[name] = _load_tier(name, _typed(table, dict, f"tiers.{name}"), tiers.get(name))
    default_tier = _typed(doc.get("default_tier", "standard"), str, "default_tier")
    keys: dict[str, KeyGrant] = {}
    for i, entry in enumerate(_typed(doc.get("keys", []), list, "keys")):
        secret, grant = _load_key(_typed(entry, dict, f"keys[{i}]"), i, env)
        _add_key(keys, secret, grant)
    for secret, grant in _env_keys(env.get(KEYS_ENV, ""), default_tier):
        _add_key(keys, secret, grant)
    return TierConfig(tiers=MappingProxyType(tiers), default_tier=default_tier,
                      keys=MappingProxyType(keys))


def _load_tier(name: str, table: dict, base: TierSpec | None) -> TierSpec:
    _check_keys(table, set(_TIER_FIELDS), f"tiers.{name}")
    if base is None:
        missing = sorted(set(_TIER_FIELDS) - set(table)
                         - {"tokens_per_min", "local_prefill_max_tokens", "max_wait_ms"})
        if missing:
            raise TierConfigError(f"tiers.{name} is a new tier and needs: {', '.join(missing)}")
        base = TierSpec(name, priority=0, ttft_ms=1, tpot_ms=1, max_queued=0, max_running=0,
                        tokens_per_min=None)
    for field_name, value in table.items():
        number_types = (int, float) if field_name.endswith("_ms") else (int,)
        if isinstance(value, bool) or not isinstance(value, number_types):
            raise TierConfigError(f"tiers.{name}.{field_name} must be a number, got {value!r}")
    return replace(base, **table)


def _load_key(entry: dict, index: int, env: Mapping[str, str]) -> tuple[str, KeyGrant]:
    where = f"keys[{index}]"
    _check_keys(entry, _KEY_FIELDS, where)
    if ("key" in entry) == ("key_env" in entry):
        raise TierConfigError(f"{where} needs exactly one of `key` and `key_env`")
    if "key_env" in entry:
        var = _typed(entry["key_env"], str, f"{where}.key_env")
        if not env.get(var):
            raise TierConfigError(f"{where}: environment variable {var} is unset or empty")
        secret = env[var]
    else:
        secret = _typed(entry["key"], str, f"{where}.key")
    if "tier" not in entry:
        raise TierConfigError(f"{where} needs `tier`")
    return secret, KeyGrant(
        key_id=_typed(entry.get("name", _default_key_id(secret)), str, f"{where}.name"),
        tier=_typed(entry["tier"], str, f"{where}.tier"),
        allow_tier_header=_typed(entry.get("allow_tier_header", False), bool,
                                 f"{where}.allow_tier_header"),
        is_admin=_typed(entry.get("admin", False), bool, f"{where}.admin"))


def _env_keys(value: str, default_tier: str) -> list[tuple[str, KeyGrant]]:
    out = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        secret, _, rest = item.partition(":")
        tier, _, flags_text = rest.partition(":")
        flags = set(filter(None, flags_text.split("+")))
        if not secret or flags - {"header", "admin"}:
            raise TierConfigError(f"{KEYS_ENV}: bad entry (KEY[:TIER[:header+admin]]): "
                                  f"{_redact(item)}")
        out.append((secret, KeyGrant(key_id=_default_key_id(secret), tier=tier or default_tier,
                                     allow_tier_header="header" in flags,
                                     is_admin="admin" in flags)))
    return out


def _add_key(keys: dict[str, KeyGrant], secret: str, grant: KeyGrant) -> None:
    if not secret:
        raise TierConfigError(f"key {grant.key_id}: empty key")
    digest = hash_key(secret)
    if digest in keys:
        raise TierConfigError(f"key {grant.key_id} is configured twice")
    keys[digest] = grant


def _default_key_id(secret: str) -> str:
    return "key-" + hash_key(secret)[:8]


def _redact(text: str) -> str:
    return text[:3] + "…" if len(text) > 3 else "…"


def _check_keys(table: dict[str, object], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise TierConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                              f"allowed: {', '.join(sorted(allowed))}")


def _typed(value: object, expected: type[T], where: str) -> T:
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise TierConfigError(f"{where} must be {expected.__name__}, got {type(value).__name__}")
    return value  # isinstance checked above
