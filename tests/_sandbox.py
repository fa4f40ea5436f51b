"""Shared rule for tests that need the bubblewrap sandbox."""

import os


def require_bwrap() -> None:
  """Bubblewrap sandbox tests: fail without it when JAXAGENT_REQUIRE_SANDBOX=1 (.ci/run), else skip with the
  reason printed."""
  import pytest
  from envs import pool
  if pool.bwrap_available():
    return
  reason = "bubblewrap not installed or no user namespaces (apt-get install -y bubblewrap)"
  if os.environ.get("JAXAGENT_REQUIRE_SANDBOX") == "1":
    pytest.fail(f"JAXAGENT_REQUIRE_SANDBOX=1 but {reason}")
  print(f"SKIP: {reason}")
  pytest.skip(reason)
