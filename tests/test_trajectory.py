"""Trajectory records, ArrayRecord storage (corruption, schema, crash safety, grain) and `jaxagent inspect`."""

import dataclasses
import json

import msgpack
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from jaxagent import cli, trajectory_store
from jaxagent import trajectory as tj
from tests import _trajectories


def _same(a: tj.Trajectory, b: tj.Trajectory) -> None:
  arrays = ("tokens", "roles", "loss_mask", "behavior_logprobs", "sampling_thresholds", "behavior_versions")
  for name in arrays:  # bytes: NaN (no threshold) compares equal to itself
    assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
  for f in dataclasses.fields(tj.Trajectory):
    if f.name not in arrays:
      assert getattr(a, f.name) == getattr(b, f.name), f.name


def test_enums_and_round_trip():
  assert [r.name.lower() for r in tj.Role] == ["system", "prompt", "policy", "tool", "error", "reasoning"]
  assert [t.value for t in tj.Termination] == [
      "completed", "max_turns", "context_exhausted", "turn_budget_exhausted", "invalid_action",
      "parser_rejected", "env_error", "env_timeout", "retries_exhausted", "cancelled"]
  t = _trajectories.make()
  t = dataclasses.replace(t, turns=(dataclasses.replace(t.turns[0], outcome="parser_rejected_continued"),
                                    *t.turns[1:]))
  assert tj.Termination is __import__("envs").Termination  # one vocabulary: the env's enum, not a copy
  assert t.schema == tj.SCHEMA_VERSION and t.group_id == "task-0"
  _same(tj.Trajectory.from_dict(t.to_dict()), t)
  _same(tj.Trajectory.from_dict(json.loads(json.dumps(t.to_dict(arrays_as="lists")))), t)
  _same(trajectory_store.decode(trajectory_store.encode(t)), t)
  assert not t.tokens.flags.writeable
  with pytest.raises(dataclasses.FrozenInstanceError):
    t.policy_version = 4


def test_invariants_are_checked():
  t = _trajectories.make()
  obs_start = t.turns[0].observation.span[0]
  mask = t.loss_mask.copy()
  mask[obs_start] = True
  with pytest.raises(tj.TrajectoryFormatError, match=r"loss_mask\[\d+\]=1 on a TOOL token"):
    dataclasses.replace(t, loss_mask=mask)
  logp = t.behavior_logprobs.copy()
  logp[t.turns[0].action.span[0]] = np.nan
  with pytest.raises(tj.TrajectoryFormatError, match="behavior_logprobs.*not finite on a loss token"):
    dataclasses.replace(t, behavior_logprobs=logp)
  with pytest.raises(tj.TrajectoryFormatError, match="roles: length"):
    dataclasses.replace(t, roles=t.roles[:-1])
  p = int(np.argmax(t.roles == tj.Role.PROMPT))
  bad_turn = dataclasses.replace(t.turns[0], action=dataclasses.replace(t.turns[0].action, span=(p, p + 2)))
  with pytest.raises(tj.TrajectoryFormatError, match=rf"turns\[0\].action.span: token {p} has role PROMPT"):
    dataclasses.replace(t, turns=(bad_turn,))
  with pytest.raises(ValueError, match="not_a_reason"):
    dataclasses.replace(t, termination="not_a_reason")
  roles = t.roles.copy()
  roles[t.turns[0].action.span[0]] = tj.Role.REASONING
  with pytest.raises(tj.TrajectoryFormatError, match="REASONING tokens present"):
    dataclasses.replace(t, roles=roles)
  with pytest.raises(tj.TrajectoryFormatError, match="loss_mask.*REASONING"):   # kept, but not trained
    dataclasses.replace(t, roles=roles, reasoning=tj.Reasoning(kept=True, trained=False))
  dataclasses.replace(t, roles=roles, reasoning=tj.Reasoning(kept=True, trained=True))
  # The return is the turns' discounted rewards plus the discounted terminal reward, never another number.
  with pytest.raises(tj.TrajectoryFormatError, match=r"reward.total=2.0 != .* = 1.1"):
    dataclasses.replace(t, reward=dataclasses.replace(t.reward, total=2.0))
  gamma = dataclasses.replace(t.reward, gamma=0.5, total=0.0 + 0.5 * 0.1 + 0.25 * 1.0)
  assert dataclasses.replace(t, reward=gamma).reward.total == pytest.approx(0.3)
  with pytest.raises(tj.TrajectoryFormatError, match="turn outcome 'fine'"):
    dataclasses.replace(t.turns[0], outcome="fine")
  with pytest.raises(tj.TrajectoryFormatError, match="invalid_action_rule='skip'"):
    dataclasses.replace(t.env, invalid_action_rule="skip")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema=99), r"unknown schema version 99 .*reads versions \(1, 2, 3, 4, 5, 6, 7\)"),
    (lambda d: d.pop("schema"), "unknown schema version None"),
    (lambda d: d.update(kind="other"), "record kind 'other'"),
    (lambda d: d.pop("env"), "missing field 'env'"),
    (lambda d: d.update(surprise=1), r"unknown fields \['surprise'\]"),
    (lambda d: d.update(termination="done"), "termination='done': not one of"),
    (lambda d: d.update(tokens=b"\x00\x01\x02"), "tokens: 3 bytes is not a multiple of 4"),
    (lambda d: d["turns"][0]["action"].update(span=[1]), r"turns\[0\].action.span=\[1\]"),
    (lambda d: d.update(policy_version="3"), "policy_version='3': expected an integer"),
])
def test_malformed_records_are_clear_errors(mutate, message):
  d = _trajectories.make().to_dict()
  mutate(d)
  with pytest.raises(tj.TrajectoryFormatError, match=message):
    trajectory_store.decode(msgpack.packb(d, use_bin_type=True))
  with pytest.raises(tj.TrajectoryFormatError, match="not a msgpack record"):
    trajectory_store.decode(b"\xc1garbage")


def test_store_round_trip_and_grain(tmp_path):
  made = [_trajectories.make(seed=s) for s in range(5)]
  with trajectory_store.TrajectoryWriter(tmp_path / "traj", records_per_shard=2) as w:
    for t in made:
      w.write(t)
  files = trajectory_store.list_files(tmp_path / "traj")
  assert [f.name for f in files] == [f"trajectories-0000{i}.array_record" for i in range(3)]
  for a, b in zip(trajectory_store.read(tmp_path / "traj"), made):
    _same(a, b)
  import grain
  source = trajectory_store.data_source(tmp_path / "traj")
  assert isinstance(source, grain.sources.ArrayRecordDataSource) and len(source) == 5
  ids = [t.id for t in grain.MapDataset.source(source).map(trajectory_store.decode)]
  assert ids == [t.id for t in made]


def test_crash_loses_only_the_open_shard(tmp_path):
  w = trajectory_store.TrajectoryWriter(tmp_path, records_per_shard=2)
  for s in range(3):
    w.write(_trajectories.make(seed=s))
  # "Crash": the process dies with shard 1 open. Only the finished shard is visible.
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "trajectories-00000.array_record", "trajectories-00001.array_record.partial"]
  assert [t.id for t in trajectory_store.read(tmp_path)] == ["task-0/0", "task-0/1"]
  # A restarted writer never touches earlier files: numbering continues past the abandoned shard.
  with trajectory_store.TrajectoryWriter(tmp_path, records_per_shard=2) as w2:
    w2.write(_trajectories.make(seed=7))
  assert w2.finished[0].name == "trajectories-00002.array_record"
  assert [t.id for t in trajectory_store.read(tmp_path)] == ["task-0/0", "task-0/1", "task-0/7"]


def _bad_dir(tmp_path):
  """good.array_record (3 ok), mixed.array_record (ok, schema 99, garbage, missing field, ok), junk file."""
  d = tmp_path / "runs"
  with trajectory_store.TrajectoryWriter(d, prefix="a-good") as w:
    for s in range(3):
      w.write(_trajectories.make(seed=s))
  wrong = _trajectories.make(seed=11).to_dict()
  wrong["schema"] = 99
  missing = _trajectories.make(seed=12).to_dict()
  del missing["tokens"]
  raw = ArrayRecordWriter(str(d / "b-mixed.array_record"), trajectory_store.WRITER_OPTIONS)
  for rec in (trajectory_store.encode(_trajectories.make(seed=10)), msgpack.packb(wrong), b"\x00not msgpack",
              msgpack.packb(missing), trajectory_store.encode(_trajectories.make(seed=13))):
    raw.write(rec)
  raw.close()
  (d / "c-junk.array_record").write_bytes(b"this is not an array record file" * 10)
  return d


def test_bad_records_name_file_and_index_and_nothing_else_is_lost(tmp_path):
  d = _bad_dir(tmp_path)
  with pytest.raises(trajectory_store.TrajectoryReadError, match=r"b-mixed.array_record: record 1: unknown schema"):
    list(trajectory_store.read(d))
  errors = []
  ids = [t.id for t in trajectory_store.read(d, errors)]
  assert ids == ["task-0/0", "task-0/1", "task-0/2", "task-0/10", "task-0/13"]
  assert [(e.path.split("/")[-1], e.index) for e in errors] == [
      ("b-mixed.array_record", 1), ("b-mixed.array_record", 2), ("b-mixed.array_record", 3),
      ("c-junk.array_record", None)]
  assert "unknown schema version 99" in str(errors[0]) and "not a msgpack record" in str(errors[1])
  assert "missing field 'tokens'" in str(errors[2]) and "not a readable ArrayRecord file" in str(errors[3])


def test_corrupted_bytes_damage_only_their_records(tmp_path):
  made = [_trajectories.make(seed=s) for s in range(8)]
  with trajectory_store.TrajectoryWriter(tmp_path, records_per_shard=100) as w:
    for t in made:
      w.write(t)
  path = trajectory_store.list_files(tmp_path)[0]
  data = bytearray(path.read_bytes())
  # Chunks come first, then zero padding, then the footer: flip a run of bytes in the middle of the chunks.
  used = max(i for i in range(min(len(data), 1 << 16)) if data[i])
  for k in range(used // 2, used // 2 + 20):
    data[k] ^= 0xFF
  path.write_bytes(bytes(data))
  errors = []
  got = {t.id: t for t in trajectory_store.read_file(path, errors)}
  assert errors, "the corruption went unnoticed"
  assert all(e.path == str(path) and e.index is not None and "corrupt record" in str(e) for e in errors)
  assert len(got) + len(errors) == len(made) and len(got) >= len(made) - 2
  bad = {e.index for e in errors}
  for i, t in enumerate(made):
    if i not in bad:
      _same(got[t.id], t)


def test_inspect_cli(tmp_path, capsys):
  d = tmp_path / "t"
  with trajectory_store.TrajectoryWriter(d) as w:
    w.write(_trajectories.make(turns=(("ls", "x\x1b[2J<script>alert(1)</script> <|eot|>"),)))
  assert cli.main(["inspect", str(d), "--format", "jsonl"]) == 0
  obj = json.loads(capsys.readouterr().out.strip())
  assert set(obj) == {"schema", "task", "env", "policy_version", "termination", "reward", "turns", "tokens",
                      "roles", "loss_mask", "behavior_logprobs", "timing", "verifier"}
  assert set(obj["task"]) == {"id", "split", "version", "prompt"} and set(obj["env"]) == {"name", "version", "seed"}
  assert obj["task"]["prompt"] == "List the files."
  assert set(obj["reward"]) == {"total", "components", "gamma"}
  assert set(obj["turns"][0]) == {"action", "observation", "reward", "policy_version", "t_decode_s", "t_env_s"}
  assert set(obj["turns"][0]["action"]) == {"text", "valid"}
  assert set(obj["turns"][0]["observation"]) == {"text", "truncated", "original_bytes"}
  assert set(obj["timing"]) == {"reset_s", "verify_s"} and set(obj["verifier"]) == {"name", "version", "passed"}
  assert obj["roles"][0] == "system" and obj["behavior_logprobs"][0] is None and obj["termination"] == "completed"
  assert len(obj["tokens"]) == len(obj["roles"]) == len(obj["loss_mask"]) == len(obj["behavior_logprobs"])

  assert cli.main(["inspect", str(d), "--format", "text", "--color", "always", "--tokenizer", "byte"]) == 0
  text = capsys.readouterr().out
  assert "\x1b[32mls<|eot|>\x1b[0m" in text          # policy tokens in green
  assert "\x1b[2J" not in text and "\\x1b[2J" in text  # the tool output cannot drive the terminal
  assert "termination completed" in text and "prompt: List the files." in text

  page = tmp_path / "p.html"
  assert cli.main(["inspect", str(d), "--format", "html", "-o", str(page)]) == 0
  html = page.read_text()
  assert html.startswith("<!doctype html>") and "<script>" not in html and "&lt;script&gt;" in html

  bad = _bad_dir(tmp_path)
  assert cli.main(["inspect", str(bad)]) == 1
  out = capsys.readouterr()
  assert len(out.out.strip().splitlines()) == 5
  assert "b-mixed.array_record: record 1: unknown schema version 99" in out.err


def test_inspect_filters_by_reward_verdict_termination_outcome_split_and_task(tmp_path, capsys):
  d = tmp_path / "t"
  made = [_trajectories.make(task_id=f"calc-{i}", seed=i, reward=float(i % 2),
                             termination=tj.Termination.COMPLETED if i < 4 else tj.Termination.MAX_TURNS)
          for i in range(6)]
  made[2] = dataclasses.replace(made[2], task=dataclasses.replace(made[2].task, split="eval"))
  made[3] = dataclasses.replace(made[3], turns=made[3].turns[:-1] + (
      dataclasses.replace(made[3].turns[-1], outcome="invalid_action"),))
  with trajectory_store.TrajectoryWriter(d) as w:
    for t in made:
      w.write(t)

  def shown(*flags):
    assert cli.main(["inspect", str(d), *flags]) == 0
    return [json.loads(x)["task"]["id"] for x in capsys.readouterr().out.split("\n") if x]

  assert shown("--min-reward", "1.05") == ["calc-1", "calc-3", "calc-5"]   # 1 + the turn rewards (0.1)
  assert shown("--max-reward", "0.5", "--termination", "max_turns") == ["calc-4"]
  assert shown("--verdict", "pass") == ["calc-1", "calc-3", "calc-5"]
  assert shown("--split", "eval") == ["calc-2"]
  assert shown("--outcome", "invalid_action") == ["calc-3"]
  assert shown("--task", "calc-4", "--task", "calc-0") == ["calc-0", "calc-4"]
  assert shown("--task", "calc-", "--limit", "2") == ["calc-0", "calc-1"]
  assert shown("--verdict", "fail", "--verdict", "none") == ["calc-0", "calc-2", "calc-4"]
