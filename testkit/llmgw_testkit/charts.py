"""The chart library of the demo and the benchmarks: matplotlib's pyplot on the Agg backend
(PNG files, no display), or None where matplotlib is not installed (./build.sh installs it)."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot drawing to files, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
