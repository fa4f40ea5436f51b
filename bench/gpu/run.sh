#!/usr/bin/env bash
# The accelerator run (issue 45): the GPU path end to end on the library's device machine (one H200, Python
# 3.12, JAX 0.11 with CUDA 13, no registry), every table in one prepared script; each stage has its own time
# limit and log under $OUT, and a failed stage does not stop the next.
#
#   bench/gpu/prepare.sh                              # here: wheels + Qwen3's tokenizer into .gpu/ (~35 MB)
#   device run, carry [".gpu"]: bench/gpu/run.sh smoke   # ~1 min: versions, devices, one jit, imports
#   device run, carry [".gpu"]: bench/gpu/run.sh all     # ~8 min: the stages below, summary.txt
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

# Packages: the carried wheels into /tmp/site, first on the path (ours beside the machine's JAX 0.11).
if [[ -d "$kit/whl" ]]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$kit"/whl/*.whl > /tmp/jaxagent-pip.log 2>&1 || { echo "wheels failed to install:"; tail -5 /tmp/jaxagent-pip.log; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false JAXAGENT_CACHE=/tmp/jaxagent-cache

stage() {  # NAME SECONDS CMD...: runs CMD with a limit, its output in $OUT/NAME.log, and one status line
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%-9s rc=%-3s %4ss (limit %ss)\n' "$name" "$rc" "$((SECONDS - start))" "$limit" | tee -a "$out/summary.txt"
}

smoke() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" - <<'EOF'
import importlib.metadata as md, sys, time, tomllib
from packaging.requirements import Requirement
import jax, jax.numpy as jnp
print("python", sys.version.split()[0], "| jax", jax.__version__, "| devices", jax.devices(),
      "| kind", jax.devices()[0].device_kind)
x = jnp.ones((8192, 8192), jnp.bfloat16)
f = jax.jit(lambda a: a @ a)
f(x).block_until_ready()
t = time.perf_counter(); [f(x) for _ in range(10)][-1].block_until_ready(); t = (time.perf_counter() - t) / 10
print(f"bf16 8192^3 matmul: {2 * 8192**3 / t / 1e12:.0f} TFLOP/s")
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
    --batches 1 8 32 128 256 --new 128 --rounds 2 --train-batch "$2" --train-length "$3" --train-steps 3 --no-lora
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
  for platform in cuda cpu; do
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

: > "$out/summary.txt"
case "$what" in
  smoke) stage smoke 150 smoke; cat "$out/smoke.log" ;;
  all)
    stage smoke 90 smoke
    stage tests 150 run_tests
    stage bench135 100 bench smollm2-135m 16 1024
    stage bench0p6 120 bench qwen3-0.6b 8 2048
    stage qwen3 150 qwen3
    stage tiny 100 tiny
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
    cat "$out/summary.txt" ;;
  *) echo "usage: bench/gpu/run.sh smoke|all|check" >&2; exit 2 ;;
esac
