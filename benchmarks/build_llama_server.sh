#!/usr/bin/env bash
# Builds llama.cpp's own server, llama-server, once: from the llama.cpp sources that the llama-cpp-python sdist
# carries (from the package registry), with cmake. The peer of `tfq bench serve --peer llama-server`.
#
#   bash benchmarks/build_llama_server.sh          # minutes on two cores; prints the binary's path
#
# The binary lands in $TFQ_CACHE/llama-server/ (default ~/.cache/tfq/llama-server/), where tfq looks for it
# (or set TFQ_LLAMA_SERVER to another build). The build names the CPU's instruction sets (ggml_flags.sh) instead
# of -march=native. No web UI: the build reaches no network.
set -euo pipefail
dest="${TFQ_CACHE:-$HOME/.cache/tfq}/llama-server"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download llama-cpp-python --no-binary :all: --no-deps -q -d "$work"
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
isa="$(bash "$(dirname "$0")/ggml_flags.sh")"  # a plain assignment: set -e stops on its failure
read -ra flags <<< "$isa"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF "${flags[@]}" > "$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log"; exit 1; }
cmake --build "$work/build" --target llama-server -j "$(nproc)" > "$work/build.log" 2>&1 \
  || { grep -m5 -B2 -A5 "error" "$work/build.log" || tail -30 "$work/build.log"; exit 1; }
mkdir -p "$dest"
cp "$work/build/bin/llama-server" "$dest/llama-server"
"$dest/llama-server" --version 2>&1 | head -2
echo "$dest/llama-server (flags: ${flags[*]})"
