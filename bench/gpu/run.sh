#!/usr/bin/env bash
# The accelerator run (issue 45): the GPU path end to end on the library's device machine (one H200, Python
# 3.12, JAX 0.11 with CUDA 13, no registry), every table in one prepared script; each stage has its own time
# limit and log under $OUT, and a failed stage does not stop the next.
#
#   bench/gpu/prepare.sh                              # here: wheels + Qwen3's tokenizer into .gpu/ (~35 MB)
#   device run, carry [".gpu"]: bench/gpu/run.sh smoke   # ~1 min: versions, devices, one jit, imports
#   device run, carry [".gpu"]: bench/gpu/run.sh all     # <= 9 min: the stages below, summary.txt
#   STAGES="bench0p6 qwen3" bench/gpu/run.sh all           # a rerun of some stages only
#   bench/gpu/run.sh rehearse                         # here, before a device run: `all` at toy sizes on CPU
#   bench/gpu/run.sh check                            # any machine (CI: tests/test_bench_gpu.py): the wheel pins
#                                                     # and the train commands' configs validate, nothing runs
#
# Stages of `all` (their logs: $OUT/<stage>.log):
#   smoke      as above, and each pyproject.toml pin checked against what is installed
#   tests      the on-policy ratio test (every sampling variant), bf16 mixed precision, KV cache vs no cache,
#              no recompilation after the first iteration, the model vs transformers parity tests
#   bench135   bench/real_model.py, random SmolLM2-135M weights: decode B=1..256 bf16 and a bf16 train step,
#              ours beside transformers/torch on the same GPU
#   bench0p6   the same for random Qwen3-0.6B weights
#   qwen3      `jaxagent train qwen3_0p6b_gpu`: random Qwen3-0.6B weights, its real tokenizer, 2 GRPO iterations,
#              env workers as plain subprocesses (no bubblewrap there); metrics.jsonl copied to $OUT
#   tiny       `jaxagent train tiny_cpu` for a few iterations on the GPU and on the machine's CPU
set -uo pipefail
cd "$(dirname "$0")/../.."
what="${1:-all}"
out="${OUT:-/tmp/jaxagent-gpu-out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
kit="${GPU_KIT:-.gpu}"   # prepare.sh's folder: whl/ and qwen3-tokenizer/

# The train commands, one definition for the run and for `check`.
qwen3_args=(train qwen3_0p6b_gpu --set model.path=null --set model.architecture=qwen3-0.6b
            --set "model.tokenizer=$kit/qwen3-tokenizer" --set env.pool.sandbox=none --set train.iterations=2
            --set train.eval_episodes=0 --set train.checkpoint_every=2 --set train.plots=false)
tiny_args=(train tiny_cpu --set train.iterations=6 --set train.eval_episodes=0 --set train.plots=false)
bench_sizes=(--batches 1 8 32 128 256 --new 128 --rounds 2 --train-steps 3)
platforms=(cuda cpu)
export MATMUL_N=8192   # smoke's bf16 matmul: N^3

if [[ "$what" == rehearse ]]; then
  export JAXAGENT_GPU_REHEARSE=1   # for the stages, each run as `run.sh _stage NAME ...`
fi
if [[ "${JAXAGENT_GPU_REHEARSE:-}" == 1 ]]; then
  # `all` at toy sizes on any machine (a 2-core CPU: ~5 min), so a script error costs no device time: the
  # stages, their logs and the summary as `all` writes them; only the sizes and the platforms differ.
  [[ "$what" == rehearse ]] && what=all
  bench_sizes=(--num-layers 1 --batches 1 2 --new 8 --rounds 1 --train-steps 1 --train-batch 1 --train-length 64)
  qwen3_args=(train qwen3_0p6b_gpu --set model.path=null --set "model.tokenizer=$kit/qwen3-tokenizer"
              --set env.pool.sandbox=none --set train.iterations=2 --set train.eval_episodes=0
              --set train.checkpoint_every=2 --set train.plots=false --set train.tasks_per_iteration=2
              --set train.group_size=2 --set train.micro_batches=2 --set train.logits_chunk=64
              --set rollout.max_new_tokens=16 --set rollout.max_context=448 --set rollout.max_observation_tokens=16
              --set env.max_turns=2 --set model.init.model_type=qwen3 --set model.init.qk_norm=true
              --set model.init.vocab_size=151936 --set model.init.eos_token_id=151645
              --set model.init.pad_token_id=151643 --set model.init.hidden_size=64
              --set model.init.intermediate_size=128 --set model.init.num_hidden_layers=2
              --set model.init.num_attention_heads=2 --set model.init.num_key_value_heads=1
              --set model.init.head_dim=32 --set distributed.mode=single)
  tiny_args+=(--set train.bc_steps=8)
  platforms=(cpu)
  MATMUL_N=1024
fi

if [[ "$what" == check ]]; then
  set -e
  "$python" - <<'EOF'
import re, tomllib
from packaging.requirements import Requirement
deps = {Requirement(r).name.lower().replace("_", "-"): Requirement(r)
        for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]}
pins = [l.strip() for l in open("bench/gpu/wheels.txt") if l.strip() and not l.startswith("#")]
names = [re.split("==", p)[0].lower().replace("_", "-") for p in pins]
assert all("==" in p for p in pins), [p for p in pins if "==" not in p]
assert len(set(names)) == len(names), f"bench/gpu/wheels.txt names a package twice: {names}"
for pin, name in zip(pins, names):
  if name in deps and not deps[name].specifier.contains(pin.split("==")[1]):
    raise SystemExit(f"bench/gpu/wheels.txt {pin} is outside pyproject.toml's {deps[name]}")
print(f"check: {len(pins)} wheel pins, each within pyproject.toml's ranges")
EOF
  for args in "qwen3_args" "tiny_args"; do
    declare -n a="$args"
    sets=("${a[@]:2}")
    "$python" -m jaxagent.cli config "${a[1]}" "${sets[@]}" > /dev/null
    echo "check: jaxagent ${a[*]:0:2} validates"
  done
  exit 0
fi

# Packages: the carried wheels into /tmp/site, first on the path (ours beside the machine's JAX 0.11); once, not
# again in each stage's own invocation. A rehearsal uses this machine's environment as it is.
if [[ "$what" != _stage && -z "${JAXAGENT_GPU_REHEARSE:-}" && -d "$kit/whl" ]]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$kit"/whl/*.whl > /tmp/jaxagent-pip.log 2>&1 || { echo "wheels failed to install:"; tail -5 /tmp/jaxagent-pip.log; }
  export PYTHONPATH="/tmp/site:$PWD"
elif [[ "$what" != _stage ]]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false JAXAGENT_CACHE=/tmp/jaxagent-cache

stage() {  # NAME SECONDS FUNCTION ARGS...: FUNCTION in its own invocation of this script (so `timeout` can
  # end it, children included), its output in $OUT/NAME.log, and one status line
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  if [[ -n "${STAGES:-}" && " $STAGES " != *" $name "* ]]; then return; fi
  timeout --kill-after=10 "$limit" bash "$0" _stage "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%-9s rc=%-3s %4ss (limit %ss)\n' "$name" "$rc" "$((SECONDS - start))" "$limit" | tee -a "$out/summary.txt"
}

smoke() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" - <<'EOF'
import importlib.metadata as md, os, sys, time, tomllib
from packaging.requirements import Requirement
import jax, jax.numpy as jnp
print("python", sys.version.split()[0], "| jax", jax.__version__, "| devices", jax.devices(),
      "| kind", jax.devices()[0].device_kind)
n = int(os.environ["MATMUL_N"])
x = jnp.ones((n, n), jnp.bfloat16)
f = jax.jit(lambda a: a @ a)
f(x).block_until_ready()
t = time.perf_counter(); [f(x) for _ in range(10)][-1].block_until_ready(); t = (time.perf_counter() - t) / 10
print(f"bf16 {n}^3 matmul: {2 * n**3 / t / 1e12:.1f} TFLOP/s")
for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
  req = Requirement(r)
  try:
    have = md.version(req.name)
  except md.PackageNotFoundError:
    print(f"  pin {req}: NOT INSTALLED"); continue
  print(f"  pin {str(req):34s} installed {have:12s} {'ok' if req.specifier.contains(have) else 'OUTSIDE THE RANGE'}")
import flax, optax, orbax.checkpoint, grain, transformers  # noqa: E401
import jaxagent.train.loop, models, envs  # noqa: E401,F401
print("imports ok: flax", flax.__version__, "optax", optax.__version__, "orbax", md.version("orbax-checkpoint"),
      "grain", md.version("grain"), "transformers", transformers.__version__)
EOF
}

run_tests() {
  "$python" -m pytest -p no:cacheprovider -n 0 -q -rA --durations=10 \
    "tests/test_train.py::test_rollouts_are_on_policy_for_the_learner" \
    "tests/test_train.py::test_mixed_precision_run_rolls_out_and_trains_in_bf16_on_float32_master_weights" \
    "tests/test_train.py::test_no_recompilation_after_the_first_iteration" \
    tests/test_kv_cache.py tests/models_vs_reference_test.py
}

bench() {  # ARCHITECTURE TRAIN_BATCH TRAIN_LENGTH
  # JAX takes 45 % of the GPU (not 75 %) so torch's side of the same run has room.
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 "$python" bench/real_model.py --architecture "$1" --dtypes bfloat16 \
    --train-batch "$2" --train-length "$3" --no-lora "${bench_sizes[@]}"
}

qwen3() {
  local run=/tmp/jaxagent-gpu-runs/qwen3
  rm -rf "$run"
  "$python" -m jaxagent.cli "${qwen3_args[@]}" --run-dir "$run"
  local rc=$?
  cp "$run/metrics.jsonl" "$out/qwen3_metrics.jsonl" 2>/dev/null
  return $rc
}

tiny() {
  for platform in "${platforms[@]}"; do
    local run=/tmp/jaxagent-gpu-runs/tiny-$platform
    rm -rf "$run"
    echo "== tiny_cpu on $platform"
    JAX_PLATFORMS=$platform "$python" -m jaxagent.cli "${tiny_args[@]}" --run-dir "$run" || return
    "$python" -c "import json, sys, statistics as s; rows = [json.loads(l) for l in open(sys.argv[1])]
it = [r['time/iteration_s'] for r in rows if 'time/iteration_s' in r][1:]
print(f'tiny_cpu on {sys.argv[2]}: {s.median(it):.2f} s per iteration (median of {len(it)} after the first)')" \
      "$run/metrics.jsonl" "$platform"
  done
}

if [[ "$what" == _stage ]]; then
  shift
  "$@"
  exit
fi

: > "$out/summary.txt"
case "$what" in
  smoke) stage smoke 150 smoke; cat "$out/smoke.log" ;;
  all)
    # Limits: 540 s in all, inside one device call's 600 s (timeout_s 580) with the wheels' install.
    stage smoke 40 smoke
    stage tests 120 run_tests
    stage bench135 80 bench smollm2-135m 16 1024
    stage bench0p6 100 bench qwen3-0.6b 8 2048
    stage qwen3 140 qwen3
    stage tiny 60 tiny
    # The tables, in the order of the README's GPU section.
    {
      grep -h -E "TFLOP/s|pin |imports ok" "$out/smoke.log"
      grep -h -E "passed|failed|error" "$out/tests.log" | tail -3
      grep -h -E "parameters|B=|decodes|full |peak device" "$out/bench135.log" "$out/bench0p6.log"
      "$python" - "$out/qwen3_metrics.jsonl" <<'EOF'
import json, sys
try:
  rows = [json.loads(l) for l in open(sys.argv[1])]
except OSError:
  sys.exit("qwen3: no metrics.jsonl")
for r in rows:
  keys = sorted(k for k in r if k.startswith(("time/", "memory/")) or k in ("ratio_min", "ratio_max", "loss_tokens"))
  print("qwen3 iteration", r.get("iteration"), {k: round(r[k], 4) for k in keys})
EOF
      grep -h "per iteration" "$out/tiny.log"
    } >> "$out/summary.txt" 2>&1
    echo "== $out/summary.txt"
    cat "$out/summary.txt" ;;
  *) echo "usage: bench/gpu/run.sh smoke|all|rehearse|check" >&2; exit 2 ;;
esac
