"""The one way perf/ benchmarks report a figure measured several times: its least, median and most.

A single run on the device's VMs moves by tens of percent from call to call (perf/RESULTS.md),
so a figure printed alone says little; the three together show how far to trust it.

    from spread import spread, spread_text
    spread([3.0, 1.0, 2.0])              # (1.0, 2.0, 3.0)
    spread_text([3.0, 1.0, 2.0], ".1f")  # "1.0 / 2.0 / 3.0"

Also a command for shell benchmarks: `python3 perf/spread.py 3 1 2` prints "1 / 2 / 3".
"""
import math
import statistics
import sys

REPEAT = 3      # runs of a figure by default: the fewest that have a median apart from the extremes


def spread(values):
    """(least, median, most) of the values, NaNs left out; all NaN when none is left."""
    v = sorted(float(x) for x in values if x is not None and not math.isnan(float(x)))
    if not v:
        return (math.nan,) * 3
    return v[0], statistics.median(v), v[-1]


def spread_text(values, fmt=".3g"):
    """"least / median / most", each formatted with `fmt`; "-" when there is no value."""
    least, median, most = spread(values)
    if math.isnan(median):
        return "-"
    return " / ".join(format(x, fmt) for x in (least, median, most))


if __name__ == "__main__":
    print(spread_text(float(a) for a in sys.argv[1:]))
