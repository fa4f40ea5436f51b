"""Builds small, valid trajectories for tests (through `TokenStream`, the way the rollout engine does)."""

from __future__ import annotations

import numpy as np

import models
from jaxagent import trajectory as tj


def make(tokenizer=None, *, turns=(("ls", "a.txt b.txt"), ("cat a.txt", "hello <|eot|> world")),
         reward=1.0, task_id="task-0", seed=0, policy_version=3, group_id="",
         termination=tj.Termination.COMPLETED, rng=None) -> tj.Trajectory:
  """A trajectory with a system prompt, then per turn: sampled action + tool observation."""
  tok = tokenizer or models.ByteTokenizer()
  rng = rng or np.random.default_rng(seed)
  z = tj.TokenStream()
  z.control("<bos>", tj.Role.SYSTEM, tok)
  z.text("You are an agent.", tj.Role.SYSTEM, tok)
  z.control("<|user|>", tj.Role.SYSTEM, tok)
  z.text("List the files.", tj.Role.PROMPT, tok)
  recorded = []
  for i, (action, obs) in enumerate(turns):
    z.control("<|assistant|>", tj.Role.SYSTEM, tok)
    sampled = tok.encode(action) + [tok.special("<|eot|>")]
    logp = (-rng.random(len(sampled)) * 3).astype(np.float32)
    a_span = z.sampled(sampled, logp)
    z.control("<|tool|>", tj.Role.SYSTEM, tok)
    o_span = z.text(obs, tj.Role.TOOL, tok)
    recorded.append(tj.Turn(
        action=tj.Action(span=a_span, text=action, valid=True, parsed={"cmd": action}),
        observation=tj.ObservationRecord(span=o_span, text=obs, truncated=False, original_bytes=len(obs.encode())),
        reward=0.1 * i, reward_components={"progress": 0.1 * i}, policy_version=policy_version,
        t_decode_s=0.01, t_env_s=0.02))
  return tj.Trajectory(
      task=tj.TaskRecord(id=task_id, split="train", version="v1", prompt="List the files."),
      env=tj.EnvInfo(name="shell", version="sha256:abc", seed=seed),
      policy_version=policy_version, termination=termination,
      reward=tj.Reward(total=reward + sum(t.reward for t in recorded), gamma=1.0, terminal=reward,
                       components={"outcome": reward}),
      turns=tuple(recorded), id=f"{task_id}/{seed}", group_id=group_id,
      timing=tj.Timing(reset_s=0.5, verify_s=0.25),
      verifier=tj.VerifierRecord(name="pytest", version="1", passed=reward > 0, evidence={"log": "ok"}),
      **z.arrays())
