"""Shared test setup.

Eight fake CPU devices for every test process (set before jax initializes its backends), so sharding tests
run for real on a 2x4 mesh. Single-device code is unaffected: arrays default to device 0.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_num_cpu_devices", 8)

import hypothesis  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

# Property tests draw the same examples on every run: CI is reproducible and a failure names its seed-free case.
hypothesis.settings.register_profile("jaxagent", derandomize=True, print_blob=True)
hypothesis.settings.load_profile("jaxagent")
