"""Timing helpers shared by the benchmark scripts.

The machines these run on are noisy (shared CPUs). Every measurement therefore runs the
variants *interleaved*: repetition ``i`` times each variant once, back to back, in a
rotating order. A ratio is the median over repetitions of the paired ratio
``time[variant][i] / time[baseline][i]``, which cancels slow drifts of the machine.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable


def interleaved(
    fns: dict[str, Callable[[], object]],
    reps: int,
    warmup: int = 1,
    inner: int = 1,
    setup: Callable[[Callable[[], object]], object] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each of `fns`, `reps` samples each, measured interleaved.

    Each sample is the mean over `inner` back-to-back calls. ``setup(fn)`` (untimed)
    runs before every sample of ``fn``, e.g. to clear caches.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            if setup is not None:
                setup(fns[name])
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            fn = fns[name]
            if setup is not None:
                setup(fn)
            gc.collect()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner)
    return times


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over repetitions of ``times[num][i] / times[den][i]``."""
    return statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))
    ]

    def line(cells: list[str]) -> str:
        padded = (str(c).ljust(w) for c, w in zip(cells, widths, strict=True))
        return "| " + " | ".join(padded) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])
