"""String helpers."""


def is_palindrome(s):
    i, j = 0, len(s) - 1
    while i < j:
        if s[i] != s[j]:
            return False
        i += 1
        j -= 1
    return True


def truncate(s, width):
    if len(s) <= width:
        return s
    if width < 3:
        return s[:width]
    return s[:width - 3] + "..."


def count_words(s):
    count = 0
    in_word = False
    for ch in s:
        if ch == " ":
            in_word = False
        elif not in_word:
            count += 1
            in_word = True
    return count


def caesar(s, shift):
    out = []
    for ch in s:
        if "a" <= ch and ch <= "z":
            out.append(chr((ord(ch) - 97 + shift) % 26 + 97))
        else:
            out.append(ch)
    return "".join(out)


def pad_left(s, width, fill):
    if len(s) >= width:
        return s
    return fill * (width - len(s)) + s
