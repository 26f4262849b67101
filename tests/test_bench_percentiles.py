"""The latency percentiles ``bench/e2e.py`` prints (saga and per-hop p50 / p90 / p99)
are nearest-rank: the smallest value with at least q of the samples at or below it."""

from __future__ import annotations

import math
import random

from bench.e2e import pct


def test_nearest_rank_of_one_to_a_hundred() -> None:
    values = [float(v) for v in range(1, 101)]
    random.Random(3).shuffle(values)

    assert [pct(values, q) for q in (0.5, 0.9, 0.99, 1.0)] == [50.0, 90.0, 99.0, 100.0]


def test_a_median_of_an_even_count_is_the_lower_middle() -> None:
    assert pct([2.0, 1.0], 0.5) == 1.0
    assert pct([float(v) for v in range(1, 31)], 0.5) == 15.0  # a level of 30 sagas


def test_small_and_empty_samples() -> None:
    assert pct([7.0], 0.99) == 7.0
    assert pct([3.0, 1.0, 2.0], 0.0) == 1.0
    assert math.isnan(pct([], 0.5))
