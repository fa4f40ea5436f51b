"""The Qwen3 recipe end to end: the real tokenizer and chat template, a random Qwen3-shaped model, JSON tool calls.

Token-in/token-out is checked against the sampler itself: every action token the sampler produced is in the
stored records exactly once, as policy (or reasoning) tokens, and nothing else is.
"""

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxagent import cli
from jaxagent import config as config_lib
from jaxagent import trajectory as tr
from jaxagent import trajectory_store
import models
from tests import _processes

ROOT = Path(__file__).resolve().parent.parent


# Trains in a child process with one CPU device (the test process has 8 fake ones, over which a 152k-vocabulary
# batch would be replicated), recording every action the sampler finished, in order.
DRIVER = """
import json, sys
from jaxagent import cli
from jaxagent.rollout import actors
actions, sampled = actors.SampledActions._actions, []
def recording_actions(self, running):
  out = actions(self, running)
  sampled.extend(list(a.tokens) for a in out.values())
  return out
actors.SampledActions._actions = recording_actions
code = cli.main(sys.argv[2:])
open(sys.argv[1], "w").write(json.dumps(sampled))
sys.exit(code)
"""


@pytest.mark.slow
def test_qwen3_recipe_trains_two_grpo_iterations_token_in_token_out(tmp_path, qwen3_tokenizer_dir, capsys):
  overrides = [f"run.root={tmp_path}", f"model.tokenizer={qwen3_tokenizer_dir}", "train.iterations=2",
               "train.bc_steps=12", "train.bc_batch_size=2", "train.eval_episodes=0", "env.pool.kind=inprocess"]
  config = config_lib.load("qwen3_tiny_cpu", overrides)
  (tmp_path / "driver.py").write_text(DRIVER)
  run = tmp_path / "run"
  done = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "sampled.json"), "train",
                         "qwen3_tiny_cpu", "--run-dir", str(run)] + [a for o in overrides for a in ("--set", o)],
                        env=_processes.cpu_env(1), cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "GRPO" in done.stderr and "cold start (BC)" in done.stderr
  sampled = [tuple(a) for a in json.loads((tmp_path / "sampled.json").read_text())]
  records = list(trajectory_store.read(run / "trajectories"))
  assert len(records) == 2 * config.train.tasks_per_iteration * config.train.group_size

  # The policy tokens are exactly the sampled ones: the same multiset of actions, nothing added or re-encoded.
  recorded = [tuple(t.action_tokens(k).tolist()) for t in records for k in range(len(t.turns))]
  assert collections.Counter(recorded) == collections.Counter(sampled) and sampled
  tok = models.HFTokenizer(qwen3_tokenizer_dir)
  observations = 0
  for t in records:
    sampled_roles = np.isin(t.roles, [tr.Role.POLICY, tr.Role.REASONING])
    spans = np.zeros(len(t), bool)
    for turn in t.turns:
      spans[slice(*turn.action.span)] = True
      if turn.observation is not None:  # a tool reply: never trained, framed by the template's tokens
        observations += 1
        body = slice(*turn.observation.span)
        assert set(t.roles[body]) <= {tr.Role.TOOL, tr.Role.ERROR} and not t.loss_mask[body].any()
        assert tok.decode(t.tokens[body]) == turn.observation.text[:len(tok.decode(t.tokens[body]))]
    assert (sampled_roles == spans).all()  # sampled tokens are the action spans, and only they
    assert not t.loss_mask[~sampled_roles].any()  # template, prompt and tool tokens carry no loss
    assert set(t.roles[~sampled_roles]) <= {tr.Role.PROMPT, tr.Role.TOOL, tr.Role.ERROR}
    assert t.reasoning.kept and t.env.invalid_action_rule == "error_observation"
    if t.termination in ("turn_budget_exhausted", "context_exhausted"):  # cut by the sampler, never stepped
      assert t.turns[-1].outcome == t.termination.value and t.turns[-1].observation is None
  assert observations > 0, "no episode reached a tool reply: the cold start did not teach <|im_end|>"
  assert any(turn.action.parsed for t in records for turn in t.turns) or observations

  # Drift is real: re-tokenizing the conversation's text differs from what was sampled for some trajectory
  # (BPE merges across the sampled tokens' boundaries, special-token text in tool replies), while the record
  # keeps the tokens the policy saw.
  drifted = [t for t in records if tok.encode_template(tok.decode(t.tokens)) != t.tokens.tolist()]
  assert drifted, "every trajectory re-tokenized to itself: the drift check has no power here"
  # ... and re-rendering it through the chat template from its messages differs too.
  t = drifted[0]
  prompt = tok.decode(t.tokens[:t.turns[0].action.span[0]])
  question = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S).group(1)
  messages = [{"role": "user", "content": question}]
  for k, turn in enumerate(t.turns):
    messages.append({"role": "assistant", "content": tok.decode(t.action_tokens(k), skip_special=True)})
    if turn.observation is not None:
      messages.append({"role": "tool", "content": turn.observation.text})
  from jaxagent.train.run import _env_info
  import envs
  tools = list(_env_info(envs.get("calculator"), 3).tools)
  rerendered = tok.encode_template(tok.render_chat(messages, tools=tools, add_generation_prompt=False))
  assert rerendered[:len(t)] != t.tokens.tolist()

  # `jaxagent inspect` decodes the stream by role with the real tokenizer; `generate --chat` samples from the run.
  capsys.readouterr()
  assert cli.main(["inspect", str(run / "trajectories"), "--format", "text", "--color", "never",
                   "--tokenizer", str(qwen3_tokenizer_dir)]) == 0
  shown = capsys.readouterr().out
  assert "<|im_start|>assistant" in shown and "<tool_response>" in shown and "roles: system prompt policy" in shown
  assert cli.main(["generate", "--model", str(run / "checkpoints"), "--chat", "--env", "calculator",
                   "--prompt", "3*4+5", "--max-new-tokens", "8", "--temperature", "1.0"]) == 0
  generated = capsys.readouterr()
  assert "finish=" in generated.err
