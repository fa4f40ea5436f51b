"""`jaxagent convert` both ways and the `make run` job (`jaxagent demo`), end to end."""

import jax.numpy as jnp
import numpy as np
import transformers

import models
from jaxagent import cli, weights
from tests import hf_reference as ref


def test_convert_hf_to_orbax_and_back(tmp_path, capsys):
  torch_model = ref.make_hf_model("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  hf = ref.save_hf_model(torch_model, tmp_path / "hf")
  assert cli.main(["convert", str(hf), str(tmp_path / "ckpt")]) == 0
  assert weights.latest_step(tmp_path / "ckpt") == 0
  assert cli.main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf2")]) == 0
  assert "-> " in capsys.readouterr().out

  restored = weights.load_model(tmp_path / "ckpt")
  tokens, mask, positions = ref.padded_batch()
  expected = ref.reference_logits(torch_model, tokens, mask, positions)
  got = np.asarray(restored(jnp.asarray(tokens, jnp.int32), positions_bt=jnp.asarray(positions, jnp.int32),
                            segment_ids_bt=jnp.asarray(mask, jnp.int32)))
  valid = mask.astype(bool)
  assert np.abs(got - expected)[valid].max() <= 1e-4
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
  assert np.abs(ref.reference_logits(exported, tokens, mask, positions) - expected)[valid].max() <= 1e-4


def test_convert_bad_source_is_a_clean_error(tmp_path, capsys):
  (tmp_path / "empty").mkdir()
  assert cli.main(["convert", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
  assert "neither an HF checkpoint" in capsys.readouterr().err


def test_demo_job_runs_and_checks_itself(tmp_path, capsys):
  code = cli.main(["demo", "tiny_cpu", "--set", f"run.root={tmp_path}", "--set", "generate.max_new_tokens=6",
                   "--set", "model.init.num_hidden_layers=1"])
  out = capsys.readouterr().out
  assert code == 0, out
  assert "RUN_DIR" in out and "agrees with no-cache argmax on 6/6 tokens" in out
  assert "max |logit diff| = 0" in out
  run_dirs = list(tmp_path.iterdir())
  assert len(run_dirs) == 1 and (run_dirs[0] / "hf" / "config.json").is_file()
  assert weights.latest_step(run_dirs[0] / "checkpoints") == 0


def test_generate_from_hf_dir_and_checkpoint(tmp_path, capsys):
  model = models.Transformer(models.ModelConfig(vocab_size=264, num_hidden_layers=1), rngs=__import__(
      "flax").nnx.Rngs(0))
  hf = models.save_pretrained(model, tmp_path / "hf")
  assert cli.main(["generate", "--model", str(hf), "--prompt", "2+2=", "--max-new-tokens", "5"]) == 0
  captured = capsys.readouterr()
  assert "[5 tokens, finish=budget" in captured.err
  greedy_hf = captured.out
  weights.save_model(model, tmp_path / "ckpt")
  assert cli.main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "2+2=", "--max-new-tokens", "5"]) == 0
  assert capsys.readouterr().out == greedy_hf  # same weights, greedy: same text
  assert cli.main(["generate", "--model", str(hf), "--prompt", "2+2=", "--temperature", "-1"]) == 2
  assert "temperature must be >= 0" in capsys.readouterr().err
