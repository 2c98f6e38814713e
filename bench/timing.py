"""Wall-clock timing shared by the CPU benchmarks: the median of repeated calls after warm-up calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median milliseconds of `reps` calls of `fn` after `warmup` untimed ones (first-call allocations and kernel
    selection stay out of the number)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
