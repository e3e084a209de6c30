"""Workload specs: request classes with length distributions, tiers, shared prefixes, SLOs.

A workload is a small TOML file (presets ship in `bench/presets/`):

    name = "mixed"
    description = "interactive chat plus batch summarization"
    attainment_target = 0.9            # optional; --attainment-target overrides

    [slo.interactive]                  # optional; per-tier targets, see slo.py for defaults
    ttft_ms = 250
    tpot_ms = 50

    [[classes]]
    name = "chat"
    weight = 3                         # relative share of requests
    tier = "interactive"               # sent as the x-pdserve-tier header ...
    api_key = "sk-interactive"         # ... or, when set, as `Authorization: Bearer` instead
    input_len = { kind = "lognormal", mean = 120, sd = 60, min = 8, max = 1024 }
    output_len = { kind = "uniform", low = 64, high = 192 }
    shared_prefix_fraction = 0.0       # share of this class's requests that open with a
    prefix_len = 0                     #   shared prefix of prefix_len tokens, drawn from
    num_prefixes = 1                   #   num_prefixes distinct documents
    turns = 1                          # > 1: requests are turns of conversations, each
    num_conversations = 1              #   resending its history (bench/planner.py); this
                                       #   many run at once, each `turns` turns long

Lengths are in tokens. `input_len = 128` is short for `{ kind = "fixed", value = 128 }`.
A lognormal is given by the mean and standard deviation of the length itself (not of its
log): sigma^2 = ln(1 + sd^2/mean^2), mu = ln(mean) - sigma^2/2. Every sample is rounded and
clamped to [min, max].
"""

from __future__ import annotations

import importlib.resources
import math
import random
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from bench.slo import SLOTarget

PRESET_PACKAGE = "bench.presets"


class LengthDist(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Literal["fixed", "uniform", "lognormal"]
    value: int | None = None        # fixed
    low: int | None = None          # uniform, inclusive
    high: int | None = None
    mean: float | None = None       # lognormal: of the length itself
    sd: float | None = None
    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        needed = {"fixed": ("value",), "uniform": ("low", "high"),
                  "lognormal": ("mean", "sd")}[self.kind]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{self.kind} length needs {', '.join(missing)}")
        if self.min < 1 or (self.max is not None and self.max < self.min):
            raise ValueError(f"length bounds must satisfy 1 <= min <= max, got {self}")
        if self.kind == "uniform" and self.low > self.high:  # type: ignore[operator]
            raise ValueError(f"uniform length needs low <= high, got {self}")
        if self.kind == "lognormal" and (self.mean <= 0 or self.sd < 0):  # type: ignore[operator]
            raise ValueError(f"lognormal length needs mean > 0 and sd >= 0, got {self}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            raw = float(self.value)  # type: ignore[arg-type]
        elif self.kind == "uniform":
            raw = float(rng.randint(self.low, self.high))  # type: ignore[arg-type]
        else:
            mean, sd = float(self.mean), float(self.sd)  # type: ignore[arg-type]
            sigma2 = math.log1p((sd / mean) ** 2)
            raw = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
        length = max(self.min, int(round(raw)))
        return length if self.max is None else min(self.max, length)


class RequestClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    input_len: LengthDist
    output_len: LengthDist
    weight: float = 1.0
    tier: str = "standard"
    api_key: str | None = None
    shared_prefix_fraction: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 1
    turns: int = 1
    num_conversations: int = 1

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"class {self.name}: weight must be > 0")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError(f"class {self.name}: shared_prefix_fraction must be in [0, 1]")
        if self.shared_prefix_fraction > 0 and self.prefix_len < 1:
            raise ValueError(f"class {self.name}: a shared prefix needs prefix_len >= 1")
        if self.num_prefixes < 1:
            raise ValueError(f"class {self.name}: num_prefixes must be >= 1")
        if self.turns < 1 or self.num_conversations < 1:
            raise ValueError(f"class {self.name}: turns and num_conversations must be >= 1")
        if self.turns > 1 and self.shared_prefix_fraction > 0:
            raise ValueError(f"class {self.name}: a conversation opens with its own history, "
                             "not a shared prefix (turns > 1 with shared_prefix_fraction)")


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    classes: list[RequestClass]
    description: str = ""
    slo: dict[str, SLOTarget] = {}
    attainment_target: float | None = None

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError(f"workload {self.name}: needs at least one [[classes]] entry")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"workload {self.name}: class names must be unique: {names}")
        if self.attainment_target is not None and not 0 < self.attainment_target <= 1:
            raise ValueError(f"workload {self.name}: attainment_target must be in (0, 1]")

    @property
    def tiers(self) -> list[str]:
        return sorted({c.tier for c in self.classes})


def _normalize_lengths(raw: dict) -> dict:
    """Accept the `input_len = 128` shorthand for a fixed length."""
    for cls in raw.get("classes", []):
        for key in ("input_len", "output_len"):
            if isinstance(cls.get(key), int):
                cls[key] = {"kind": "fixed", "value": cls[key]}
    return raw


def parse_workload(text: str, source: str = "<string>") -> Workload:
    try:
        raw = tomllib.loads(text)
        return msgspec.convert(_normalize_lengths(raw), Workload)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"workload {source}: {exc}") from None


def preset_names() -> list[str]:
    files = importlib.resources.files(PRESET_PACKAGE).iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".toml"))


def load_workload(name_or_path: str) -> Workload:
    """A preset name (`chat`, `rag`, `mixed`, `steady`, `multi_turn`, `long_chat`,
    `shared_corpus`) or a path to a TOML file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return parse_workload(path.read_text(encoding="utf-8"), str(path))
    if name_or_path not in preset_names():
        raise ValueError(f"no workload file or preset {name_or_path!r}; "
                         f"presets: {', '.join(preset_names())}")
    resource = importlib.resources.files(PRESET_PACKAGE) / f"{name_or_path}.toml"
    return parse_workload(resource.read_text(encoding="utf-8"), f"preset {name_or_path}")
