"""PNG plots of a BenchReport (`specexport bench --plot`); needs matplotlib."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .report import BenchError, BenchReport


def write_plots(report: BenchReport, folder: str | os.PathLike) -> list[Path]:
    """latency_cdf.png, accepted_length.png, acceptance_by_position.png, speedup_by_domain.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib: pip install 'specexport[plot]'") from exc
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    runs = report.runs
    groups = [("off", [r for r in runs if r.mode == "off"])] + [
        (f"on[{c.label}]", [r for r in runs if r.mode == "on" and r.gamma == c.gamma]) for c in report.configs
    ]

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rs in groups:
        lat = np.sort([x * 1e3 for r in rs for x in r.token_latencies()])
        if lat.size:
            ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=label)
    ax.set_xlabel("per-token latency (ms; tokens of one round share its gap)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title(f"{report.meta['name']}: per-token latency CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, folder / "latency_cdf.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(report.configs))
    for j, c in enumerate(report.configs):
        hist = np.asarray(c.acceptance.accepted_histogram, dtype=float)
        if hist.sum():
            ax.bar(np.arange(hist.size) + j * width, hist / hist.sum(), width=width, label=f"on[{c.label}]")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft tokens accepted in a round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("accepted length per round")
    ax.legend()
    written.append(_save(fig, folder / "accepted_length.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in report.configs:
        pos = c.acceptance.per_position
        if pos:
            ax.plot(np.arange(1, len(pos) + 1), pos, marker="o", label=f"on[{c.label}] accepted/drafted")
        cond = [np.nan if v is None else v for v in c.acceptance.per_position_conditional]
        if cond:
            ax.plot(np.arange(1, len(cond) + 1), cond, marker="x", linestyle="--", label=f"on[{c.label}] conditional")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by draft position")
    ax.legend(fontsize=8)
    written.append(_save(fig, folder / "acceptance_by_position.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    domains = list(report.meta["domains"])
    for j, c in enumerate(report.configs):
        vals = [c.by_domain[d]["speedup"] for d in domains]
        err = [
            [max(0.0, v - (c.by_domain[d]["speedup_ci95"] or (v, v))[0]) for d, v in zip(domains, vals)],
            [max(0.0, (c.by_domain[d]["speedup_ci95"] or (v, v))[1] - v) for d, v in zip(domains, vals)],
        ]
        ax.bar(np.arange(len(domains)) + j * width, vals, width=width, yerr=err, capsize=3, label=f"on[{c.label}]")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(np.arange(len(domains)) + width * (len(report.configs) - 1) / 2, domains)
    ax.set_ylabel("speedup over off (95% CI)")
    ax.set_title("speedup by domain")
    ax.legend()
    written.append(_save(fig, folder / "speedup_by_domain.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
