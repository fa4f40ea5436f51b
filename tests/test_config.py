"""Typed config: shipped YAMLs load; bad keys, types and ranges fail at load time with the key path."""

import dataclasses

import pytest
import yaml

from jaxagent import cli
from jaxagent import config as config_lib
from jaxagent.config import ConfigError

SHIPPED = sorted(config_lib.CONFIG_DIR.glob("*.yaml"))


def test_there_are_shipped_configs():
  assert any(p.stem == "tiny_cpu" for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_yaml_loads_and_round_trips(path):
  config = config_lib.load(path)
  assert isinstance(config, config_lib.Config)
  raw = yaml.safe_load(path.read_text())

  def took_effect(written, loaded, where):  # every key written in the file, at any depth (lists of stages too)
    if isinstance(written, dict):
      for key, value in written.items():
        took_effect(value, loaded[key], f"{where}.{key}")
    elif isinstance(written, list) and written and isinstance(written[0], dict):
      assert len(written) == len(loaded), f"{path.name}: {where}"
      for i, (w, l) in enumerate(zip(written, loaded)):
        took_effect(w, l, f"{where}[{i}]")
    else:
      assert loaded == written, f"{path.name}: {where}"

  for section, values in raw.items():
    took_effect(values, config_lib.to_dict(getattr(config, section)), section)
  assert config_lib.from_dict(yaml.safe_load(config_lib.dump(config))) == config


@pytest.mark.parametrize("override, pattern", [
    ("generate.temprature=0.5", r"unknown key 'generate\.temprature'; did you mean 'generate\.temperature'"),
    ("model.init.hiden_size=8", r"unknown key 'model\.init\.hiden_size'; did you mean 'model\.init\.hidden_size'"),
    ("modle.path=x", r"unknown key 'modle'; did you mean 'model'"),
    ("generate.max_new_tokens=ten", r"generate\.max_new_tokens='ten': expected an integer"),
    ("generate.max_new_tokens=0", r"generate\.max_new_tokens=0: must be >= 1"),
    ("generate.top_p=1.5", r"generate\.top_p=1\.5: must be <= 1\.0"),
    ("generate.temperature=true", r"generate\.temperature=True: expected a number"),
    ("model.dtype=float16", r"model\.dtype='float16': not one of \['float32', 'bfloat16'\]"),
    ("mesh.ici.fsdp=0", r"mesh\.ici: fsdp=0: sizes are positive"),
    ("mesh.ici.tensor=-1", r"mesh\.ici: at most one axis may be -1"),
    ("mesh.rules.learner=zero3", r"mesh\.rules\.learner='zero3': not one of \['fsdp_tp', 'replicated'"),
    ("distributed.mode=mpi", r"distributed\.mode='mpi': not one of"),
    ("model.init.num_key_value_heads=3", r"model\.init: .*multiple of num_key_value_heads \(3\)"),
    ("model.init.rope_scaling.rope_type=yarn", r"model\.init\.rope_scaling\.rope_type='yarn': not one of"),
    ("run.seed", r"expected key\.path=value"),
    ("rollout.schedule=waves", r"rollout\.schedule='waves': not one of \['continuous', 'lockstep'\]"),
    ("rollout.env_transport=grpc", r"rollout\.env_transport='grpc': not one of \['host_loop', 'callback'\]"),
    ("rollout.decode_chunk=0", r"rollout\.decode_chunk=0: must be >= 1"),
    ("rollout.slots=0", r"rollout\.slots=0: must be >= 1"),
    ("model.matmul_precision=tf32", r"model\.matmul_precision='tf32': not one of \['float32', 'tensorfloat32'"),
    ("model.architecture=qwen9", r"model\.architecture='qwen9': not one of \['gemma3-4b', 'llama3\.1-70b', 'qwen3-0\.6b', 'qwen3-30b-a3b', 'qwen3-8b', 'smollm2-135m'\]"),
])
def test_bad_values_name_the_key_and_what_is_valid(override, pattern):
  with pytest.raises(ConfigError, match=pattern):
    config_lib.load("tiny_cpu", [override])


def test_model_architecture_initializes_the_named_shapes_and_refuses_a_checkpoint_beside_it():
  import models
  config = config_lib.load("qwen3_0p6b_gpu", ["model.path=null", "model.architecture=qwen3-0.6b"])
  assert config.model.init == models.architecture("qwen3-0.6b") and config.model.init.num_hidden_layers == 28
  assert config_lib.from_dict(yaml.safe_load(config_lib.dump(config))) == config  # round-trips
  with pytest.raises(ConfigError, match=r"architecture='qwen3-0\.6b' initializes random weights, but "
                     r"path='checkpoints/Qwen3-0\.6B' loads a checkpoint: set one of them \(the other null\)"):
    config_lib.load("qwen3_0p6b_gpu", ["model.architecture=qwen3-0.6b"])


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
  path = tmp_path / "lr.yaml"
  path.write_text("optim:\n  learning_rate: 2e-4\n")  # YAML 1.1 reads this as a string
  assert config_lib.load(path).optim.learning_rate == 2e-4
  with pytest.raises(ConfigError, match=r"optim\.learning_rate='fast': expected a number"):
    config_lib.load(path, ["optim.learning_rate=fast"])


def test_error_names_the_file(tmp_path):
  path = tmp_path / "bad.yaml"
  path.write_text("generate:\n  max_new_tokns: 3\n")
  with pytest.raises(ConfigError, match=r"bad\.yaml: unknown key 'generate\.max_new_tokns'"):
    config_lib.load(path)


def test_overrides_are_typed():
  config = config_lib.load("tiny_cpu", ["generate.temperature=0.7", "model.init.rope_scaling.rope_type=llama3",
                                        "model.init.rope_scaling.factor=8", "run.name=x"])
  assert config.generate.temperature == 0.7
  assert config.model.init.rope_scaling.rope_type == "llama3"
  assert config.model.init.rope_scaling.factor == 8.0 and isinstance(config.model.init.rope_scaling.factor, float)
  assert config.run.name == "x"
  with pytest.raises(Exception):
    config.run.name = "y"  # frozen


def test_unknown_config_name_lists_shipped():
  with pytest.raises(ConfigError, match="shipped configs: .*tiny_cpu"):
    config_lib.load("tiny_gpu_typo")


def test_cli_reports_config_errors(capsys):
  assert cli.main(["config", "tiny_cpu", "--set", "generate.temprature=1"]) == 2
  assert "did you mean 'generate.temperature'" in capsys.readouterr().err
  assert cli.main(["config", "tiny_cpu", "--set", "generate.max_new_tokens=5"]) == 0
  assert "max_new_tokens: 5" in capsys.readouterr().out


def test_env_options_are_checked_against_the_chosen_env_when_the_config_loads():
  """tiny_cpu's calculator demo options under another env, a misspelt task option and a stage's options are
  refused at load, naming the key, the option, the env's function and what it takes; a user env that takes
  **options is not second-guessed."""
  with pytest.raises(ConfigError, match=r"env.demo_options=\{'style': 'direct'\}: 'style' is not an option of the "
                                        r"sokoban env's demo \(envs.builtin.sokoban.demo\); it takes none"):
    config_lib.load("tiny_cpu", ["env.name=sokoban"])
  config_lib.load("tiny_cpu", ["env.name=sokoban", "env.demo_options=null"])
  with pytest.raises(ConfigError, match=r"'max_operandd' is not an option of the calculator env's tasks .*did you "
                                        r"mean 'max_operand'\?\); it takes 'max_operand'"):
    config_lib.load("tiny_cpu", ["env.options.max_operandd=3"])
  with pytest.raises(ConfigError, match=r"curriculum.stages\[0\].env_options=\{'sizes': 3\}: 'sizes' is not an "
                                        r"option of the calculator env's tasks"):
    config_lib.load("tiny_cpu", ["train.bc_steps=0", "train.iterations=2",
                                 "curriculum.stages=[{name: a, paradigm: rl, steps: 2, env_options: {sizes: 3}}]"])
  import envs
  spec = envs.get("calculator")
  anything = dataclasses.replace(spec, tasks=lambda split, n, seed=0, **options: spec.tasks(split, n, seed))
  anything.check_options("tasks", {"whatever": 1})
  star = dataclasses.replace(spec, tasks=lambda split, *rest, max_operand=9: spec.tasks(split, *rest))
  star.check_options("tasks", {"max_operand": 3})
  with pytest.raises(ValueError, match="it takes 'max_operand'"):
    star.check_options("tasks", {"seed": 3})


def test_rollout_settings_that_span_processes():
  config = config_lib.load("tiny_cpu", ["rollout.slots=6"])
  with pytest.raises(ConfigError, match=r"rollout\.slots=6: must be divisible by the 4 processes"):
    config_lib.check_combinations(config, 4)
  config = config_lib.load("tiny_cpu", ["rollout.env_transport=callback"])
  for processes in (1, 2):  # each process's program calls its own envs (tests/test_multihost.py runs 2)
    config_lib.check_combinations(config, processes)
