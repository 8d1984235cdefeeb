#!/usr/bin/env bash
# The GPU checks, as one prepared run for a session that is lent a GPU. Each step has its own time limit, so the
# whole stays under the device tool's 10-minute command limit.
#
#   OUT=gpu-out bash benchmarks/gpu_session.sh
#
# The GPU machine has torch, triton, transformers and pytest but not gguf, FastAPI, uvicorn, pydantic or
# llguidance, and no network: download their wheels here into a folder git ignores, carry it, install there:
#   pip download -d .gpuwheels --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 \
#       --platform manylinux2014_x86_64 gguf fastapi uvicorn pydantic llguidance
#   (there) pip install --no-index --find-links .gpuwheels gguf fastapi uvicorn pydantic llguidance
#           pip install --no-deps --no-build-isolation -e .
#
# First run, 2026-12-04 (H200, torch 2.11 + CUDA 13, 16-core Xeon with AMX): the kernel check passed, `tfq
# together` was EXACT in every arm with the controls RED (132 s), and one test crashed its process: the CPU linear
# handed CUDA weights read a GPU pointer (now refused by the dispatcher, tests/test_arithmetic.py; the test runs
# the whole Triton backend on a GPU). The Triton linear took 2.4 ms at 512 rows of gate_up, cuBLAS 0.25 ms.
#
# 1. the Triton tests on the GPU (kernels against torch and float64, paged == contiguous, the engine on the
#    Triton backend alone vs together, paged, chunked and drafted, controls RED);
# 2. the kernel check, `tfq kernels`, on the GPU: every check, dtype and control;
# 3. kernel timings against torch SDPA (fp32, and bf16 flash) at 1/8/32 streams and 1k/8k/32k rows, and the
#    Triton linear layer against cuBLAS on the default model's shapes (with each one's row invariance);
# 4. `tfq together` on the GPU with a random model of the default model's shape (the real weights are
#    491 MB and cannot travel to a machine without network): every arm must be EXACT, controls RED. Its
#    tokenizer is the tests' small BPE, so the suite's prompts run longer (up to ~5k tokens): window 16384.
# Logs and JSON land in $OUT (at most 8 files come back from the device tool).
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
py=python3
status=0
step() { echo "== $*"; }

step "1/4 tests"
timeout 140 $py -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_engine.py \
    tests/test_kernel_check.py 2>&1 | tee "$OUT/tests.log" || status=1

step "2/4 tfq kernels"
timeout 80 $py -m tfq kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" || status=1

step "3/4 timings"
timeout 100 $py benchmarks/gpu_kernels.py 2>&1 | tee "$OUT/timings.log" || status=1

step "4/4 tfq together on a default-shaped random model"
model=/tmp/tfq-default-shape
timeout 100 $py - "$model" <<'EOF' || status=1
import sys
from tiny import write_tiny_checkpoint
write_tiny_checkpoint(sys.argv[1], family="qwen2", seed=7, layers=24, hidden=896, heads=14, kv_heads=2,
                      head_dim=64, intermediate=4864, vocab=151936, max_positions=32768, rope_theta=1e6)
EOF
timeout 150 $py -m tfq together --model "$model" --set device=cuda --set window=16384 --tokens 32 --evidence /tmp/together-evidence \
    2>&1 | tee "$OUT/together.log" || status=1
tar -czf "$OUT/together-evidence.tgz" -C /tmp together-evidence 2>/dev/null || true
echo "== done, status $status"
exit $status
