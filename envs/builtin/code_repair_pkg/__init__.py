"""Package data of the `code_repair` env (never imported by envs): small modules and their plain-assert tests.

The env copies these modules into an episode's tmp dir, mutates one of them, and runs `pkg_tests.py` (kept
pristine, read from here) against the copy. Splits are isolated by module: see envs/builtin/code_repair.py.
"""
