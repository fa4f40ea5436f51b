"""The high-reward-failure report of an evaluation suite: episodes a person should read before a release.

Three kinds, each with the reason it is listed above the episode (prompt, actions, observations by role):
  heldout      the training verifier passed it, the env's held-out verifier rejected it (proxy vs target);
  perturbation the task was solved clean and failed under a perturbation or a cut budget (same task, same env
               seed): what the policy does when a tool misbehaves;
  reward       its return reached `min_reward` although the verifier failed it (progress or shaping rewards
               that pay for not finishing).
Episodes are paired across conditions by (task id, env seed): every condition runs the same ones.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxagent import trajectory as tr
from jaxagent import trajectory_render

KINDS = ("heldout", "perturbation", "reward")


@dataclasses.dataclass(frozen=True)
class Failure:
  kind: str
  condition: str
  why: str
  trajectory: tr.Trajectory


def heldout_verdict(t: tr.Trajectory) -> bool | None:
  """What the env's held-out verifier said of the episode (None: it did not score it)."""
  evidence = t.verifier.evidence if isinstance(t.verifier.evidence, dict) else {}
  held = evidence.get("heldout")
  return bool(held["passed"]) if isinstance(held, dict) and "passed" in held else None


def _evidence(t: tr.Trajectory) -> str:
  if t.verifier.passed is None:
    return "none (the episode ended before the verifier ran)"
  evidence = dict(t.verifier.evidence) if isinstance(t.verifier.evidence, Mapping) else {}
  evidence.pop("heldout", None)
  return json.dumps(evidence, default=str)[:400]


def find(results: Mapping[str, Any], *, min_reward: float = 0.5, limit: int = 20) -> list[Failure]:
  """The report's episodes (at most `limit` of each kind) from the suite's condition results (this process's
  episodes: `ConditionResult.trajectories`)."""
  out: dict[str, list[Failure]] = {k: [] for k in KINDS}
  clean = {(t.task.id, t.env.seed): t for t in results["clean"].trajectories}
  for name, result in results.items():
    where = name if not result.overrides else f"{name} ({' '.join(result.overrides)})"
    for t in result.trajectories:
      held = heldout_verdict(t)
      if t.verifier.passed and held is False:
        evidence = t.verifier.evidence["heldout"]
        out["heldout"].append(Failure("heldout", name, (
            f"{where}: the training verifier {t.verifier.version} passed it (return {t.reward.total:g}); the "
            f"held-out verifier {evidence.get('version')} rejected it: {json.dumps(evidence.get('evidence'))}"), t))
      pair = clean.get((t.task.id, t.env.seed))
      if name != "clean" and pair is not None and pair.verifier.passed and not t.verifier.passed:
        out["perturbation"].append(Failure("perturbation", name, (
            f"solved clean (return {pair.reward.total:g}, {len(pair.turns)} turns); under {where} it ended "
            f"{t.termination.value} after {len(t.turns)} turns, return {t.reward.total:g}, verdict "
            f"{_evidence(t)}"), t))
      if not t.verifier.passed and t.reward.total >= min_reward:
        out["reward"].append(Failure("reward", name, (
            f"{where}: return {t.reward.total:g} >= {min_reward:g} ({dict(t.reward.components)}) but the verifier "
            f"failed it: {_evidence(t)}"), t))
  return [f for k in KINDS for f in out[k][:limit]]


def write(path: Path | str, report: Mapping[str, Any], failures: Sequence[Failure], tokenizer=None) -> Path:
  """The HTML page: the suite's table, then every listed episode under its reason."""
  path = Path(path)
  rows = "".join(
      f"<tr><td style=text-align:left>{html.escape(name)}</td><td>{html.escape(r['kind'])}</td>"
      f"<td>{r['success']:.3f}</td><td>[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]</td>"
      f"<td>{'' if r.get('drop') is None else format(r['drop'], '+.3f')}</td>"
      f"<td>{'' if r.get('heldout_success') is None else format(r['heldout_success'], '.3f')}</td>"
      f"<td style=text-align:left>{html.escape(json.dumps(r['terminations']))}</td></tr>"
      for name, r in report["conditions"].items())
  counts = {k: sum(f.kind == k for f in failures) for k in KINDS}
  body = [f"<h1>{html.escape(report['suite'])}: high-reward failures</h1>",
          f"<p>{html.escape(report['run'])}, checkpoint step {report.get('checkpoint_step')}, "
          f"{html.escape(report['split'])} split, {report['episodes']} episodes per condition.</p>",
          "<table><tr><th>condition</th><th>kind</th><th>success</th><th>95% CI</th><th>drop</th>"
          f"<th>held-out verifier</th><th>terminations</th></tr>{rows}</table>",
          "<p>Listed: " + ", ".join(f"{k} {n}" for k, n in counts.items()) + ".</p>"]
  if not failures:
    body.append("<p>No episode to read: none passed training but failed the held-out verifier, none solved "
                "clean failed a perturbation, none reached the reward threshold without passing.</p>")
  for k in KINDS:
    mine = [f for f in failures if f.kind == k]
    if mine:
      body.append(f"<h2 id={k}>{html.escape(k)}</h2>")
      body += [trajectory_render.trajectory_html(f.trajectory, tokenizer, note=f.why) for f in mine]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(trajectory_render.page(f"{report['suite']}: high-reward failures", "".join(body)))
  return path
