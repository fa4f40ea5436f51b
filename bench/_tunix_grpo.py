"""Runs inside a venv with google-tunix: times tunix's agentic GRPO learner (`tunix.rl.agentic`) on the setup of
bench/grpo_vs_tunix.py. Prints one JSON line with the steady-state numbers (or {"error": ...}).

What tunix needs and what this file supplies (adapters only; nothing here changes how tunix trains):
  * model: tunix's own Qwen3 (`tunix.models.qwen3`) with the bench's shape, random weights, float32.
  * tokenizer: `ByteTokenizer`, the byte layout of our `models.ByteTokenizer` (ids 0..255 bytes, 256 <pad>,
    257 <bos>, 258 <eos>, 259 <|user|>, 260 <|assistant|>, 261 <|tool|>, 262 <|eot|>, 263 <|think|>). Unlike
    ours, `encode` turns control-token *text* into the control id: tunix renders chats to strings and
    re-encodes them. Bytes round-trip exactly (surrogateescape).
  * chat template: `ByteChatParser` renders our layout:
      <bos><|user|>{obs}<|eot|><|assistant|>{action}<|tool|>{obs}<|eot|><|assistant|>{action}
    (empty system message renders to nothing; the assistant turn has no end marker since the action ends
    with its own stop token, as in ours).
  * agent: `ToolObsAgent` = tunix's ModelAgent, but observations after the first are `tool` messages.
  * env: `GuessTaskEnv(BaseTaskEnv)` wraps the very same env class as our side (`envs.get(name).make(...)`
    from this repo, plain Python), with max_steps = max_turns and observations cut to `--obs-tokens` bytes
    (= tokens), as our engine cuts them.
  * learner: `PerTurnCapLearner` = tunix's agentic GRPOLearner with `_model_call` capping each turn at
    `--max-new` tokens. tunix's own cap is the episode's remaining response budget (max_response_length,
    which must also equal the rollout's max_tokens_to_generate); max_response_length is set to
    turns*max_new + the observations + 1, so the cap only makes "max tokens per turn" equal on both sides.
  * timing: `rl_cluster.update_actor` is wrapped to record the end of each optimizer step (after blocking on
    the new parameters) and the tokens of the batch it trained on. Iteration k's time is the gap between
    the ends of steps k-1 and k (rollout + advantages + update, as for ours); the first `--warmup` steps are warm-up
    (the first one's start is `learner.train()`'s call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

SPECIALS = ("<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|tool|>", "<|eot|>", "<|think|>")


class ByteTokenizer:
  def __init__(self):
    self.ids = {name: 256 + i for i, name in enumerate(SPECIALS)}
    self.names = {i: name for name, i in self.ids.items()}

  def encode(self, text, **kwargs):
    out, i = [], 0
    while i < len(text):
      j = min((k for k in (text.find(s, i) for s in SPECIALS) if k >= 0), default=len(text))
      out += list(text[i:j].encode("utf-8", errors="surrogateescape"))
      if j == len(text):
        break
      name = next(s for s in SPECIALS if text.startswith(s, j))
      out.append(self.ids[name])
      i = j + len(name)
    return out

  def decode(self, ids, **kwargs):
    parts, buf = [], bytearray()
    for t in (int(t) for t in ids):
      if t < 256:
        buf.append(t)
      elif t in self.names:
        parts.append(buf.decode("utf-8", errors="surrogateescape"))
        buf = bytearray()
        parts.append(self.names[t])
    parts.append(buf.decode("utf-8", errors="surrogateescape"))
    return "".join(parts)

  def bos_id(self):
    return 257

  def eos_id(self):
    return 258

  def pad_id(self):
    return 256


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tasks", type=int, default=4)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--iters", type=int, default=3)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--max-new", type=int, default=16)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--obs-tokens", type=int, default=16)
  p.add_argument("--env", default="guess")
  p.add_argument("--max-turns", type=int, default=2)
  p.add_argument("--max-context", type=int, default=128)
  p.add_argument("--lr", type=float, default=1e-4)
  p.add_argument("--repo", required=True)
  args = p.parse_args()
  try:
    print(json.dumps(run(args)), flush=True)
    sys.stdout.flush()
    os._exit(0)  # tunix's rollout loop / executor threads would keep the process alive
  except Exception as e:  # report exactly why and where
    tb = traceback.extract_tb(e.__traceback__)
    where = f"{tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name}" if tb else "?"
    print(traceback.format_exc(), file=sys.stderr)
    print(json.dumps({"error": f"{type(e).__name__}: {e} (at {where})"}), flush=True)
    sys.stderr.flush()
    os._exit(1)


def run(args) -> dict:
  sys.path.insert(0, args.repo)
  import envs  # this repo's env package: plain Python, no JAX
  import jax
  import optax
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.agentic import agentic_grpo_learner as grpo
  from tunix.rl.agentic.agents import model_agent
  from tunix.rl.agentic.environments import base_environment
  from tunix.rl.agentic.parser.chat_template_parser import parser as parser_lib
  from tunix.rl.rollout import base_rollout

  spec = envs.get(args.env)
  pool_cfg = envs.pool.PoolConfig(env=args.env, kind="inprocess", max_turns=args.max_turns,
                                  invalid_action="error_observation")
  opts = pool_cfg.reset_options()
  env_kwargs = dict(max_turns=opts["max_turns"], max_obs_bytes=opts["max_obs_bytes"],
                    invalid_action=envs.InvalidActionRule(opts["invalid_action"], opts["penalty"]))
  n_batches = args.warmup + args.iters
  tasks = spec.tasks("train", args.tasks * n_batches, 0)

  class ByteChatParser(parser_lib.BaseChatTemplateParser):
    def _init_tokens(self):
      return parser_lib.TokenConfig(bos_token="<bos>", eos_token="<eos>", eot_token="<|eot|>",
                                    user_token="<|user|>", assistant_token="<|assistant|>")

    def _init_generation_prompt(self):
      return self.tokens.assistant_token

    def _parse_system(self, content):
      return content and "<|user|>" + content + "<|eot|>"

    def _parse_assistant(self, content):
      return self.tokens.assistant_token + content

    def _parse_tool(self, content):
      return "<|tool|>" + content + "<|eot|>"

  class ToolObsAgent(model_agent.ModelAgent):
    def _observation_to_messages(self, observation, reward, done, info):
      if isinstance(observation, str):
        self._messages.append({"role": "tool", "content": observation})
      else:
        super()._observation_to_messages(observation, reward, done, info)

  class GuessTaskEnv(base_environment.BaseTaskEnv):
    """Our env class, stepped in-process; one episode per instance (tunix makes one per trajectory)."""

    def __init__(self, single_example, *, obs_tokens, **kwargs):
      super().__init__(task=dict(single_example), max_steps=args.max_turns, **kwargs)
      self.index = int(np.asarray(single_example["task_index"]).reshape(-1)[0])
      self.obs_tokens = obs_tokens
      self.env = spec.make(**env_kwargs)

    def _initial_observation(self):
      seed = hash((self.extra_kwargs.get("group_id"), self.extra_kwargs.get("pair_index"))) & 0x7FFFFFFF
      obs = self.env.reset(tasks[self.index], seed)
      return {"prompts": obs.text}

    def _step_impl(self, action):
      text = getattr(action, "action", action)
      r = self.env.step(text)
      cut = r.observation.text.encode("utf-8", errors="surrogateescape")[:self.obs_tokens]
      return base_environment.EnvStepResult(observation=cut.decode("utf-8", errors="surrogateescape"),
                                            reward=float(r.reward), done=bool(r.done), info={})

  class PerTurnCapLearner(grpo.GRPOLearner):
    def _model_call(self, chat_lists, env=None, max_generation_steps=None):
      cap = args.max_new if max_generation_steps is None else min(args.max_new, max_generation_steps)
      return super()._model_call(chat_lists, env, max_generation_steps=cap)

  tok = ByteTokenizer()
  # tunix stops an episode as soon as its response tokens reach max_response_length (checked right after a
  # model call, dropping that call's action): one spare token keeps the last full-length turn.
  max_response = args.max_turns * args.max_new + (args.max_turns - 1) * (args.obs_tokens + 3) + 1
  max_prompt = args.max_context - args.max_new - 40  # the longest rendered prompt (turn 2) is ~66 tokens
  config = qwen3.ModelConfig(num_layers=4, vocab_size=264, embed_dim=128, hidden_dim=384, num_heads=4,
                             head_dim=32, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6,
                             use_tied_embedding=True)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  mesh_cm = jax.set_mesh(mesh)  # held for the whole run: optimizer state must be created under the mesh
  mesh_cm.__enter__()
  model = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=max_response, max_prompt_length=max_prompt, kv_cache_size=args.max_context,
      temperature=args.temperature, top_p=1.0, top_k=None, eos_tokens=[10, 262, 258], return_logprobs=True)
  training_config = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr)),
      eval_every_n_steps=10**9, max_steps=n_batches, mini_batch_size=args.tasks,
      train_micro_batch_size=args.tasks)
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False, training_config=training_config,
      rollout_config=rollout_config)
  cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tok, cluster_config=cluster_config)
  algo = grpo.GRPOConfig(num_generations=args.group, num_iterations=1, beta=0.0, epsilon=0.2,
                         loss_agg_mode="token-mean", max_response_length=max_response,
                         max_concurrency=args.tasks * args.group, system_prompt="")
  learner = PerTurnCapLearner(rl_cluster=cluster, algo_config=algo, chat_parser=ByteChatParser(tok),
                              agent_class=ToolObsAgent, env_class=GuessTaskEnv,
                              env_kwargs=dict(obs_tokens=args.obs_tokens))

  marks, records = [], []
  update_actor = cluster.update_actor

  def timed_update_actor(train_ds, eval_ds, skip_jit=False):
    loss = tokens = rows = 0
    for ex in train_ds:
      loss += int(np.sum(np.asarray(ex.completion_mask)))
      tokens += int(np.sum(np.asarray(ex.prompt_mask))) + int(np.sum(np.asarray(ex.completion_ids) != 256))
      rows += int(np.asarray(ex.completion_ids).shape[0])
    out = update_actor(train_ds, eval_ds, skip_jit)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    marks.append(time.perf_counter())
    records.append(dict(loss_tokens=loss, tokens=tokens, trajectories=rows))
    k = len(marks) - 1
    print(f"  tunix iter {k}: {marks[k] - (marks[k - 1] if k else t0):.2f}s loss_tokens={loss}"
          + (" (warm-up)" if k < args.warmup else ""), flush=True)
    return out

  cluster.update_actor = timed_update_actor
  turns = []
  process = learner._process_results

  def process_and_count(trajectories, *a, **k):
    if os.environ.get("BENCH_DEBUG"):
      t = trajectories[0].traj
      print("BENCH_DEBUG", t["status"], [(m["role"], m["content"][:40]) for m in t["conversation_text"]], file=sys.stderr)
    turns.extend(sum(1 for m in t.traj["conversation_text"] if m["role"] == "assistant") for t in trajectories)
    return process(trajectories, *a, **k)

  learner._process_results = process_and_count
  batches = [{"prompts": [tasks[b * args.tasks + i].id for i in range(args.tasks)],
              "task_index": [b * args.tasks + i for i in range(args.tasks)]} for b in range(n_batches)]
  t0 = time.perf_counter()
  learner.train(batches)
  if len(marks) < n_batches:
    raise RuntimeError(f"tunix ran {len(marks)} optimizer steps, expected {n_batches}")
  gaps = np.diff(marks)[args.warmup - 1:]
  steady = records[args.warmup:]
  s = float(np.mean(gaps))
  return dict(iteration_s=s, iteration_s_all=[round(float(g), 3) for g in gaps],
              trajectories_per_s=float(np.mean([r["trajectories"] for r in steady])) / s,
              trained_tokens_per_s=float(np.mean([r["loss_tokens"] for r in steady])) / s,
              processed_tokens_per_s=float(np.mean([r["tokens"] for r in steady])) / s,
              turns_per_trajectory=float(np.mean(turns)) if turns else 0.0,
              loss_tokens_per_iteration=float(np.mean([r["loss_tokens"] for r in steady])),
              tunix_version=__import__("importlib.metadata").metadata.version("google-tunix"),
              jax_version=jax.__version__)


if __name__ == "__main__":
  main()
