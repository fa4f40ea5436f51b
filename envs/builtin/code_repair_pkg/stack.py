"""A bounded stack and two classic uses of it."""


class Stack:
    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.items = []

    def __repr__(self):
        return "Stack(" + repr(self.items) + ")"

    def push(self, x):
        if len(self.items) >= self.capacity:
            raise OverflowError("stack is full")
        self.items.append(x)

    def pop(self):
        if len(self.items) == 0:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        if len(self.items) == 0:
            raise IndexError("peek at empty stack")
        return self.items[len(self.items) - 1]

    def size(self):
        return len(self.items)

    def is_full(self):
        return len(self.items) == self.capacity


def balanced(text):
    pairs = {")": "(", "]": "[", "}": "{"}
    st = Stack(len(text) + 1)
    for ch in text:
        if ch in "([{":
            st.push(ch)
        elif ch in pairs:
            if st.size() == 0 or st.pop() != pairs[ch]:
                return False
    return st.size() == 0


def eval_rpn(tokens):
    st = Stack(16)
    for tok in tokens:
        if tok == "+" or tok == "-" or tok == "*":
            b = st.pop()
            a = st.pop()
            if tok == "+":
                st.push(a + b)
            elif tok == "-":
                st.push(a - b)
            else:
                st.push(a * b)
        else:
            st.push(int(tok))
    if st.size() != 1:
        raise ValueError("malformed expression")
    return st.pop()
