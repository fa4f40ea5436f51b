"""Searching sorted lists and integer roots."""


def binary_search(xs, target):
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def lower_bound(xs, target):
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def count_in_range(xs, lo, hi):
    return lower_bound(xs, hi) - lower_bound(xs, lo)


def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def isqrt(n):
    if n < 0:
        raise ValueError("isqrt of a negative number")
    r = 0
    while (r + 1) * (r + 1) <= n:
        r += 1
    return r
