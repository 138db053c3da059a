#!/usr/bin/env bash
# Everything a GPU machine without network needs to exercise the CUDA backend, from files in the tree:
# installs pycuda from bench/cuda_wheels (its sdist, built here against this machine's CUDA, and the
# wheels it needs), runs the gpu-marked tests, a short search on configs/matmul_cuda.yaml and
# configs/softmax_cuda.yaml, and the cuBLAS comparison; prints the figures.
#
#   bash bench/gpu_check.sh            # uses .venv if present (carry it), else python3
#
# Needs: an NVIDIA driver, the CUDA toolkit (nvcc, headers; default /usr/local/cuda), a C++ compiler,
# Python headers, and evoforge's own dependencies already installed (e.g. a carried .venv, or wheels).
# bench/cuda_wheels holds two binary wheels (markupsafe, siphash24) for CPython 3.11 on x86_64 Linux
# (manylinux); another Python or CPU needs those two from elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export CUDA_ROOT=${CUDA_ROOT:-${CUDA_HOME:-/usr/local/cuda}}
export PATH="$CUDA_ROOT/bin:$PATH"
OUT=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$OUT"
echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
nvcc --version | tail -1; $PY --version

echo "== pycuda (offline, built against $CUDA_ROOT)"
# WHEELS: another folder of wheels (e.g. pytools' and siphash24's for another Python). Everything goes into
# the Python's own site-packages: sandboxed workers do not inherit PYTHONPATH.
if ! $PY -c "import pycuda.driver" 2>/dev/null; then
  if ! $PY -c "import pytools, mako, platformdirs, siphash24" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links bench/cuda_wheels ${WHEELS:+--find-links "$WHEELS"} \
      pytools mako platformdirs siphash24 typing_extensions
  fi
  src=$(mktemp -d)/pycuda; mkdir -p "$src"
  tar xzf bench/cuda_wheels/pycuda-*.tar.gz -C "$src" --strip-components=1
  # curand only where the toolkit has its header; link against the driver's libcuda where no stub is.
  curand=False; [ -f "$CUDA_ROOT/include/curand.h" ] && curand=True
  libdirs="'$CUDA_ROOT/lib64', '$CUDA_ROOT/lib64/stubs'"
  if [ ! -e "$CUDA_ROOT/lib64/stubs/libcuda.so" ] && [ ! -e "$CUDA_ROOT/lib64/libcuda.so" ]; then
    drv=$(ldconfig -p | awk '/libcuda\.so\.1 / {print $NF; exit}')
    if [ -n "$drv" ]; then mkdir -p "$src/drvlink" && ln -sf "$drv" "$src/drvlink/libcuda.so" && libdirs="$libdirs, '$src/drvlink'"; fi
  fi
  printf "CUDA_ROOT = '%s'\nCUDA_ENABLE_CURAND = %s\nCUDADRV_LIB_DIR = [%s]\n" "$CUDA_ROOT" "$curand" "$libdirs" > "$src/siteconf.py"
  # --no-build-isolation: the build uses this environment's setuptools and numpy (no index to fetch them).
  PYTHONPATH="$ROOT/bench/cuda_build${PYTHONPATH:+:$PYTHONPATH}" \
    $PY -m pip install -q --no-index --no-deps --no-build-isolation "$src" 2>&1 | tail -3
fi
$PY -c "import pycuda.driver as d; d.init(); print('pycuda', __import__('pycuda').VERSION_TEXT, 'sees', d.Device.count(), 'GPU(s):', d.Device(0).name())"

echo "== gpu tests"
$PY -m pytest -q -m gpu tests/runtime/cuda -rfs --tb=short -p no:cacheprovider 2>&1 | tail -60 \
  || echo "gpu tests: some failed (above)"

echo "== compile-only check (ptxas figures) for the GPU's arch"
$PY -m evo check configs/matmul_cuda.yaml --points 2 --json > "$OUT/check_matmul.json" && echo "check: ok" \
  || echo "check: some points failed (see $OUT/check_matmul.json)"

echo "== short searches"
for cfg in matmul_cuda softmax_cuda; do
  $PY -m evo run "configs/$cfg.yaml" --run-dir "$OUT/$cfg" --max-evals "${EVALS:-40}" --max-time "${SECONDS_PER_RUN:-240}" \
    > "$OUT/$cfg.log" 2>&1 || { echo "$cfg: evo run failed, see $OUT/$cfg.log"; tail -5 "$OUT/$cfg.log"; continue; }
  $PY -m evo archive stats "$OUT/$cfg" | sed -n 1,4p
  $PY -m evo archive best "$OUT/$cfg" --top 3 --json | $PY -c "
import json, sys
for c in json.load(sys.stdin):
    m = c['metrics']
    print(f\"  {c['id'][:12]} {c['fitness']:.2f} {c['unit']}  vs {m.get('reference_impl')}: {m.get('vs_reference', 0):.3f}x  regs={m.get('registers')} occ={m.get('occupancy', 0):.2f}  {c['params']}\")"
done

echo "== best evolved GEMM vs cuBLAS (1024, 4096, 8192)"
$PY bench/cuda_matmul_vs_cublas.py --run-dir "$OUT/matmul_cuda" ${BENCH_SIZES:+--sizes $BENCH_SIZES} || true
