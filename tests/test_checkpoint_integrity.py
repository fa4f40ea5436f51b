"""Train checkpoints carry digests of their state: a damaged step is reported by name and skipped, never restored."""

import json
import re
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
from jaxagent import weights
from jaxagent.train import checkpointing
from jaxagent.train.state import TrainState
from tests import _processes

ROOT = Path(__file__).resolve().parent.parent
saveable = checkpointing._to_saveable  # the tree that is saved and digested

CONFIG = models.ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16)
HF_CONFIG = weights.checkpoint_model_config(CONFIG)  # what a run stores with each checkpoint
OPTIMIZER = optax.adamw(1e-2)


def _state(devices: int = 1, seed: int = 0, raw_embedding: bool = False) -> TrainState:
  """A tiny policy's TrainState after a few AdamW updates on random gradients (moments are not zeros).

  With `devices > 1`, parameters and moments are sharded over that many devices (first divisible axis) while
  step, policy version and RNG stay on device 0 (mixed placements in one tree). `raw_embedding`: the embedding holds
  random bit patterns (finite, |x| < 2) that zstd cannot compress, so Orbax stores them verbatim.
  """
  model = models.Transformer(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(seed))
  params = {"policy": nnx.split(model)[1]}
  state = TrainState(params=params, opt_state=OPTIMIZER.init(params), step=jnp.zeros((), jnp.int32),
                     policy_version=jnp.zeros((), jnp.int32), rng=jax.random.key(seed))
  for i in range(2):
    keys = iter(jax.random.split(jax.random.key(100 * seed + i), len(jax.tree.leaves(params))))
    grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), state.params)
    updates, opt_state = OPTIMIZER.update(grads, state.opt_state, state.params)
    state = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                          step=state.step + 1, policy_version=state.policy_version + 1)
  if raw_embedding:
    bits = jax.random.bits(jax.random.key(seed), (CONFIG.vocab_size, CONFIG.hidden_size), jnp.uint32)
    embed = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xBFFFFFFF), jnp.float32)
    state.params["policy"]["embed_vd"].value = embed
  if devices > 1:
    mesh = Mesh(np.array(jax.devices()[:devices]), ("fsdp",))

    def place(x):
      axis = next((a for a, n in enumerate(x.shape) if n % devices == 0), None)
      spec = [None] * x.ndim
      if axis is not None:
        spec[axis] = "fsdp"
      return jax.device_put(x, NamedSharding(mesh, P(*spec)))
    state = state.replace(params=jax.tree.map(place, state.params), opt_state=jax.tree.map(place, state.opt_state))
  return state


def _host(state: TrainState):
  return jax.tree.map(np.asarray, saveable(state))


def _assert_equal(a: TrainState, b: TrainState):
  la, lb = jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))
  assert len(la) == len(lb) > 0
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)  # bitwise


def flip_middle_of_largest_file(step_dir: Path, nbytes: int = 4096) -> Path:
  """Inverts `nbytes` in the middle of the largest file under `step_dir/state`: with `_state`, the OCDBT file of
  array data (~470 KB; the b-tree files are < 70 KB)."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  big = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(big.read_bytes())
  assert len(data) > nbytes, big
  lo = len(data) // 2 - nbytes // 2
  data[lo:lo + nbytes] = bytes(b ^ 0xFF for b in data[lo:lo + nbytes])
  big.write_bytes(bytes(data))
  return big


def flip_array_data_files(step_dir: Path, nbytes: int = 4096) -> list[Path]:
  """Inverts up to `nbytes` (at most half the file) in the middle of EVERY OCDBT data file of `step_dir/state`.

  How the async writer spreads arrays over data files varies with load: flipping only large files (or only "the
  largest") can hit nothing but b-tree nodes the merged root no longer reads, and the step restores intact
  (seen once in CI under load). Data files live under each process's `ocdbt.process_*/d/` and also under the
  merged root's own `d/` (where a large leaf sometimes lands: missing that directory let a damaged step restore
  intact in CI)."""
  state = step_dir / "state"
  files = [p for p in [*state.glob("d/*"), *state.glob("ocdbt.process_*/d/*")]
           if p.is_file() and p.stat().st_size >= 2]
  assert files, step_dir
  for path in files:
    data = bytearray(path.read_bytes())
    n = min(nbytes, len(data) // 2)
    lo = len(data) // 2 - n // 2
    data[lo:lo + n] = bytes(b ^ 0xFF for b in data[lo:lo + n])
    path.write_bytes(bytes(data))
  return files


def flip_inside_leaf(step_dir: Path, value: np.ndarray, nbytes: int = 4096) -> Path:
  """Inverts `nbytes` of `value`'s data where they are stored verbatim in `step_dir/state` (zstd keeps random
  floats as raw blocks): a flip that Orbax restores without an error."""
  raw = np.ascontiguousarray(value).tobytes()
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  middle = len(raw) // 2 - nbytes // 2
  for start in sorted(range(0, len(raw) - nbytes + 1, 1024), key=lambda s: abs(s - middle)):  # within one shard
    for path in files:
      data = bytearray(path.read_bytes())
      at = data.find(raw[start:start + nbytes])
      if at >= 0:
        data[at:at + nbytes] = bytes(b ^ 0xFF for b in data[at:at + nbytes])
        path.write_bytes(bytes(data))
        return path
  raise AssertionError(f"the leaf's bytes are not stored verbatim under {step_dir}")


def _save_two_steps(directory: Path, devices: int = 1, raw_embedding: bool = False):
  ck = checkpointing.TrainCheckpointer(directory, keep=3)
  states = {step: _state(devices, seed=step, raw_embedding=raw_embedding) for step in (1, 2)}
  for step, state in states.items():
    ck.save(step, state, {"iteration": step}, HF_CONFIG, {})
  ck.wait()
  return ck, states


def _restore_recording(ck, abstract):
  """restore_latest's (step, state, meta) and the messages of the RuntimeWarnings it gave about checkpoints."""
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    step, state, meta = ck.restore_latest(abstract, HF_CONFIG)
  return step, state, meta, _our_warnings(rec)


def _our_warnings(record) -> list[str]:
  return [str(w.message) for w in record if "checkpoint" in str(w.message) and issubclass(w.category, RuntimeWarning)]


def test_digest_sees_every_bit_and_position_but_not_the_layout():
  x = jax.random.normal(jax.random.key(0), (8, 16))
  base = checkpointing.state_digests({"x": x})["x"]
  bits = np.asarray(x).view(np.uint32)
  for bit in range(32):  # every single-bit flip of one element
    flipped = bits.copy()
    flipped[3, 5] ^= np.uint32(1 << bit)
    assert checkpointing.state_digests({"x": jnp.asarray(flipped.view(np.float32))})["x"] != base, bit
  swapped = np.asarray(x).copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  assert checkpointing.state_digests({"x": jnp.asarray(swapped)})["x"] != base  # same values, moved
  # The same global array sharded over 4 devices, or over 2x2: the same digest (a multi-host property too).
  for shape, spec in (((4,), P("a", None)), ((2, 2), P("a", "b"))):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), ("a", "b")[:len(shape)])
    assert checkpointing.state_digests({"x": jax.device_put(x, NamedSharding(mesh, spec))})["x"] == base
  # Other dtypes: a flip in bfloat16, int8 and uint32 (key data) leaves is seen.
  for dtype in (jnp.bfloat16, jnp.int8, jnp.uint32):
    y = jnp.arange(12, dtype=dtype)
    assert (checkpointing.state_digests({"y": y}) != checkpointing.state_digests({"y": y.at[7].add(1)}))


def _reference_digest(a: np.ndarray) -> str:
  """`state_digests` of one leaf in plain numpy (pins the algorithm: old checkpoints must keep verifying)."""
  w = (a.view(np.uint16).astype(np.uint32) if a.dtype.itemsize == 2 else a.view(np.uint32)).ravel()

  def fmix(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))
  i = np.arange(w.size, dtype=np.uint32)
  lanes = [int(fmix(w ^ fmix(i * np.uint32(0x9E3779B9) + np.uint32(seed))).sum(dtype=np.uint64) % 2**32)
           for seed in (0x243F6A88, 0x85A308D3)]
  return "".join(f"{lane:08x}" for lane in lanes)


def test_digest_is_the_documented_algorithm_on_any_layout():
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jax.random.normal(jax.random.key(1), (12, 20), dtype)
    want = _reference_digest(np.asarray(x))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    for sharding in (None, NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P(None, "a")),
                     NamedSharding(mesh, P())):  # unsharded, 2x2 blocks, columns, replicated
      y = x if sharding is None else jax.device_put(x, sharding)
      assert checkpointing.state_digests({"x": y}) == {"x": want}, (dtype, sharding)


@pytest.mark.parametrize("devices", [1, 4])
def test_damaged_latest_step_is_named_and_the_previous_one_restored(tmp_path, devices):
  """The reproduction: 4 KiB inverted in the middle of the largest data file of the latest step.

  What that hits varies with Orbax's parallel writes: zstd-compressed array data that decodes to wrong values
  without an error (the digests catch it; the old code restored it), or data that fails to decode (Orbax
  raises). Either way step 2 is named damaged and step 1 restored.
  """
  ck, states = _save_two_steps(tmp_path / "checkpoints", devices)
  try:
    flip_middle_of_largest_file(ck.directory / "2")
    damaged = re.escape(str(ck.directory / "2"))
    step, state, meta, messages = _restore_recording(ck, states[2])
    assert step == 1, "the damaged step 2 was restored"
    assert any(re.match(rf"checkpoint {damaged} is damaged: ", m) for m in messages), messages
    assert meta["iteration"] == 1
    assert meta[checkpointing.SKIPPED_KEY] == [2] and meta[checkpointing.VERIFIED_KEY] is True
    assert list(ck.skipped) == [2] and checkpointing.INTEGRITY_KEY not in meta
    _assert_equal(state, states[1])
    if devices > 1:
      assert state.params["policy"]["embed_vd"].value.sharding == states[1].params["policy"]["embed_vd"].value.sharding
  finally:
    ck.close()


@pytest.mark.parametrize("devices", [1, 4])
def test_flip_inside_array_data_is_caught_by_the_digests(tmp_path, devices):
  """4 KiB inverted inside an array's stored bytes: Orbax restores that without an error; the digests do not."""
  ck, states = _save_two_steps(tmp_path / "checkpoints", devices, raw_embedding=True)
  try:
    flip_inside_leaf(ck.directory / "2", np.asarray(states[2].params["policy"]["embed_vd"].value))
    damaged = re.escape(str(ck.directory / "2"))
    step, state, meta, messages = _restore_recording(ck, states[2])
    assert step == 1, "the damaged step 2 was restored"
    pattern = (rf"checkpoint {damaged} is damaged: 1 state leaf/leaves do not match the digests saved with it: "
               r"params/policy/embed_vd/value \(digest ")
    assert any(re.match(pattern, m) for m in messages), messages
    assert meta[checkpointing.SKIPPED_KEY] == [2]
    _assert_equal(state, states[1])

    # The run goes on from step 1 and writes step 2 again: the damaged one is set aside, not overwritten.
    redo = _state(devices, seed=3)
    with pytest.warns(RuntimeWarning, match=r"moved damaged checkpoint"):
      ck.save(2, redo, {"iteration": 2}, HF_CONFIG, {})
    ck.wait()
    assert (ck.directory / checkpointing.DAMAGED_DIR / "2" / "state").is_dir()
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      step, state, meta = ck.restore_latest(states[2], HF_CONFIG)
    assert step == 2 and meta[checkpointing.SKIPPED_KEY] == [] and not _our_warnings(rec)
    _assert_equal(state, redo)
  finally:
    ck.close()


def test_intact_restore_is_exact_and_silent(tmp_path):
  ck, states = _save_two_steps(tmp_path / "checkpoints")
  try:
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      step, state, meta = ck.restore_latest(states[1], HF_CONFIG)
    assert not _our_warnings(rec)
    assert step == 2 and meta == {"iteration": 2, "has_reference": False, checkpointing.SKIPPED_KEY: [],
                                  checkpointing.VERIFIED_KEY: True}
    _assert_equal(state, states[2])
  finally:
    ck.close()


def test_every_step_damaged_is_an_error_naming_each(tmp_path):
  ck, states = _save_two_steps(tmp_path / "checkpoints")
  try:
    for step in (1, 2):
      flip_middle_of_largest_file(ck.directory / str(step))
    with pytest.warns(RuntimeWarning), pytest.raises(checkpointing.CheckpointIntegrityError) as err:
      ck.restore_latest(states[2], HF_CONFIG)
    message = str(err.value)
    assert re.search(r"no intact checkpoint.*step 2: is damaged.*; step 1: is damaged", message), message
    assert isinstance(err.value, models.CheckpointError)  # the CLI prints it as one line
    # Nothing was moved by a restore (a read-only `jaxagent eval` must not change the run).
    assert sorted(p.name for p in ck.directory.iterdir()) == ["1", "2"]
  finally:
    ck.close()


def test_checkpoint_without_digests_restores_with_a_warning(tmp_path):
  ck = checkpointing.TrainCheckpointer(tmp_path / "checkpoints", keep=3)
  state = _state(seed=1)
  try:
    # As `save` wrote steps before digests existed.
    ck.manager.save(1, args=ocp.args.Composite(
        state=ocp.args.StandardSave(saveable(state)),
        meta=ocp.args.JsonSave({"iteration": 1, "has_reference": False}),
        model_config=ocp.args.JsonSave(HF_CONFIG), config=ocp.args.JsonSave({})))
    ck.wait()
    with pytest.warns(RuntimeWarning, match=r"checkpoints/1 was written without integrity digests.*cannot be verified"):
      step, restored, meta = ck.restore_latest(state, HF_CONFIG)
    assert step == 1 and meta[checkpointing.VERIFIED_KEY] is False and meta[checkpointing.SKIPPED_KEY] == []
    _assert_equal(restored, state)
  finally:
    ck.close()


@pytest.mark.slow
def test_cli_resume_after_corruption_says_which_step_it_used(tmp_path, capsys):
  from jaxagent import cli
  from tests.test_train import TINY
  sets = [x for o in TINY + ["train.bc_steps=0", "train.eval_episodes=0", "train.plots=false"]
          for x in ("--set", o)]
  run = tmp_path / "job"
  assert cli.main(["train", "tiny_cpu", "--run-dir", str(run), *sets, "--set", "train.iterations=2"]) == 0
  capsys.readouterr()
  flip_array_data_files(run / "checkpoints" / "2")
  with pytest.warns(RuntimeWarning, match=r"checkpoints/2 is damaged") as rec:
    assert cli.main(["train", "--resume", str(run)]) == 0
  out = capsys.readouterr().out
  # The step used, and the one skipped (the trainer prints meta["_skipped_steps"]; the warning says why).
  assert re.search(r"resumed from \S*checkpoints/1 .*skipped.*\b2\b", out), out
  assert any("moved damaged checkpoint" in m for m in _our_warnings(rec))
  # Iteration 2 was trained again and saved as an intact step 2; the damaged one is kept aside.
  assert (run / "checkpoints" / checkpointing.DAMAGED_DIR / "2").is_dir()
  options = ocp.CheckpointManagerOptions(read_only=True)
  with ocp.CheckpointManager((run / "checkpoints").resolve(), options=options) as m:
    assert m.latest_step() == 2
    stored = m.restore(2, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), state=ocp.args.StandardRestore()))
  assert checkpointing.state_digests(stored["state"]) == stored["meta"][checkpointing.INTEGRITY_KEY]["leaves"]


def _two_process_worker(port: int, process_id: int, out: Path) -> None:
  """One of 2 processes x 2 CPU devices: params sharded over all 4; save, damage, restore, save again."""
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  from jax.experimental import multihost_utils
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))

  def global_state(seed):  # every process builds the same values, then they are laid out over both processes
    local = _state(seed=seed, raw_embedding=True)
    spec = lambda x: P(*["fsdp" if i == 0 and x.shape[0] % 4 == 0 else None for i in range(x.ndim)])
    put = lambda x: jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec(x)), lambda i: np.asarray(x)[i])
    return local, local.replace(params=jax.tree.map(put, local.params), opt_state=jax.tree.map(put, local.opt_state),
                                step=put(local.step), policy_version=put(local.policy_version),
                                rng=jax.random.wrap_key_data(put(jax.random.key_data(local.rng))))

  host = {}
  ck = checkpointing.TrainCheckpointer(out / "checkpoints", keep=3)
  for step in (1, 2):
    host[step], state = global_state(step)
    ck.save(step, state, {"iteration": step}, HF_CONFIG, {})
  ck.wait()
  if process_id == 0:
    flip_inside_leaf(ck.directory / "2", np.asarray(host[2].params["policy"]["embed_vd"].value))
  multihost_utils.sync_global_devices("flipped")
  step, restored, meta, messages = _restore_recording(ck, state)
  result = {"step": step, "skipped": meta[checkpointing.SKIPPED_KEY], "messages": messages,
            "digests": checkpointing.state_digests(saveable(restored)),
            "expected": checkpointing.state_digests(saveable(host[1]))}
  host[3], redo = global_state(3)
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    ck.save(2, redo, {"iteration": 2}, HF_CONFIG, {})
    ck.wait()
  result["moved"] = _our_warnings(rec)
  step, _, meta, messages = _restore_recording(ck, state)
  result["after"] = {"step": step, "skipped": meta[checkpointing.SKIPPED_KEY], "messages": messages}
  ck.close()
  (out / f"p{process_id}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_two_processes_agree_on_the_damaged_step(tmp_path):
  """Digests of arrays sharded across 2 processes are the same on both; both skip the same step and go on."""
  import portpicker
  port = portpicker.pick_unused_port()
  _processes.run_all([[sys.executable, "-m", "tests.test_checkpoint_integrity", str(port), str(i), str(tmp_path)]
                      for i in range(2)], timeout=300, cwd=ROOT, env=_processes.cpu_env(2))
  results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
  for r in results:
    assert r["step"] == 1 and r["skipped"] == [2], r
    assert any(re.search(r"checkpoints/2 is damaged: .*params/policy/embed_vd/value", m) for m in r["messages"])
    assert r["digests"] == r["expected"] == results[0]["digests"]
    assert r["after"] == {"step": 2, "skipped": [], "messages": []}
  assert [bool(r["moved"]) for r in results] == [True, False]  # process 0 moved it; both reloaded
  assert (tmp_path / "checkpoints" / checkpointing.DAMAGED_DIR / "2").is_dir()


if __name__ == "__main__":  # a worker of test_two_processes_agree_on_the_damaged_step
  _two_process_worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
