"""Data paradigms (jaxagent/train/paradigms.py): sft from chat files and stored trajectories, rejection-sampling
fine-tuning, offline RL; their data readers (jaxagent/data) and the truncated importance-weighted loss."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import envs
import models
from jaxagent import algos, seeds, weights
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
from jaxagent.assembly import BatchShape, assemble
from jaxagent.chat import make_chat
from jaxagent.data import chats
from jaxagent.data import trajectories as stored
from jaxagent.train import loop
from tests.test_train import ROOT, TINY, _final_params, deterministic_lines

COIN = "tests._coin_env:SPEC"


def _call(name, arguments):
  return {"type": "function", "function": {"name": name, "arguments": arguments}}


CALC_CHATS = [
    {"messages": [
        {"role": "system", "content": "You are a calculator agent."},
        {"role": "user", "content": "What is 12*7?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("calc", json.dumps({"expression": "12*7"}))]},
        {"role": "tool", "tool_call_id": "c1", "content": "84"},
        {"role": "assistant", "tool_calls": [_call("answer", {"answer": "84"})]}]},
    {"id": "plain", "messages": [{"role": "user", "content": "What is 3+4?"},
                                 {"role": "assistant", "content": "answer 7"}]},
]
# The actions each chat holds, in the line syntax of the calculator's parser.
CALC_ACTIONS = [["calc 12*7", "answer 84"], ["answer 7"]]


def _write_jsonl(path: Path, rows) -> Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _calculator_parser(syntax="line"):
  env = envs.get("calculator").make()
  try:
    return env.parser if syntax == "line" else env.parser.with_syntax(syntax)
  finally:
    env.close()


def _check_masks(trajectories, chat, expected_actions):
  """The batch's loss mask is exactly the assistant actions' tokens, in the run's framing."""
  batch = assemble(trajectories, shape=BatchShape(pad_id=0))
  policy = batch.roles == int(tr.Role.POLICY)
  np.testing.assert_array_equal(batch.loss_mask, policy)
  for row, (t, actions) in enumerate(zip(trajectories, expected_actions)):
    masked = batch.tokens[row][batch.loss_mask[row]].tolist()
    assert masked == [tok for a in actions for tok in chat.action_tokens(a)], "trained tokens != the actions"
    for turn in t.turns:
      if turn.observation is not None:  # the tool reply's tokens carry no loss
        start, stop = turn.observation.span
        assert stop > start and not batch.loss_mask[row, start:stop].any()
  return batch


def test_chat_file_trains_only_assistant_tokens_with_control_tokens(tmp_path):
  tokenizer = models.load_tokenizer("byte")
  chat, parser = make_chat(tokenizer), _calculator_parser()
  data = chats.read_chats(_write_jsonl(tmp_path / "c.jsonl", CALC_CHATS), chat, parser)
  assert data.system_messages_dropped == 1 and len(data.trajectories) == 2
  first = data.trajectories[0]
  assert [turn.action.text for turn in first.turns] == CALC_ACTIONS[0]
  assert first.turns[0].observation.text == "84" and first.task.id == "c.jsonl:1"
  assert data.trajectories[1].task.id == "plain"
  batch = _check_masks(data.trajectories, chat, CALC_ACTIONS)
  text = tokenizer.decode(batch.tokens[0][batch.roles[0] >= 0].tolist(), skip_special=True)
  assert "What is 12*7?" in text and "calculator agent" not in text  # the run's framing, not the file's system


def test_chat_file_tool_calls_through_a_real_chat_template(tmp_path, qwen3_tokenizer_dir):
  tokenizer = models.load_tokenizer(str(qwen3_tokenizer_dir))
  parser = _calculator_parser("json")
  chat = make_chat(tokenizer, tools=[t.schema() for t in parser.tools], template_kwargs={"enable_thinking": False})
  data = chats.read_chats(_write_jsonl(tmp_path / "c.jsonl", CALC_CHATS[:1]), chat, parser)
  expected = [[json.dumps({"name": "calc", "arguments": {"expression": "12*7"}}),
               json.dumps({"name": "answer", "arguments": {"answer": "84"}})]]
  assert [turn.action.text for turn in data.trajectories[0].turns] == expected[0]
  batch = _check_masks(data.trajectories, chat, expected)
  trained = tokenizer.decode(batch.tokens[0][batch.loss_mask[0]].tolist())
  assert "<tool_call>" in trained and '"expression": "12*7"' in trained and "<|im_end|>" in trained


@pytest.mark.parametrize("messages, error", [
    ([{"role": "assistant", "content": "answer 1"}], "one user message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("nope", {})]}], "unknown tool"),
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "content": "thinking", "tool_calls": [_call("answer", {"answer": "1"})]}],
     "both content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer 1"},
      {"role": "assistant", "content": "answer 2"}], "two assistant messages in a row"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}], "where an assistant action belongs"),
    ([{"role": "user", "content": "q"}], "no assistant message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "Sure! It is 7."}], "not an action"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("calc", {"expression": 3})]}],
     "bad arguments"),
])
def test_bad_chat_lines_are_refused_naming_the_line(tmp_path, messages, error):
  path = _write_jsonl(tmp_path / "c.jsonl", [CALC_CHATS[1], {"messages": messages}])
  with pytest.raises(chats.ChatDataError, match=error) as e:
    chats.read_chats(path, make_chat(models.load_tokenizer("byte")), _calculator_parser())
  assert "c.jsonl:2" in str(e.value)


def _stored(i, passed, termination=envs.Termination.COMPLETED, group="g0", version=3, split="train"):
  stream = tr.TokenStream()
  stream.template([1, 2, 3], tr.Role.PROMPT)
  span = stream.sampled([4, 5], [-0.5, -0.25])
  reward = 1.0 if passed else 0.0
  return tr.Trajectory(
      task=tr.TaskRecord(id=f"t{i}", split=split), env=tr.EnvInfo(name="x", version="v", seed=i), policy_version=version,
      termination=termination, reward=tr.Reward(total=reward, terminal=reward),
      turns=(tr.Turn(action=tr.Action(span=span, text="a")),), id=f"r{i}", group_id=group,
      verifier=tr.VerifierRecord(passed=passed), **stream.arrays())


def test_stored_trajectories_are_selected_by_the_filter_and_counted(tmp_path):
  records = [_stored(0, True), _stored(1, False), _stored(2, True, group="g1"),
             _stored(3, False, envs.Termination.ENV_ERROR), _stored(4, False, group="g1"),
             _stored(5, True, split="eval")]
  with trajectory_store.TrajectoryWriter(tmp_path / "store") as w:
    for t in records:
      w.write(t)
  exclude = config_lib.TrainConfig().exclude_terminations
  everything = stored.select(tmp_path / "store", config_lib.DataFilter(), exclude=exclude)
  assert everything.counts == {"read": 6, "kept": 4, "unreadable": 0, "dropped/infrastructure_failure": 1,
                               "dropped/held_out_split": 1}
  assert [everything.fetch(i).id for i in range(len(everything))] == ["r0", "r1", "r2", "r4"]
  np.testing.assert_array_equal(everything.groups, [0, 0, 1, 1])
  np.testing.assert_array_equal(everything.rewards[:, 0], [1.0, 0.0, 1.0, 0.0])
  verified = stored.select(tmp_path / "store", config_lib.DataFilter(verified=True), exclude=exclude)
  assert [verified.fetch(i).id for i in range(len(verified))] == ["r0", "r2"]
  assert verified.counts["dropped/not_verified"] == 2
  assert "2 of 6 stored trajectories selected" in verified.line()
  held_out = stored.select(tmp_path / "store", config_lib.DataFilter(splits=("eval",)), exclude=exclude)
  assert [held_out.fetch(i).id for i in range(len(held_out))] == ["r5"]  # only when asked for by name


def test_examples_are_a_pure_function_of_seed_and_step():
  a, b = stored.Examples(lambda i: i, 5, seed=7), stored.Examples(lambda i: i, 5, seed=7)
  epoch = [a.positions(s, 5) for s in range(3)]
  assert all(sorted(e) == list(range(5)) for e in epoch) and epoch[0] != epoch[1]  # reshuffled per epoch
  assert b.batch(1, 4, part=(1, 2))[1] == a.positions(1, 4)[2:]  # a process's slice of the global batch


def test_importance_weighted_loss_gradient_is_the_truncated_weight_times_the_advantage():
  logp = jnp.log(jnp.asarray([[0.5, 0.2, 0.9, 0.3]]))
  behavior = jnp.log(jnp.asarray([[0.25, 0.4, 0.9, 0.1]]))  # ρ = 2, 0.5, 1, 3
  adv = jnp.asarray([[1.0, -2.0, 0.5, 1.0]])
  mask = jnp.asarray([[True, True, True, False]])
  c = 1.5
  loss = lambda lp, floor=0.0: algos.importance_weighted_loss(
      algos.TokenLossInputs(lp, behavior, adv, mask, jnp.float32(3.0)),
      algos.ImportanceWeightConfig(max_ratio=c, min_negative_ratio=floor))
  grad = jax.grad(lambda lp: loss(lp)[0])(logp)
  expected = -np.minimum([2.0, 0.5, 1.0, 3.0], c) * np.asarray([1.0, -2.0, 0.5, 1.0]) / 3.0 * [1, 1, 1, 0]
  np.testing.assert_allclose(grad[0], expected, rtol=1e-5)
  _, m = loss(logp)
  assert float(m["clip_fraction"]) == pytest.approx(1 / 3) and float(m["ratio_max"]) == pytest.approx(2.0)
  assert float(m["loss_tokens"]) == 3.0
  # The floor: the negative-advantage token already at ρ = 0.5 < 0.8 is not pushed down further.
  floored = jax.grad(lambda lp: loss(lp, 0.8)[0])(logp)
  np.testing.assert_allclose(floored[0], expected * [1, 0, 1, 0], rtol=1e-5)
  assert float(loss(logp, 0.8)[1]["clip_fraction"]) == pytest.approx(2 / 3)


def test_paradigm_stages_are_checked_when_the_config_loads(tmp_path):
  load = lambda *o: config_lib.load("tiny_cpu", list(o))
  with pytest.raises(config_lib.ConfigError, match="needs `data`"):
    load("curriculum.stages=[{name: s, paradigm: sft, steps: 2}]", "train.iterations=2", "train.bc_steps=0")
  with pytest.raises(config_lib.ConfigError, match="bc stages come first"):
    load("curriculum.stages=[{name: s, paradigm: sft, steps: 2, data: x.jsonl}, {name: b, paradigm: bc, steps: 3}]",
         "train.iterations=2", "train.bc_steps=3")
  with pytest.raises(config_lib.ConfigError, match="train.iterations=5"):
    load("curriculum.stages=[{name: r, paradigm: rft, steps: 2}, {name: l, paradigm: rl, steps: 3}]",
         "train.iterations=4", "train.bc_steps=0")
  with pytest.raises(config_lib.ConfigError, match="save_trajectories"):
    load("curriculum.stages=[{name: r, paradigm: rft, steps: 2}]", "train.iterations=2", "train.bc_steps=0",
         "train.save_trajectories=false")
  with pytest.raises(config_lib.ConfigError, match="iw_pg uses group-relative"):
    load("curriculum.stages=[{name: o, paradigm: offline, steps: 2, data: d}]", "train.iterations=2",
         "train.bc_steps=0", "algo.name=ppo", "algo.advantage=gae")
  with pytest.raises(config_lib.ConfigError, match="rollouts applies to rft stages"):
    load("curriculum.stages=[{name: s, paradigm: sft, steps: 2, data: x.jsonl, rollouts: 3}]", "train.iterations=2",
         "train.bc_steps=0")
  with pytest.raises(config_lib.ConfigError, match="method, max_ratio apply to offline stages"):
    load("curriculum.stages=[{name: s, paradigm: sft, steps: 2, data: d, method: filtered_bc, max_ratio: 2}]",
         "train.iterations=2", "train.bc_steps=0")
  with pytest.raises(config_lib.ConfigError, match="filter applies to sft and offline stages"):
    load("curriculum.stages=[{name: r, paradigm: rl, steps: 2, filter: {verified: true}}]", "train.iterations=2",
         "train.bc_steps=0")
  cfg = load("curriculum.stages=[{name: r, paradigm: rft, steps: 2, updates: 5}, {name: l, paradigm: rl, steps: 3}]",
             "train.iterations=5", "train.bc_steps=0")
  assert config_lib.planned_updates(cfg) == 2 * 5 + 3


def test_sft_stage_trains_on_the_assistant_tokens_of_its_batches(tmp_path):
  """End to end: the step's loss-token count is the assistant tokens of the batch the stage drew."""
  path = _write_jsonl(tmp_path / "c.jsonl", CALC_CHATS)
  cfg = config_lib.load("tiny_cpu", TINY + [
      f"run.root={tmp_path}", "train.bc_steps=0", "train.eval_episodes=0", "train.plots=false",
      "train.iterations=3", f"curriculum.stages=[{{name: s, paradigm: sft, steps: 3, data: '{path}'}}]"])
  loop.train(cfg, run_dir=tmp_path / "run")
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  logged = [r["sft/loss_tokens"] for r in rows if "sft/loss_tokens" in r]
  chat = make_chat(models.load_tokenizer("byte"))
  per_chat = [sum(len(chat.action_tokens(a)) for a in actions) for actions in CALC_ACTIONS]
  examples = stored.Examples(lambda i: i, 2, seed=seeds.data_order(cfg.run.seed, 0))
  assert logged == [sum(per_chat[p] for p in examples.positions(s, cfg.train.bc_batch_size)) for s in range(3)]
  assert all(np.isfinite(r["sft/nll"]) for r in rows if "sft/nll" in r)
  device = [r["device_seconds"] for r in rows if "sft/loss_tokens" in r]  # the update steps count, as in rl
  assert len(device) == 3 and 0 < device[0] < device[1] < device[2]


# ------------------------------------------------------------------------------------------------
# A kill and a resume of each verb continue exactly.

_SMALL = TINY + ["train.eval_episodes=0", "train.plots=false", "env.pool.kind=local", "env.pool.num_workers=1",
                 "train.checkpoint_every=2", "train.keep_checkpoints=10", f"env.name={COIN}", "env.max_turns=1",
                 "rollout.max_new_tokens=6"]


def _cmd(verb, root, *args):
  cmd = [sys.executable, "-m", "jaxagent", verb, "tiny_cpu"]
  for o in _SMALL + [f"run.root={root}"]:
    cmd += ["--set", o]
  return cmd + list(args)  # after the defaults: their --set win


def _env():
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONPATH=str(ROOT))


def _verb_args(verb, tmp_path):
  steps = 8
  if verb == "rft":
    return ["--rounds", str(steps), "--updates", "2", "--set", "train.bc_steps=0"], steps
  if verb == "sft":
    chats_file = _write_jsonl(tmp_path / "coin.jsonl", [
        {"messages": [{"role": "user", "content": f"coin {i}"}, {"role": "assistant", "content": f"say {w}"}]}
        for i, w in enumerate(["hi", "yes", "ok", "even"])])
    return ["--data", str(chats_file), "--steps", str(steps), "--set", "train.bc_steps=0"], steps
  # offline: another policy's store (a short GRPO run on the coin env) is the data
  subprocess.run([sys.executable, "-m", "jaxagent", "train", "tiny_cpu", *sum(
      (["--set", o] for o in _SMALL + [f"run.root={tmp_path / 'src'}", "train.iterations=3", "run.seed=5"]), [])],
      check=True, env=_env(), cwd=ROOT, capture_output=True, timeout=600)
  (src,) = (tmp_path / "src").iterdir()
  return ["--data", str(src / "trajectories"), "--steps", str(steps), "--max-ratio", "2.0"], steps


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["sft", "rft", "offline"])
def test_each_paradigm_verb_killed_and_resumed_continues_exactly(tmp_path, verb):
  args, steps = _verb_args(verb, tmp_path)
  done = subprocess.run(_cmd(verb, tmp_path / "a", *args), env=_env(), cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  (run_a,) = (tmp_path / "a").iterdir()
  proc = subprocess.Popen(_cmd(verb, tmp_path / "b", *args), env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline, killed = time.monotonic() + 600, False
  while time.monotonic() < deadline and proc.poll() is None:
    if list((tmp_path / "b").glob("*/checkpoints/2")):
      proc.send_signal(signal.SIGKILL)
      killed = True
      break
    time.sleep(0.01)
  assert proc.wait(timeout=60) == -signal.SIGKILL and killed, "the run was not killed mid-stage"
  (run_b,) = (tmp_path / "b").iterdir()
  resumed = subprocess.run([sys.executable, "-m", "jaxagent", verb, "--resume", str(run_b)], env=_env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from" in resumed.stdout
  a, b = _final_params(run_a, steps), _final_params(run_b, steps)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)  # bitwise on CPU
  # metrics.jsonl is the uninterrupted run's, line for line (times aside).
  assert deterministic_lines(run_a) == deterministic_lines(run_b)
  ma = {r["iteration"]: r for r in deterministic_lines(run_a) if r.get("iteration") is not None}
  assert ma[steps] and len(ma) == steps
  if verb == "rft":  # the kept set was read back from the store, and the rounds did keep samples
    assert ma[steps]["rft/kept_total"] > 0 and "kept sample(s) of earlier rounds read back" in resumed.stdout
    order = lambda run: [(t.task.id, t.env.seed, t.metadata["rft"]["kept"])
                         for t in trajectory_store.read(run / "trajectories")]
    assert order(run_a) == order(run_b)
  if verb == "offline":  # the policy moved off the behavior policy: ratios are measured, not 1
    assert ma[steps]["offline/loss_tokens"] > 0 and ma[steps]["offline/ratio_mean"] != pytest.approx(1.0)


@pytest.mark.slow
def test_sft_and_offline_stages_on_two_processes_equal_one_process(tmp_path):
  """Each process trains its slice of the global batch (normalizers and offline statistics summed): 2 processes x
  1 device end where 1 process x 2 devices does, with update batches in length buckets (that both processes pick
  the same length is checked directly in tests/test_multihost.py: these values would agree even if they did not)."""
  from tests import _processes
  chats_file = _write_jsonl(tmp_path / "c.jsonl", CALC_CHATS)
  with trajectory_store.TrajectoryWriter(tmp_path / "store") as w:
    for i in range(12):
      w.write(_stored(i, passed=i % 3 == 0, group=f"g{i // 4}", version=i))
  stages = (f"curriculum.stages=[{{name: s, paradigm: sft, steps: 2, data: '{chats_file}'}}, "
            f"{{name: o, paradigm: offline, steps: 2, data: '{tmp_path / 'store'}', max_ratio: 2.0}}]")
  common = TINY + ["train.eval_episodes=0", "train.plots=false", "train.bc_steps=0", "train.iterations=4",
            "train.batch_length=bucket", stages]
  sets = lambda overrides: [x for o in overrides for x in ("--set", o)]
  subprocess.run([sys.executable, "-m", "jaxagent", "train", "tiny_cpu",
                  *sets(common + ["mesh.ici.data=2", f"run.root={tmp_path / 'ref'}"])],
                 check=True, env=_processes.cpu_env(2), cwd=ROOT, capture_output=True, timeout=900)
  launched = subprocess.run(
      [sys.executable, "launch/local.py", "-n", "2", "--devices-per-process", "1", "--timeout", "420", "--",
       "train", "tiny_cpu", *sets(common + [f"run.root={tmp_path / 'mh'}"])],
      env=_processes.cpu_env(1), cwd=ROOT, capture_output=True, text=True, timeout=1000)
  assert launched.returncode == 0, launched.stdout[-4000:] + launched.stderr[-4000:]
  (ref,), (mh,) = (tmp_path / "ref").iterdir(), (tmp_path / "mh").iterdir()
  assert mh.name.split("-", 2)[2][:8].isdigit() and len(mh.name) == len(ref.name)  # the date, not a cut int
  policy = lambda run: jax.tree.leaves(nnx.state(weights.load_model(run / "checkpoints")))  # any topology
  worst = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
              for x, y in zip(policy(ref), policy(mh), strict=True))
  assert worst <= 1e-6, f"max |Δparam| = {worst:.3g}"
  last = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
  assert last(ref)["offline/behavior_version_mean"] == pytest.approx(last(mh)["offline/behavior_version_mean"])


def test_verbs_refuse_bad_data_and_flags_with_one_line(tmp_path, capsys):
  from jaxagent import cli
  small = ["--set", f"run.root={tmp_path}", "--set", "env.pool.kind=inprocess"]
  assert cli.main(["offline", "tiny_cpu", "--data", str(tmp_path / "nothing"), *small]) == 2
  assert "no such file or directory" in capsys.readouterr().err
  (tmp_path / "empty").mkdir()
  assert cli.main(["sft", "tiny_cpu", "--data", str(tmp_path / "empty"), "--set", "train.bc_steps=0", *small]) == 2
  assert "no finished trajectory shard" in capsys.readouterr().err
  chat_file = _write_jsonl(tmp_path / "c.jsonl", CALC_CHATS)
  assert cli.main(["offline", "tiny_cpu", "--data", str(chat_file), *small]) == 2
  assert "use paradigm sft for chats" in capsys.readouterr().err
  (tmp_path / "bad.jsonl").write_bytes(b"\xff\xfe{}\n")
  assert cli.main(["sft", "tiny_cpu", "--data", str(tmp_path / "bad.jsonl"), "--set", "train.bc_steps=0", *small]) == 2
  assert "not UTF-8" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # argparse names the valid choices
    cli.main(["sft", "tiny_cpu", "--data", str(chat_file), "--verified", "yes"])
  assert "invalid choice: 'yes'" in capsys.readouterr().err
  with pytest.raises(config_lib.ConfigError, match="held-out success would measure"):
    config_lib.load("tiny_cpu", ["train.bc_steps=0", "train.iterations=2",
                                 "curriculum.stages=[{name: o, paradigm: offline, steps: 2, data: d, "
                                 "filter: {splits: [eval]}}]"])


def test_filtered_bc_trains_on_the_verified_episodes_only(tmp_path):
  with trajectory_store.TrajectoryWriter(tmp_path / "store") as w:
    for i in range(6):
      w.write(_stored(i, passed=i < 2))
  cfg = config_lib.load("tiny_cpu", TINY + [
      f"run.root={tmp_path}", "train.bc_steps=0", "train.eval_episodes=0", "train.plots=false", "train.iterations=2",
      f"curriculum.stages=[{{name: f, paradigm: offline, method: filtered_bc, steps: 2, data: '{tmp_path / 'store'}', "
      "filter: {verified: true}}]"])
  loop.train(cfg, run_dir=tmp_path / "run")
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  tokens = [r["offline/loss_tokens"] for r in rows if "offline/loss_tokens" in r]
  assert tokens == [2 * cfg.train.bc_batch_size] * 2  # every row a verified episode: 2 policy tokens each
  assert "offline/ratio_mean" not in rows[-1] and np.isfinite(rows[-1]["offline/nll"])
  fingerprint = json.loads((tmp_path / "run" / "data" / "f.json").read_text())
  assert fingerprint["selected"]["kept"] == 2 and fingerprint["selected"]["dropped/not_verified"] == 4


def test_a_resumed_stage_refuses_data_that_changed_since_it_began(tmp_path):
  import types
  from jaxagent.train import paradigms
  run = types.SimpleNamespace(run_dir=tmp_path)
  stage = config_lib.StageConfig(name="s", paradigm="sft", data="x")
  at = lambda iteration: types.SimpleNamespace(iteration=iteration, stage_start=0)
  paradigms._check_unchanged(run, at(0), stage, {"digest": "a"})   # the stage begins: recorded
  paradigms._check_unchanged(run, at(3), stage, {"digest": "a"})   # resumed on the same data
  with pytest.raises(config_lib.ConfigError, match="its data changed since the stage began"):
    paradigms._check_unchanged(run, at(3), stage, {"digest": "b"})
