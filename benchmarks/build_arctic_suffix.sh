#!/usr/bin/env bash
# vLLM's built-in suffix decoding (`method: suffix`, the `vllm-suffix` benchmark system)
# needs arctic-inference's suffix tree. Its PyPI package targets CUDA builds of vLLM and
# registers a vLLM plugin that patches every engine; this builds ONLY its suffix-tree
# extension (C++ + nanobind, no torch, no CUDA) into .arctic/pkg, with no dist-info (so
# no plugin entry point). benchmarks/common.py puts .arctic/pkg on PYTHONPATH for the
# vllm-suffix system alone. About 30 s on one core.
#   make vllm-suffix      (or: bash benchmarks/build_arctic_suffix.sh)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/.arctic}
PY=${PY:-$ROOT/.venv/bin/python}
VER=${ARCTIC_VERSION:-0.3.0}
export MAX_JOBS=1 CMAKE_BUILD_PARALLEL_LEVEL=1
mkdir -p "$OUT/src"
SRC="$OUT/src/arctic_inference-$VER"
if [ ! -d "$SRC" ]; then
  # pip prepares the sdist's metadata by running setup.py, which imports torch: download
  # (installs nothing) with the project's interpreter, without build isolation
  "$PY" -m pip download --no-deps --no-binary arctic-inference --no-build-isolation \
    -d "$OUT/src" "arctic-inference==$VER"
  tar -xzf "$OUT/src/arctic_inference-$VER.tar.gz" -C "$OUT/src"
fi
# nanobind in a throwaway environment, not the project's
BASE=$("$PY" -c 'import sys; print(sys.base_prefix)')/bin/python3
[ -x "$OUT/venv/bin/python" ] || "$BASE" -m venv "$OUT/venv"
"$OUT/venv/bin/pip" install -q nanobind==2.9.2 cmake ninja
rm -rf "$OUT/build" "$OUT/pkg"
D="$OUT/pkg/arctic_inference/suffix_decoding"
PATH="$OUT/venv/bin:$PATH" cmake -S "$SRC/csrc/suffix_decoding" -B "$OUT/build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$OUT/venv/bin/python" \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$D"
PATH="$OUT/venv/bin:$PATH" cmake --build "$OUT/build" -j1
install -m644 "$SRC/arctic_inference/__init__.py" "$OUT/pkg/arctic_inference/"
install -m644 "$SRC/arctic_inference/suffix_decoding/"{__init__,cache,simulator}.py "$D/"
echo "built: $(ls "$D"/_C*.so)"
