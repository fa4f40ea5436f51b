"""docs/config.md and docs/cli.md are what `jaxagent.reference_pages` generates from the config tree and the CLI's
parser (`make docs` rewrites both)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxagent import config as config_lib
from jaxagent import config_reference, reference_pages


@pytest.mark.parametrize("page", sorted(reference_pages.pages()))
def test_the_generated_reference_pages_are_current(page):
  assert (reference_pages.DOCS / page).read_text() == reference_pages.pages()[page], (
      f"docs/{page} is stale: run `make docs` (python -m jaxagent.reference_pages docs) and commit it")


def _leaf_paths(data, prefix=""):
  for name, value in data.items():
    path = f"{prefix}.{name}" if prefix else name
    if isinstance(value, dict) and value:
      yield from _leaf_paths(value, path)
    else:
      yield path


def test_the_reference_lists_every_key_of_the_config_tree_once():
  listed = [k.path for k in config_reference.keys()]
  assert len(listed) == len(set(listed))
  # Every key of a default config (list items aside: they are shown as key[].field) is listed, and no other.
  defaults = config_lib.to_dict(config_lib.Config())
  expected = {p for p in _leaf_paths(defaults)} - {"curriculum.stages"}
  assert {p for p in listed if "[]" not in p} == expected
  stage_fields = {f.name for f in dataclasses.fields(config_lib.StageConfig)}
  assert {p.split("[].")[1].split(".")[0] for p in listed if p.startswith("curriculum.stages[].")} == stage_fields


def test_each_key_says_its_default_and_its_bounds():
  by_path = {k.path: k for k in config_reference.keys()}
  assert by_path["run.seed"].default == "0" and by_path["run.seed"].valid == ">= 0"
  assert by_path["rollout.schedule"].default == "continuous"  # as YAML writes it (and `jaxagent config` prints)
  assert by_path["rollout.schedule"].type == "continuous | lockstep"
  assert by_path["model.lora_targets"].default == "[q, k, v, o]" and by_path["train.plots"].default == "true"
  assert by_path["model.path"].type == "string | null"
  assert "decode slots" in by_path["rollout.slots"].help
  # A nested record without help metadata takes its class docstring's Attributes: text.
  assert "Qwen3" in by_path["model.init.qk_norm"].help


def test_the_cli_reference_has_every_verb_and_argument():
  text = reference_pages.markdown()
  paths = [path for path, _, _ in reference_pages.verbs()]
  assert {"train", "eval", "envs check", "envs serve", "tasks generate", "plan"} <= set(paths)
  for path in paths:
    assert f"## `jaxagent {path}`" in text
  train = text.split("## `jaxagent train`")[1].split("\n## ")[0]
  assert "`--resume RUN_DIR`" in train and "`--run-dir DIR`" in train and "`--set KEY=VALUE`" in train
  sft = text.split("## `jaxagent sft`")[1].split("\n## ")[0]
  assert "| `--steps STEPS` |  | `100` |" in sft and "`--split {train,tune,eval}`" in sft
