"""Lengths of unions and intersections of time intervals (numpy, vectorized)."""
import numpy as np


def union(begins, ends, gap=0.0):
    """The union of the intervals [begins[i], ends[i]] as sorted disjoint (begins, ends)
    arrays; intervals less than gap apart are joined too."""
    b = np.asarray(begins, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    if b.size == 0:
        return b, e
    order = np.argsort(b, kind="stable")
    b, e = b[order], np.maximum.accumulate(e[order])
    starts = np.flatnonzero(b[1:] > e[:-1] + gap) + 1
    firsts = np.concatenate(([0], starts))
    lasts = np.concatenate((starts - 1, [b.size - 1]))
    return b[firsts], e[lasts]


def length(intervals):
    """Total length of disjoint intervals (begins, ends)."""
    b, e = intervals
    return float(np.sum(e - b)) if b.size else 0.0


def overlap(a, b):
    """Length of the time covered by both a and b (each disjoint, as union returns)."""
    if a[0].size == 0 or b[0].size == 0:
        return 0.0
    points = np.concatenate((a[0], a[1], b[0], b[1]))
    steps = np.concatenate((np.ones(a[0].size), -np.ones(a[1].size), np.ones(b[0].size), -np.ones(b[1].size)))
    order = np.argsort(points, kind="stable")
    points, covered = points[order], np.cumsum(steps[order])
    both = covered[:-1] >= 2
    return float(np.sum(np.diff(points)[both]))
