"""Train checkpoints with Orbax: one composite per step holds everything that decides the next step.

Items of a step: `state` (params, optimizer state, step, policy version, RNG key data), `meta` (iteration,
grain iterator state, versions, env version, and the state's integrity digests), `model_config` (HF-style
dict) and `config` (the run's config). Saves are asynchronous and keep the newest N.

Integrity: Orbax's storage has no checksum over array data. Its default zarr2 + zstd chunks carry none (zstd
frames are written without a content checksum, so flipped bytes often decode to wrong values without an
error), and with zarr3 Orbax puts `crc32c` on the shard index only; the chunk codecs are hard-coded, so the
codec that would catch it cannot be turned on through Orbax's API. So every save records a 64-bit digest of
each state leaf in `meta["_integrity"]` (`state_digests`: on device, over the global arrays), and a restore
recomputes it on the restored arrays and compares. Restoring takes the newest *intact* step: a step that is
unreadable or whose digests do not match is skipped with a warning naming it (and the leaves), the previous
one is tried, and the steps skipped are reported in the returned meta (`"_skipped_steps"`); when no step is
intact, `CheckpointIntegrityError` names every step tried and why. An incompatible model is refused with a
clear error. Steps written before digests existed restore with a warning that they cannot be verified. The
JSON items (meta, model_config, config) are not digested: damage that breaks their JSON makes the step
unreadable (skipped), damage that leaves valid JSON goes unseen.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

import models
from jaxagent import weights
from jaxagent.train.state import TrainState

log = logging.getLogger(__name__)

INTEGRITY_KEY = "_integrity"  # meta entry written by `save`: {"algorithm": DIGEST_ALGORITHM, "leaves": {...}}
SKIPPED_KEY = "_skipped_steps"  # meta entry returned by `restore_latest`: the newer steps it skipped
VERIFIED_KEY = "_verified"  # meta entry returned by `restore_latest`: False for a step without digests
DIGEST_ALGORITHM = "u32words-fmix32-sum-2x32-v1"
DAMAGED_DIR = "damaged"  # skipped steps are moved to `checkpoints/damaged/<step>` before the run saves again


class IncompatibleCheckpointError(ValueError):
  """The checkpoint was written for a different model or algorithm than the one being resumed."""


class CheckpointIntegrityError(models.CheckpointError):
  """Checkpoint steps exist but none is intact (each unreadable or failing its digests); names them all."""


def versions() -> dict[str, str]:
  import optax
  return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
          "orbax": ocp.__version__ if hasattr(ocp, "__version__") else "?"}


def _key_data(rng: Any) -> Any:
  """The RNG key's raw data; for an abstract key (`jax.ShapeDtypeStruct`), its abstract data, same sharding."""
  if isinstance(rng, jax.ShapeDtypeStruct):
    data = jax.eval_shape(jax.random.key_data, rng)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=rng.sharding)
  return jax.random.key_data(rng)


def _to_saveable(state: TrainState, frozen: tuple[str, ...] = ()) -> dict[str, Any]:
  """The stored form of a (concrete or abstract) train state; `frozen` parameter groups are left out."""
  params = {k: v for k, v in state.params.items() if k not in frozen}
  out = {"params": params, "opt_state": state.opt_state, "step": state.step,
         "policy_version": state.policy_version, "rng": _key_data(state.rng)}
  if state.ref_params is not None:
    out["ref_params"] = state.ref_params
  return out


# ------------------------------------------------------------------------------------------------
# Integrity digests: computed on device, shard by shard, as digests of the global arrays.

_LANE_SEEDS = (0x243F6A88, 0x85A308D3)  # two independent 32-bit lanes -> a 64-bit digest per leaf


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finalizer: a bijection of uint32 with full avalanche."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The leaf's bits as uint32 words (same shape; 64-bit and complex leaves get a trailing axis)."""
  dtype = jnp.dtype(x.dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return jnp.stack([_words(jnp.real(x)), _words(jnp.imag(x))], axis=-1)
  if dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = (jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype)).bits
  if bits in (8, 16):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
  if bits in (32, 64):
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  # Sub-byte types (int4, float4_e2m1fn, ...): a lossless value conversion.
  wide = x.astype(jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32)
  return jax.lax.bitcast_convert_type(wide, jnp.uint32)


@jax.jit
def _partial_digest(x: jax.Array, offsets: jax.Array, strides: jax.Array) -> jax.Array:
  """uint32[2]: the digest terms of one block of a leaf's words, summed (see `state_digests`).

  `x` is the block (a shard), `offsets` its position in the global array of words and `strides` that array's
  row-major strides (both uint32[ndim of the words], wrapping mod 2^32), so each word gets its global index.
  """
  w = _words(x)
  idx = jnp.zeros(w.shape, jnp.uint32)
  for axis in range(w.ndim):
    idx = idx + (jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) + offsets[axis]) * strides[axis]
  out = []
  for seed in _LANE_SEEDS:
    key = _fmix32(idx * jnp.uint32(0x9E3779B9) + jnp.uint32(seed))
    out.append(jnp.sum(_fmix32(w ^ key), dtype=jnp.uint32))
  return jnp.stack(out)


def _leaf_name(path: tuple[Any, ...]) -> str:
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


@functools.lru_cache(maxsize=None)
def _word_layout(shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.ndarray]:
  """The shape of a leaf's uint32 words (see `_words`) and its row-major strides mod 2^32."""
  words = jax.eval_shape(_words, jax.ShapeDtypeStruct(shape, dtype)).shape
  strides = [1] * len(words)
  for axis in range(len(words) - 2, -1, -1):
    strides[axis] = strides[axis + 1] * words[axis + 1]
  return words, np.asarray([s % 2**32 for s in strides], np.uint32)


def state_digests(tree: Any) -> dict[str, str]:
  """{leaf path ("params/policy/embed_vd/value"): 16 hex digits} of every array leaf of `tree`.

  The digest of a leaf, per 32-bit lane (two lanes, seeds `_LANE_SEEDS`): the sum mod 2^32, over the leaf's
  bits as uint32 words w_i at row-major index i of the global array, of fmix32(w_i ^ fmix32(i * phi + seed)).
  Each term is a bijection of its word given its position, so any changed word changes the sum, and so do
  moved words; several changed words cancel with probability ~2^-64. (A float sum would not do: flips that
  make NaN/inf, or changes that cancel, go unseen.) As the sum is associative and commutative it is taken per
  shard, on the shard's device with global indices, and added up: the digest is that of the global array
  whatever its sharding, device count or process count, and the same on every process.

  Cost: one on-device pass over each stored shard (replicas skipped; each byte read once, ~30 integer ops
  per word, fused; the arrays are not copied to the host): a small jitted program per shard, dispatched
  asynchronously, without collectives, compiled once per distinct shard shape/dtype; then one
  `jax.device_get` of all the 8-byte partial sums and, with several processes, one `process_allgather` of
  the per-leaf sums. It waits for the arrays to be computed. Measured on 2 CPU cores for the tiny test model
  (37 leaves, 0.57 MB): ~1 s of compiling at the first call, then a few ms.
  """
  names, partials, owners, spread = [], [], [], []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    leaf = leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)
    spread.append(not leaf.is_fully_addressable)  # spans processes: the others hold the rest of its blocks
    words, strides = _word_layout(leaf.shape, jnp.dtype(leaf.dtype))
    for shard in leaf.addressable_shards:
      if shard.replica_id == 0:  # each global block is digested once, by the process holding its replica 0
        offsets = np.zeros(len(words), np.uint32)
        offsets[:leaf.ndim] = [(sl.start or 0) % 2**32 for sl in shard.index]
        partials.append(_partial_digest(shard.data, offsets, strides))
        owners.append(len(names))
    names.append(_leaf_name(path))
  sums = np.zeros((len(names), 2), np.uint64)
  for owner, part in zip(owners, jax.device_get(partials)):  # one batched device->host transfer
    sums[owner] += np.asarray(part, np.uint64)
  sums %= 2**32
  if jax.process_count() > 1:  # every process calls this for the same tree: one collective, same order
    gathered = np.asarray(multihost_utils.process_allgather(sums.astype(np.uint32)), np.uint64)
    sums = np.where(np.asarray(spread)[:, None], gathered.sum(axis=0) % 2**32, sums)
  return {name: f"{int(a):08x}{int(b):08x}" for name, (a, b) in zip(names, sums)}


def _check_digests(expected: dict[str, str], restored: Any) -> list[str]:
  """The leaves whose digest differs from `expected` (missing/extra leaves included), described."""
  actual = state_digests(restored)
  bad = [f"{name} (digest {actual[name]}, saved {want})" for name, want in expected.items()
         if name in actual and actual[name] != want]
  bad += [f"{name} (saved, not restored)" for name in expected if name not in actual]
  bad += [f"{name} (restored, no saved digest)" for name in actual if name not in expected]
  return bad


def _all_agree(ok: bool) -> bool:
  """True when `ok` on every process (each step's verdict must be the same everywhere: restores are collective)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.asarray(multihost_utils.process_allgather(np.asarray([int(ok)], np.int32))).min())


def _error(e: Exception, limit: int = 300) -> str:
  """`Type: message`, cut short (TensorStore errors carry the whole spec)."""
  text = " ".join(f"{type(e).__name__}: {e}".split())
  return text if len(text) <= limit else text[:limit] + "..."


def _summary(items: list[str], limit: int = 5) -> str:
  return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


class TrainCheckpointer:
  """Async keep-N checkpoints of a run's `checkpoints/` directory, verified on restore.

  Attributes:
    skipped: {step: why} of the steps the last `restore_latest` skipped (damaged or unreadable), newest first.
      They are moved to `checkpoints/damaged/<step>` by the next `save` (never by a restore, so a read-only
      `jaxagent eval` changes nothing), so the run can write those step numbers again.
  """

  def __init__(self, directory: Path, *, keep: int, frozen: tuple[str, ...] = ()):
    """`frozen`: parameter groups never saved (LoRA's base policy: it comes from model.path or the seed);
    `restore_latest` returns a state without them."""
    self.directory = Path(directory).resolve()
    self.frozen = tuple(frozen)
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                             enable_async_checkpointing=True))
    self.skipped: dict[int, str] = {}
    self._set_aside_pending: list[int] = []

  def save(self, iteration: int, state: TrainState, meta: dict[str, Any], model_config: dict[str, Any],
           config: dict[str, Any]) -> None:
    """Starts an asynchronous save of step `iteration`; the state may be donated as soon as this returns.

    The state's digests are computed (on device, see `state_digests`) and fetched before Orbax is called, so
    they describe exactly the values saved; the extra cost is that pass plus a wait for the state to be ready.
    """
    self._set_aside_damaged()
    saveable = _to_saveable(state, self.frozen)
    digests = state_digests(saveable)
    meta = {**meta, "has_reference": state.ref_params is not None,  # read back first: the restore target
            INTEGRITY_KEY: {"algorithm": DIGEST_ALGORITHM, "leaves": digests}}
    self.manager.save(iteration, args=ocp.args.Composite(
        state=ocp.args.StandardSave(saveable), meta=ocp.args.JsonSave(meta),
        model_config=ocp.args.JsonSave(model_config), config=ocp.args.JsonSave(config)))

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()

  def _set_aside_damaged(self) -> None:
    """Moves the steps the last restore skipped to `damaged/` (process 0; all processes then reload)."""
    if not self._set_aside_pending:
      return
    steps, self._set_aside_pending = self._set_aside_pending, []
    self.manager.wait_until_finished()
    if jax.process_index() == 0:
      for step in steps:
        src = self.directory / str(step)
        if not src.exists():
          continue
        dst = self.directory / DAMAGED_DIR / str(step)
        if dst.exists():
          dst = dst.with_name(f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
        warnings.warn(f"moved damaged checkpoint {src} to {dst} (kept for inspection); step {step} is "
                      "written again when the run reaches it", RuntimeWarning, stacklevel=3)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxagent-checkpoint-set-aside-{'-'.join(map(str, steps))}")
    self.manager.reload()

  def restore_latest(self, abstract_state: TrainState, model_config: dict[str, Any],
                     require: dict[str, Any] | None = None) -> tuple[int, TrainState, dict[str, Any]] | None:
    """(iteration, state, meta) of the newest intact step, or None when there is no step at all.

    `abstract_state` gives the structure, dtypes and shardings to restore into: a `TrainState` of
    `jax.ShapeDtypeStruct`s (nothing allocated before the restore) or of arrays. `require`: meta entries that
    must equal these values (e.g. the LoRA settings, which shape the stored state); a mismatch is an
    `IncompatibleCheckpointError`, not a damaged step.

    Each step's restored state is checked against the digests saved in its meta. A step that is unreadable
    or damaged is skipped with a RuntimeWarning naming it (and the mismatching leaves) and the previous step
    is tried. The returned meta is the step's meta without its digests, plus:
      meta["_skipped_steps"]: list[int], the newer steps skipped (newest first; [] when the latest was used);
        their reasons are in `self.skipped`.
      meta["_verified"]: bool, False for a step written before digests existed (restored with a warning).
    Raises:
      CheckpointIntegrityError: steps exist but none is intact; the message names each step and why.
      IncompatibleCheckpointError: the newest readable step is for a different model.
    """
    self.skipped, self._set_aside_pending = {}, []
    steps = sorted(self.manager.all_steps(), reverse=True)

    def skip(step: int, why: str) -> None:
      self.skipped[step] = why
      warnings.warn(f"checkpoint {self.directory / str(step)} {why}; trying the previous one", RuntimeWarning,
                    stacklevel=3)

    for step in steps:
      try:
        stored = self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore(), model_config=ocp.args.JsonRestore()))
        error = None
      except Exception as e:  # orbax raises many types for a torn step
        error = _error(e)
      if not _all_agree(error is None):
        skip(step, f"is unreadable ({error or 'failed on another process'})")
        continue
      _check_compatible(stored["model_config"], model_config, self.directory / str(step))
      meta = dict(stored["meta"])
      for key, value in (require or {}).items():
        if meta.get(key) != value:
          raise IncompatibleCheckpointError(f"{self.directory / str(step)}: cannot resume: {key} is "
                                            f"{meta.get(key)!r} in the checkpoint, {value!r} in the config")
      integrity = meta.pop(INTEGRITY_KEY, None)
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(
            _restore_target(abstract_state, self.frozen, meta))))
        error = None
      except Exception as e:
        error = _error(e)
      if not _all_agree(error is None):
        skip(step, f"is damaged: its state is unreadable ({error or 'failed on another process'})")
        continue
      s = restored["state"]
      verified = integrity is not None and integrity.get("algorithm") == DIGEST_ALGORITHM
      if verified:
        bad = _check_digests(integrity["leaves"], s)
        if bad:  # the digests are of global arrays: every process takes the same decision
          skip(step, f"is damaged: {len(bad)} state leaf/leaves do not match the digests saved with it: "
                     f"{_summary(bad)}")
          continue
      else:
        what = ("was written without integrity digests (before they existed)" if integrity is None else
                f"has digests of an unknown algorithm {integrity.get('algorithm')!r}")
        warnings.warn(f"checkpoint {self.directory / str(step)} {what}: its state cannot be verified",
                      RuntimeWarning, stacklevel=2)
      state = TrainState(params=s["params"], opt_state=s["opt_state"], step=s["step"],
                         policy_version=s["policy_version"], rng=jax.random.wrap_key_data(s["rng"]),
                         ref_params=_reference(abstract_state, s, self.directory / str(step)))
      self._set_aside_pending = list(self.skipped)
      meta[SKIPPED_KEY] = list(self.skipped)
      meta[VERIFIED_KEY] = verified
      return step, state, meta
    if steps:
      detail = "; ".join(f"step {step}: {why}" for step, why in self.skipped.items())
      raise CheckpointIntegrityError(f"{self.directory}: no intact checkpoint to restore ({len(steps)} tried, "
                                     f"newest first). {detail}")
    return None


def _restore_target(abstract_state: TrainState, frozen, meta: dict[str, Any]) -> dict[str, Any]:
  """The structure to restore a step into: the state as it was saved. A run may resume with `algo.kl_coef`
  turned on (the checkpoint has no reference: its policy becomes one) or off (the stored reference is dropped)."""
  target = _to_saveable(abstract_state, frozen)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        target)
  target.pop("ref_params", None)
  if meta.get("has_reference", False):
    target["ref_params"] = target["params"]["policy"]
  return target


def _reference(abstract_state: TrainState, restored: dict[str, Any], where: Path):
  """The restored KL reference as the run now wants it: dropped when algo.kl_coef is 0 now, the checkpoint's
  policy when the checkpoint has none (each with a warning)."""
  ref = restored.get("ref_params")
  if abstract_state.ref_params is None and ref is not None:
    warnings.warn(f"checkpoint {where} has a KL reference policy; algo.kl_coef is 0 now, so it is dropped",
                  RuntimeWarning, stacklevel=3)
    return None
  if abstract_state.ref_params is not None and ref is None:
    warnings.warn(f"checkpoint {where} has no KL reference policy (saved with algo.kl_coef = 0); its policy "
                  "becomes the reference from here", RuntimeWarning, stacklevel=3)
    return jax.tree.map(jnp.copy, restored["params"]["policy"])  # its own buffers: the state is donated per step
  return ref


def _check_compatible(stored: dict[str, Any], current: dict[str, Any], where: Path) -> None:
  problem = weights.param_layout_problem(stored)
  if problem:
    raise IncompatibleCheckpointError(f"{where}: cannot resume: {problem}")
  keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
  diff = {k: (stored.get(k), current.get(k)) for k in keys if stored.get(k) != current.get(k)}
  if diff:
    detail = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
    raise IncompatibleCheckpointError(f"{where}: cannot resume into a different model ({detail})")
