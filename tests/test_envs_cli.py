"""`jaxagent envs list` / `envs check`: names first, measured 100% replay for deterministic built-ins."""

import pytest

import envs
from envs import cli


def test_list_prints_name_version_description(capsys):
  assert cli.main(["list"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [l.split()[0] for l in lines] == envs.names()
  assert all(l.split()[1] == envs.get(l.split()[0]).version for l in lines)


@pytest.mark.parametrize("name", ["calculator", "guess", "gridworld"])
def test_check_measures_full_replay(name):
  r = cli.check(name, episodes=8)
  assert r["replay_rate"] == 1.0
  assert r["outcomes"]["completed"] == 16 and r["outcomes"]["parser_rejected_continued"] == 16
  assert 0 < r["latency_s"]["p50"] <= r["latency_s"]["max"] < 1.0


def test_check_through_local_workers(capsys):
  assert cli.main(["check", "calculator", "--episodes", "4", "--pool", "local"]) == 0
  out = capsys.readouterr().out
  assert "deterministic replay rate: 100.0%" in out and "p50=" in out
