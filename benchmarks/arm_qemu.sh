#!/usr/bin/env bash
# An aarch64 (ARM64) Python 3.11 + torch 2.13.0 + tfq environment that runs on an x86-64 machine under qemu user-mode
# emulation, for running tfq's exactness check `tfq verify` on ARM64 when no ARM machine is at hand: it builds tfq's
# CPU kernels with an aarch64 cross compiler and checks the same bits come out as on x86.
#
# Usage:  benchmarks/arm_qemu.sh [DIR]        (DIR defaults to ./arm)
#         benchmarks/arm_qemu.sh /tmp/arm && PYTHONPATH=/tmp/arm/tfqsite TFQ_CPU_MARCH=armv8-a /tmp/arm/run.sh -m tfq verify --weights gguf
# DIR/run.sh takes python's arguments (e.g. run.sh -c "import torch; print(torch.__version__)"). DIR/tfqsite holds the
# tfq wheel of this checkout; rerun the script (or only its last step) after changing tfq.
#
# Time: 1-2.5 minutes on two cores with warm apt and pip caches, plus the downloads on a first run (torch's aarch64
# wheel is 430 MB); DIR takes about 1.3 GB. Under emulation everything runs 10-50x slower than natively: `import
# torch` takes ~20 s, and the first tfq run that needs the CPU kernels compiles them (2-3 minutes on two cores, once per
# DIR/torch_extensions).
#
# Needs: Debian 12 (bookworm) x86-64 with apt-get (root or sudo) and pip for the host python3 (setuptools >= 68).
# The sysroot comes from the host's own Debian archive for arm64; other releases ship another Python than 3.11
# (and Ubuntu serves arm64 from a different archive), so there the deb names below need adjusting.
set -euo pipefail

DIR=$(mkdir -p "${1:-./arm}" && cd "${1:-./arm}" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
PY=3.11
start=$SECONDS
step() { echo "== [$((SECONDS - start))s] $*"; }

step "host tools: qemu-user, the aarch64 cross compiler, ninja"
tools="qemu-user g++-aarch64-linux-gnu ninja-build"
missing=$(for p in $tools; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

step "sysroot: Debian's arm64 python$PY and the libraries it and torch load"
# apt-get download fetches arm64 debs only while dpkg knows the arm64 architecture; it is added just for this and
# removed again (with its package lists) on the way out, so the host's apt state stays as it was.
added_arm64=
drop_arm64() { if [ -n "$added_arm64" ]; then added_arm64=; $SUDO dpkg --remove-architecture arm64; $SUDO apt-get update -qq; fi; }
trap drop_arm64 EXIT
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
    added_arm64=1
fi
$SUDO apt-get update -qq
mkdir -p "$DIR/debs"
arm64="libc6 libgcc-s1 libstdc++6 libgomp1 zlib1g libzstd1 libssl3 libffi8 libexpat1 libbz2-1.0 liblzma5 libsqlite3-0
       libncursesw6 libtinfo6 libreadline8 libuuid1 libdb5.3 libgdbm6 libgdbm-compat4 libcrypt1 libnsl2 libtirpc3
       libgssapi-krb5-2 libk5crypto3 libkrb5-3 libkrb5support0 libkeyutils1 libcom-err2
       python$PY-minimal libpython$PY-minimal libpython$PY-stdlib libpython$PY python$PY-dev libpython$PY-dev"
(cd "$DIR/debs" && apt-get download -qq $(for p in $arm64; do echo "$p:arm64"; done) ca-certificates media-types)
drop_arm64
# dpkg -x unpacks without installing: DIR/root is the tree qemu's -L prefix puts under the emulated program
for deb in "$DIR"/debs/*.deb; do dpkg -x "$deb" "$DIR/root"; done

step "aarch64 wheels: torch 2.13.0 and tfq's runtime dependencies"
# pip installs wheels for another machine with --platform; it does not widen manylinux_2_28 to older glibc tags,
# so every manylinux tag the sysroot's glibc 2.36 can load is named
platforms="--platform manylinux2014_aarch64 $(for i in $(seq 17 36); do printf -- '--platform manylinux_2_%s_aarch64 ' "$i"; done)"
pipt="python3 -m pip install -q --target $DIR/site $platforms --python-version $PY --implementation cp --only-binary=:all:"
# --no-deps: PyPI's aarch64 torch is a CUDA 13 build whose pinned nvidia-* dependencies are gigabytes, and some of
# those exact versions do not exist for aarch64; the stubs below stand in for them
rm -rf "$DIR/site"
$pipt --no-deps torch==2.13.0
$pipt numpy mpmath sympy typing_extensions filelock networkx jinja2 fsspec pyyaml safetensors tokenizers typer rich \
    tqdm gguf setuptools

step "stub CUDA libraries"
# torch's libraries link libcudart, libcudnn, libnccl, ... (DT_NEEDED): without them import fails. Small stubs of the
# same names, whose every function reports "no device", go where torch's RPATH looks for the real ones
python3 "$REPO/benchmarks/arm_qemu_stubs.py" "$DIR/site/torch" "$DIR/root" "$DIR/site/nvidia/cu13/lib"

step "fake /proc/cpuinfo and MIDR registers"
# qemu-user passes the host's x86 /proc/cpuinfo through, and torch's cpuinfo library (which reads it and
# /sys/.../midr_el1 to tell ARM cores apart) crashes on it: `import torch` segfaults. qemu's -L prefix looks for
# paths under DIR/root first, so an ARM Neoverse-N1 description there, one entry per host CPU, is what torch sees.
n=$(getconf _NPROCESSORS_CONF)
mkdir -p "$DIR/root/proc"
for ((i = 0; i < n; i++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 50.00\n' "$i"
    printf 'Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n'
    printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n'
    mkdir -p "$DIR/root/sys/devices/system/cpu/cpu$i/regs/identification"
    echo 0x00000000413fd0c1 > "$DIR/root/sys/devices/system/cpu/cpu$i/regs/identification/midr_el1"
done > "$DIR/root/proc/cpuinfo"

step "compiler wrappers and run.sh"
# torch's extension builder (run by the emulated python) runs `c++` and `ninja` from PATH. The host's x86 ninja runs
# natively; c++/cc are the aarch64 cross compilers under the names torch expects, and see the sysroot's Python
# headers (pyconfig.h) last, after the cross compiler's own libc headers.
mkdir -p "$DIR/bin"
for name in c++:g++ g++:g++ cc:gcc gcc:gcc; do
    printf '#!/bin/sh\nexec aarch64-linux-gnu-%s -idirafter "%s/root/usr/include" "$@"\n' "${name#*:}" "$DIR" > "$DIR/bin/${name%%:*}"
    chmod +x "$DIR/bin/${name%%:*}"
done
ln -sf "$(command -v ninja)" "$DIR/bin/ninja"
cat > "$DIR/run.sh" <<'EOF'
#!/bin/sh
# Runs the aarch64 python3.11 of this folder under qemu user-mode emulation with its aarch64 wheels (site/);
# arguments are python's. bin/ (cross compiler wrappers, ninja) goes first on PATH for torch's extension builder.
ARM=$(cd "$(dirname "$0")" && pwd)
export QEMU_LD_PREFIX=$ARM/root
export PYTHONPATH=$ARM/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=$ARM/bin:$PATH
export CXX=$ARM/bin/c++ CC=$ARM/bin/cc
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ARM/torch_extensions}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONNOUSERSITE=1
exec qemu-aarch64 -L "$ARM/root" "$ARM/root/usr/bin/python3.11" "$@"
EOF
chmod +x "$DIR/run.sh"

step "tfq wheel of $REPO into $DIR/tfqsite"
# the wheel, not the checkout, so the kernels' sources and the recorded build facts come as an install has them
rm -rf "$DIR/wheel" "$DIR/tfqsite"
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$DIR/wheel" "$REPO"
python3 -m zipfile -e "$DIR"/wheel/tfq-*.whl "$DIR/tfqsite"

step "check: import torch under emulation"
"$DIR/run.sh" -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
step "done in $((SECONDS - start))s: PYTHONPATH=$DIR/tfqsite TFQ_CPU_MARCH=armv8-a $DIR/run.sh -m tfq verify"
