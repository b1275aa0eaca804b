"""Addresses that moved in a restore: the driver places a module's globals itself, elsewhere in
each process, and the application's pointers to them (in a launch's parameters, in globals
that point at globals) must reach where they are now."""
import bisect

import numpy as np


class Relocations:
    """Ranges of addresses that moved, each (start, end, new start), applied to many words at
    once: every word inside a range is pointed at the same place in its new one, and moves once.
    A range overlapping an earlier one keeps only the part no earlier one covers. A lookup costs
    a binary search in the sorted starts, however many ranges there are: a restored PyTorch
    context has thousands of moved module globals, and every launch's words, and every global
    the restore reads, pass through them."""

    def __init__(self, ranges):
        starts, ends, news = [], [], []       # disjoint, sorted by start
        for lo, hi, new in ranges:
            for lo2, hi2 in self._uncovered(starts, ends, lo, hi):
                i = bisect.bisect_left(starts, lo2)
                starts.insert(i, lo2), ends.insert(i, hi2), news.insert(i, new + lo2 - lo)
        self.starts, self.ends = np.array(starts, np.uint64), np.array(ends, np.uint64)
        self.shifts = np.array(news, np.uint64) - self.starts      # modulo 2**64, as the words are

    @staticmethod
    def _uncovered(starts, ends, lo, hi):
        """The parts of [lo, hi) that the disjoint sorted ranges (starts, ends) leave free."""
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        parts = []
        while lo < hi and i < len(starts):
            if ends[i] <= lo:
                i += 1
                continue
            if starts[i] >= hi:
                break
            if starts[i] > lo:
                parts.append((lo, starts[i]))
            lo = max(lo, ends[i])
            i += 1
        if lo < hi:
            parts.append((lo, hi))
        return parts

    def __len__(self):
        return len(self.starts)

    def apply(self, words):
        """Move the words (uint64, changed in place) that lie in a range; whether any did."""
        if not len(self.starts) or not len(words):
            return False
        i = np.searchsorted(self.starts, words, side="right") - 1
        inside = i >= 0
        inside[inside] = words[inside] < self.ends[i[inside]]
        if not inside.any():
            return False
        words[inside] += self.shifts[i[inside]]
        return True
