#!/usr/bin/env bash
# Prints the cmake flags that build llama.cpp's CPU code (ggml) for this CPU's instruction sets, one by one, instead
# of -march=native: on some machines (x86-64 with AVX-512 and AMX in a VM) a native build dies with an illegal
# instruction, while naming the sets with AMX off runs. Every AVX-512 extension ggml has a flag for is named where
# the CPU has it: without them llama.cpp's 8-bit dot products take slower paths (a build with AVX-512 alone had no
# VNNI on a Xeon that has it).
#
#   CMAKE_ARGS="$(bash benchmarks/ggml_flags.sh)" pip install --force-reinstall --no-cache-dir llama-cpp-python
#
# build_llama_server.sh and build_ik_llama.sh build with them. Off x86-64 (ARM) it prints -DGGML_NATIVE=ON: the
# illegal instruction is an x86 VM's.
set -euo pipefail
flags=(-DGGML_NATIVE=ON)
case "$(uname -m)" in
  x86_64|i?86)
    flags=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    cpu="$(grep -m1 '^flags' /proc/cpuinfo || true)"
    for pair in avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C avx_vnni:GGML_AVX_VNNI \
                avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI \
                avx512_bf16:GGML_AVX512_BF16; do
      if [[ " $cpu " == *" ${pair%%:*} "* ]]; then flags+=("-D${pair##*:}=ON"); else flags+=("-D${pair##*:}=OFF"); fi
    done
    ;;
esac
echo "${flags[*]}"
