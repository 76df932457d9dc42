"""What every benchmark prints and records the same way: a progress bar and latency figures."""

from __future__ import annotations

import statistics
import sys

__all__ = ["progress", "summarize"]


def progress(done: int, total: int, label: str) -> None:
    """A progress bar on stderr, redrawn at every tenth of the work."""
    if done != total and done % max(total // 10, 1):
        return
    width = 30
    filled = width * done // total
    print(
        f"\r{label:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
        end="",
        file=sys.stderr,
    )
    if done == total:
        print(file=sys.stderr)


def summarize(samples_ms: list[float], digits: int = 3) -> dict[str, float]:
    """Count, p50/p90/p99, mean, min and max of latencies in milliseconds (nearest rank)."""
    if not samples_ms:
        return {"n": 0}
    ordered = sorted(samples_ms)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]

    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered), digits),
        "p90_ms": round(pct(90), digits),
        "p99_ms": round(pct(99), digits),
        "mean_ms": round(statistics.fmean(ordered), digits),
        "min_ms": round(ordered[0], digits),
        "max_ms": round(ordered[-1], digits),
    }
