#!/usr/bin/env bash
# Builds ik_llama.cpp (a llama.cpp fork with its own CPU kernels, "iqk") once, for `tfq bench --peer ik_llama.cpp`:
# from the ik-llama-cpp-python sdist (package registry), whose own pip build stops (it asks git for build info), so
# the vendored ik_llama.cpp is built with cmake directly (shared libllama.so and libggml.so) and laid beside the
# sdist's Python wrapper, which finds them in its package folder (ik_llama_cpp/lib/).
#
#   nice -n 10 bash benchmarks/build_ik_llama.sh      # 10-20 minutes on two cores; prints where it put things
#
# Lands in $TFQ_CACHE/ik_llama/ (default ~/.cache/tfq/ik_llama/), where tfq looks (or set TFQ_IK_LLAMA to another
# folder that holds ik_llama_cpp/). The build names the CPU's instruction sets (ggml_flags.sh) instead of
# -march=native. ik_llama.cpp has no AMX code and no AMX options; its iqk kernels take their fast AVX-512 path only
# with F, BW, VL, DQ and VNNI all on, and its cmake names only F and BW, so the rest go in as compiler flags.
set -euo pipefail
dest="${TFQ_IK_LLAMA:-${TFQ_CACHE:-$HOME/.cache/tfq}/ik_llama}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download ik-llama-cpp-python==0.1.5 --no-binary :all: --no-deps -q -d "$work"
tar xzf "$work"/ik_llama_cpp_python-*.tar.gz -C "$work"
pkg="$(echo "$work"/ik_llama_cpp_python-*/)"
pkg="${pkg%/}"
src="$pkg/vendor/ik_llama.cpp"
isa="$(bash "$(dirname "$0")/ggml_flags.sh")"  # a plain assignment: set -e stops on its failure (AMX flags ignored)
read -ra flags <<< "$isa"
extra=()
cpu="$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true)"
has() { [[ " $cpu " == *" $1 "* ]]; }
if has avx512f; then
  for isa in avx512vl avx512dq avx512cd; do has "$isa" && extra+=("-m$isa"); done
fi
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_CCACHE=OFF \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$work/build/lib" -DCMAKE_BUILD_RPATH='$ORIGIN' \
  -DCMAKE_C_FLAGS="${extra[*]}" -DCMAKE_CXX_FLAGS="${extra[*]}" "${flags[@]}" > "$work/cmake.log" 2>&1 \
  || { tail -30 "$work/cmake.log"; exit 1; }
cmake --build "$work/build" --target llama ggml -j "$(nproc)" > "$work/build.log" 2>&1 \
  || { grep -m5 -B2 -A5 "error" "$work/build.log" || tail -30 "$work/build.log"; exit 1; }
rm -rf "$dest/ik_llama_cpp"  # the previous build only: TFQ_IK_LLAMA may name a folder that holds more
mkdir -p "$dest"
cp -r "$pkg/ik_llama_cpp" "$dest/ik_llama_cpp"
mkdir -p "$dest/ik_llama_cpp/lib"
cp -L "$work/build/lib/libllama.so" "$work/build/lib/libggml.so" "$dest/ik_llama_cpp/lib/"
PYTHONPATH="$dest" python3 -c "import ik_llama_cpp, sys; print('ik_llama_cpp', ik_llama_cpp.__file__)"
echo "$dest/ik_llama_cpp (libs in lib/; flags: ${flags[*]} ${extra[*]})"
