"""Tests of the package: plain functions named test_*, plain asserts, no pytest needed."""

from intervals import contains, gaps, merge, overlaps, total_length
from search import binary_search, clamp, count_in_range, isqrt, lower_bound
from stack import Stack, balanced, eval_rpn
from textops import caesar, count_words, is_palindrome, pad_left, truncate


def eq(got, want):
    assert got == want, "got " + repr(got) + ", want " + repr(want)


def raises(exc, fn, *args):
    try:
        fn(*args)
    except exc:
        return
    raise AssertionError(exc.__name__ + " not raised")


def test_is_palindrome():
    eq([is_palindrome(w) for w in ["", "a", "aa", "ab", "aba", "abca", "racecar", "abcdba"]],
       [True, True, True, False, True, False, True, False])


def test_truncate():
    eq([truncate("hello world", w) for w in [0, 2, 3, 5, 11, 12]],
       ["", "he", "...", "he...", "hello world", "hello world"])


def test_count_words():
    eq([count_words(s) for s in ["", "one", "two words", "  spaced   out  ", "a b c d"]], [0, 1, 2, 2, 4])


def test_caesar():
    eq(caesar("abc xyz!", 1), "bcd yza!")
    eq(caesar("hello", 13), "uryyb")
    eq(caesar(caesar("round trip", 7), 19), "round trip")
    eq(caesar("Az", 2), "Ab")


def test_pad_left():
    eq([pad_left("7", w, "0") for w in [0, 1, 2, 4]], ["7", "7", "07", "0007"])
    eq(pad_left("abc", 5, "."), "..abc")


def test_stack_push_pop():
    st = Stack(3)
    for x in [1, 2, 3]:
        st.push(x)
    eq(st.size(), 3)
    eq(st.is_full(), True)
    eq(st.peek(), 3)
    raises(OverflowError, st.push, 4)
    eq([st.pop(), st.pop(), st.pop()], [3, 2, 1])
    eq(st.is_full(), False)
    raises(IndexError, st.pop)
    raises(IndexError, st.peek)
    raises(ValueError, Stack, 0)
    eq(Stack(1).size(), 0)


def test_balanced():
    eq([balanced(s) for s in ["", "()", "([]{})", "(]", "(()", "())", "a(b[c]d)e", "}{"]],
       [True, True, True, False, False, False, True, False])


def test_eval_rpn():
    eq(eval_rpn(["2", "3", "+"]), 5)
    eq(eval_rpn(["7", "2", "-", "4", "*"]), 20)
    eq(eval_rpn(["1", "2", "3", "*", "+", "10", "-"]), -3)
    raises(ValueError, eval_rpn, ["1", "2"])


def test_merge():
    eq(merge([]), [])
    eq(merge([(5, 8), (1, 3), (2, 4)]), [(1, 4), (5, 8)])
    eq(merge([(1, 3), (3, 5)]), [(1, 5)])
    eq(merge([(1, 10), (2, 3), (4, 5)]), [(1, 10)])
    eq(merge([(1, 2), (4, 6)]), [(1, 2), (4, 6)])


def test_total_length():
    eq(total_length([(0, 2), (1, 4), (10, 11)]), 5)
    eq(total_length([]), 0)


def test_overlaps():
    eq([overlaps((0, 2), (1, 3)), overlaps((0, 2), (2, 3)), overlaps((2, 3), (0, 2)), overlaps((0, 5), (1, 2))],
       [True, False, False, True])


def test_contains():
    eq([contains([(1, 3), (5, 7)], x) for x in [0, 1, 2, 3, 4, 5, 6, 7]],
       [False, True, True, False, False, True, True, False])


def test_gaps():
    eq(gaps([(2, 4), (6, 7)], 0, 10), [(0, 2), (4, 6), (7, 10)])
    eq(gaps([(0, 3), (2, 10)], 0, 10), [])
    eq(gaps([], 1, 3), [(1, 3)])


def test_binary_search():
    xs = [1, 3, 5, 7, 9, 11]
    eq([binary_search(xs, t) for t in [1, 3, 5, 7, 9, 11]], [0, 1, 2, 3, 4, 5])
    eq([binary_search(xs, t) for t in [0, 4, 12]], [-1, -1, -1])
    eq(binary_search([], 3), -1)


def test_lower_bound():
    xs = [1, 2, 2, 2, 5, 8]
    eq([lower_bound(xs, t) for t in [0, 1, 2, 3, 5, 8, 9]], [0, 0, 1, 4, 4, 5, 6])


def test_count_in_range():
    eq(count_in_range([1, 2, 2, 3, 5, 8], 2, 5), 3)
    eq(count_in_range([1, 2, 3], 4, 9), 0)


def test_clamp():
    eq([clamp(x, 2, 5) for x in [0, 2, 3, 5, 9]], [2, 2, 3, 5, 5])


def test_isqrt():
    eq([isqrt(n) for n in [0, 1, 2, 3, 4, 8, 9, 10, 99, 100]], [0, 1, 1, 1, 2, 2, 3, 3, 9, 10])
    raises(ValueError, isqrt, -1)
