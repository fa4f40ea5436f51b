"""Half-open integer intervals (start, end)."""


def merge(intervals):
    out = []
    for start, end in sorted(intervals):
        if len(out) > 0 and start <= out[len(out) - 1][1]:
            last = out.pop()
            out.append((last[0], max(last[1], end)))
        else:
            out.append((start, end))
    return out


def total_length(intervals):
    total = 0
    for start, end in merge(intervals):
        total += end - start
    return total


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


def contains(intervals, x):
    for start, end in merge(intervals):
        if start <= x and x < end:
            return True
    return False


def gaps(intervals, lo, hi):
    out = []
    cur = lo
    for start, end in merge(intervals):
        if start > cur:
            out.append((cur, start))
        if end > cur:
            cur = end
    if cur < hi:
        out.append((cur, hi))
    return out
