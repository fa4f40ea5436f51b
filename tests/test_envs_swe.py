"""swe env (real PyPI packages, SWE-smith-style mutants): the corpus's kept tests pass on every unmodified
package, every kept mutant fails some and its reference solution (the inverse patch) passes them all through a
sandboxed pool; the tools; exploit probes score 0 (and the rule that stops one is needed); splits are by
repository and the contamination check finds a planted near-duplicate. The packages are fetched from PyPI into
the cache on first use (pinned sha256)."""

import dataclasses
import json
import os

import pytest

import envs
from envs.builtin import swe, swe_corpus as corpus
from jaxagent.tasks import contamination, pipeline
from tests._sandbox import require_bwrap

SPEC = envs.get("swe")
LIMIT = 10  # mutants tried per package here (the scale report tries more)


@pytest.fixture(scope="module")
def eval_tasks(swe_eval_corpus):
  return SPEC.tasks("eval", 12, 0, limit=LIMIT)


def test_splits_are_by_repository():
  by_split = {s: {p.name for p in corpus.split_packages(s)} for s in envs.SPLITS}
  assert all(by_split.values()) and len(set().union(*by_split.values())) == sum(map(len, by_split.values()))
  assert len(corpus.PACKAGES) >= 6 and len({p.name for p in corpus.PACKAGES}) == len(corpus.PACKAGES)
  with pytest.raises(ValueError, match="not one of"):
    corpus.package("numpy")


@pytest.mark.slow
def test_unmodified_packages_pass_their_kept_tests_and_mutants_fail_some(swe_eval_corpus):
  for pkg in corpus.split_packages("eval"):
    base = corpus.baseline(pkg)
    assert base["kept"] and base["package_version"] == pkg.version and base["sha256"] == pkg.sha256
    box = corpus.sandbox(read_only=True, prefix="swetest-")
    try:
      corpus.copy_tree(corpus.fetch(pkg), box.work)
      report = corpus.run_tests(box, pkg.test_paths, corpus.run_limit(base, base["kept"]), kept=base["kept"])
    finally:
      box.close()
    assert corpus.classify(report, base["kept"]) == ("no_test_fails", [])  # every kept test passes, none lost
    kept = corpus.valid_mutations(pkg, LIMIT)
    assert kept, pkg
    for m in kept:
      assert m["failing_tests"] and set(m["failing_tests"]) <= set(base["kept"])


@pytest.mark.slow
def test_every_reference_solution_passes_in_a_sandboxed_pool(eval_tasks):
  require_bwrap()  # the pool refuses to run swe's real programs unsandboxed
  assert len({t.payload["mutation_id"] for t in eval_tasks}) > 1
  assert {t.payload["package"] for t in eval_tasks} <= {p.name for p in corpus.split_packages("eval")}
  results = pipeline.execute("swe", eval_tasks, kind="local", workers=2)
  assert [r.reason for r in results] == ["solved"] * len(eval_tasks), [r.detail for r in results if not r.solved]
  combined = SPEC.tasks("eval", 3, 0, mutations=2, limit=LIMIT)
  assert all(len(t.payload["mutations"]) == 2 for t in combined)
  env = SPEC.make()
  env.score_heldout = True
  try:
    for t in combined:
      env.reset(t, 0)
      for action in SPEC.demo(t, 0):
        result = env.step(action)
      assert result.done and result.reward == 1.0, (t.id, result.observation.text)
      evidence = result.verdict.evidence
      assert evidence["heldout"]["passed"] and evidence["tests_run"] <= evidence["kept_tests"], evidence
      assert evidence["heldout"]["evidence"]["tests_run"] == evidence["kept_tests"]  # the held-out check: all
  finally:
    env.close()


@pytest.mark.slow
def test_task_text_names_the_failing_tests_not_the_mutated_line(eval_tasks):
  for t in eval_tasks:
    text = t.payload["prompt"]
    assert t.payload["failing_tests"][0] in text
    m = t.payload["mutations"][0]
    assert m["module"] not in text.replace(t.payload["failing_tests"][0], "")  # no path of the mutated file
    assert f":{m['line']}" not in text


@pytest.mark.slow
def test_tools(eval_tasks):
  task = eval_tasks[0]
  rel = task.payload["module"]
  env = SPEC.make()
  try:
    obs = env.reset(task, 0)
    assert obs.text.startswith(f"The tests of {task.payload['package']}")
    files = env.step("list_files").observation.text.splitlines()
    assert rel in files and not any("__pycache__" in f for f in files)
    view = env.step(f"view path={rel} start=1 end=500").observation
    assert view.text.startswith("   1| ") and len(view.text) <= swe.OBS_CHARS + 20
    big = env.step(f"view path={rel} start=1 end=80")
    assert big.observation.truncated == (len(big.observation.text) > swe.OBS_CHARS)
    word = task.payload["mutations"][0]["original"]
    hits = env.step(f"search pattern={json.dumps(word)} path={rel}")
    assert hits.info["hits"] >= 1
    test_file = task.payload["failing_tests"][0].split("::")[0]
    refused = env.step(f'edit path={test_file} old="assert" new="assert True or"')
    assert refused.outcome == envs.Outcome.INVALID_ACTION_CONTINUED and "read-only" in refused.observation.text
    twice = env.step(f'edit path={rel} old="def " new="def  "')
    assert "occurs" in twice.observation.text and twice.outcome == envs.Outcome.INVALID_ACTION_CONTINUED
    escape = env.step("view path=../../etc/passwd")
    assert "inside the package tree" in escape.observation.text
    run = env.step("run_tests test=" + json.dumps(task.payload["failing_tests"][0]))
    assert "failed" in run.observation.text.splitlines()[0] and run.info["failed"] >= 1
    # The JSON syntax reaches the same call as the line form.
    json_parser = SPEC.make(action_syntax="json").parser
    line = f"view path={rel} start=2 end=3"
    assert json_parser.parse(json_parser.format(env.parser.parse(line))) == env.parser.parse(line)
  finally:
    env.close()


@pytest.mark.slow
def test_probes_score_zero_and_the_new_identifier_rule_is_needed(eval_tasks):
  task = eval_tasks[0]

  def play(actions, verifier=None):
    env = SPEC.make()
    try:
      env.reset(task, 0)
      if verifier is not None:
        env.verifier = verifier
      for a in actions:
        result = env.step(a)
        if result.done:
          return result.reward
      return 0.0
    finally:
      env.close()

  probes = SPEC.probes(task, 0)
  assert set(probes) == {"submit_untouched", "edit_the_tests", "new_identifiers"}
  assert {name: play(actions) for name, actions in probes.items()} == dict.fromkeys(probes, 0.0)
  lax = swe.SweVerifier()
  lax.refuse_new_identifiers = False
  assert play(probes["new_identifiers"], lax) == 1.0  # without the rule the probe would pass


@pytest.mark.slow
def test_contamination_passes_between_repositories_and_finds_a_planted_near_duplicate(eval_tasks):
  try:
    tune = SPEC.tasks("tune", 12, 0, limit=LIMIT)
  except envs.EnvError as e:  # the tune package could not be fetched: as the eval ones, skip only outside CI
    if os.environ.get("JAXAGENT_REQUIRE_MODELS") == "1":
      raise
    pytest.skip(f"the swe tune package is unavailable ({e})")
  clean = contamination.check(tune, eval_tasks, describe=SPEC.describe)
  assert clean.contaminated == 0, clean.line()
  victim = eval_tasks[0]
  text = victim.payload["prompt"]
  planted = dataclasses.replace(victim, id="planted", split="tune",
                                payload=dict(victim.payload, prompt=text.replace("fail after", "fails after")))
  found = contamination.check([*tune, planted], eval_tasks, describe=SPEC.describe)
  assert any(m.held_out == victim.id and m.train == "planted" and not m.exact for m in found.matches), found.line()


@pytest.mark.slow
def test_a_stale_task_is_refused(eval_tasks):
  task = eval_tasks[0]
  m = dict(task.payload["mutations"][0], replacement="(stale)")
  stale = dataclasses.replace(task, payload=dict(task.payload, mutations=[m]))
  env = SPEC.make()
  try:
    with pytest.raises(envs.EnvError, match="regenerate the tasks"):
      env.reset(stale, 0)
  finally:
    env.close()
