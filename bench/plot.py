"""PNG plots for `--plot DIR` (matplotlib, Agg backend; imported only when plotting)."""

from __future__ import annotations

from pathlib import Path

from bench.goodput import GoodputReport
from bench.report import RunReport


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(report: RunReport, out_dir: Path, stem: str = "latency_cdf") -> Path:
    """TTFT, TPOT and E2E CDFs per tier, SLO targets as dashed lines. Needs the requests."""
    if report.requests is None:
        raise ValueError("latency CDFs need per-request records (keep_requests=True)")
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = (("TTFT ms", lambda r: r.ttft_ms, "ttft_ms"),
               ("TPOT ms", lambda r: r.tpot_ms, "tpot_ms"),
               ("E2E ms", lambda r: r.e2e_ms, None))
    for ax, (label, value_of, slo_field) in zip(axes, metrics):
        for tier, group in report.tiers.items():
            values = sorted(v for r in report.requests
                            if r.tier == tier and r.error is None
                            and (v := value_of(r)) is not None)
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            line, = ax.step(values, ys, where="post", label=tier)
            if slo_field is not None and group.slo is not None:
                ax.axvline(getattr(group.slo, slo_field), color=line.get_color(),
                           linestyle="--", linewidth=1)
        # Log scale: tiers' targets differ by orders of magnitude (250 ms vs 10 s TTFT).
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("share of completed requests")
        ax.grid(alpha=0.3)
        ax.legend()
    load = (f"{report.config.rate_rps:g} req/s" if report.config.rate_rps is not None
            else f"concurrency {report.config.concurrency}")
    fig.suptitle(f"{report.config.workload} @ {load} (dashed: SLO)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_attainment_vs_rate(report: GoodputReport, out_dir: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    tiers = sorted({t for p in report.points for t in p.attainment_by_tier})
    for tier in tiers:
        xs = [p.rate_rps for p in report.points if p.attainment_by_tier.get(tier) is not None]
        ys = [p.attainment_by_tier[tier] for p in report.points
              if p.attainment_by_tier.get(tier) is not None]
        ax.plot(xs, ys, marker="o", label=tier)
    ax.axhline(report.attainment_target, color="grey", linestyle="--", label="target")
    if report.goodput_rps is not None:
        ax.axvline(report.goodput_rps, color="green", linestyle=":",
                   label=f"goodput {report.goodput_rps:.2f} req/s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "attainment_vs_rate.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
