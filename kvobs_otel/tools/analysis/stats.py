"""Small statistics shared by the demo summary and the report."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Inclusive-method percentile (1 <= q <= 99); None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]
