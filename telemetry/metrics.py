"""A small Prometheus text-format registry: counters, gauges and histograms with labels.

Each process builds its own `MetricsRegistry` (no global default registry), registers its
metrics once at start-up and renders them on GET /metrics. Values are plain floats updated
from the event loop thread; nothing here locks.

Exposition format 0.0.4: `# HELP`, `# TYPE`, then one sample per label set; a histogram
renders cumulative `_bucket{le=...}` samples, `_sum` and `_count`.

Invariants: metric names are unique in a registry and start with the registry's prefix;
a labelled sample always carries exactly the metric's label names; counters never decrease.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LabelValues = tuple[str, ...]
DEFAULT_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                           2.5, 5.0, 10.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(names: Sequence[str], values: Sequence[str],
                   extra: tuple[str, str] | None = None) -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra is not None:
        pairs.append(f'{extra[0]}="{extra[1]}"')
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str]) -> None:
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(label_names)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names)
        self._values: dict[LabelValues, float] = {} if label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def total(self) -> float:
        """The sum over every label set."""
        return sum(self._values.values())

    def items(self) -> list[tuple[LabelValues, float]]:
        """Each label set's values (in `label_names` order) and its value."""
        return list(self._values.items())

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_format_labels(self.label_names, k)} "
                                f"{_format_value(v)}" for k, v in sorted(self._values.items())]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float],
                 label_names: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names)
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"{self.name}: buckets must be increasing and non-empty")
        self.buckets = tuple(float(b) for b in buckets)
        # Per label set: a count per bucket (non-cumulative; +Inf last), the sum.
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        return sum(self._counts.get(self._key(labels), ()))

    def sum(self, **labels: str) -> float:
        return self._sums.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        for key in sorted(self._counts):
            running = 0
            for bound, n in zip((*self.buckets, math.inf), self._counts[key]):
                running += n
                labels = _format_labels(self.label_names, key, ("le", _format_value(bound)))
                lines.append(f"{self.name}_bucket{labels} {running}")
            labels = _format_labels(self.label_names, key)
            lines.append(f"{self.name}_sum{labels} {_format_value(self._sums[key])}")
            lines.append(f"{self.name}_count{labels} {running}")
        return lines


class MetricsRegistry:
    """The metrics of one process; `render()` is the body of GET /metrics."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, prefix: str = "pdserve_") -> None:
        self.prefix = prefix
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> _Metric:
        if not _NAME.match(metric.name) or not metric.name.startswith(self.prefix):
            raise ValueError(f"metric name {metric.name!r} must match {_NAME.pattern} "
                             f"and start with {self.prefix!r}")
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help_text, label_names))  # type: ignore[return-value]

    def gauge(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help_text, label_names))  # type: ignore[return-value]

    def histogram(self, name: str, help_text: str,
                  buckets: Sequence[float] = DEFAULT_SECONDS_BUCKETS,
                  label_names: Sequence[str] = ()) -> Histogram:
        return self._add(Histogram(name, help_text, buckets, label_names))  # type: ignore

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render())  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"


def parse_samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line of an exposition (for tests and tools)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        samples[name] = float(value)
    return samples
