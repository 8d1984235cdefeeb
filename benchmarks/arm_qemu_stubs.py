#!/usr/bin/env python3
"""Stub .so files for the CUDA libraries the aarch64 torch wheel links (used by benchmarks/arm_qemu.sh).

The aarch64 torch wheel on PyPI is a CUDA build: libtorch_cuda.so and friends name libcudart.so.13, libcudnn.so.9,
libnccl.so.2, ... as DT_NEEDED, so `import torch` fails without them. The real NVIDIA wheels are gigabytes (and not
all of the pinned versions exist for aarch64), and the CPU path never calls them. So for each needed library that is
neither in torch/lib nor in the sysroot, this writes a small library of the same soname that defines every symbol
torch takes from it (under the symbol version torch asks for) as a function returning 100 (cudaErrorNoDevice):
torch.cuda.is_available() is then False and everything else runs on the CPU.

usage: arm_qemu_stubs.py TORCH_DIR SYSROOT OUT_DIR   (OUT_DIR: a directory in torch's RPATH, nvidia/cu13/lib)
"""
import glob
import os
import re
import subprocess
import sys
from collections import defaultdict

torch_dir, sysroot, out = sys.argv[1:4]


def tool(name, *args):
    return subprocess.run([f"aarch64-linux-gnu-{name}", *args], check=True, capture_output=True, text=True).stdout


libs = [p for p in glob.glob(f"{torch_dir}/lib/*.so*") + glob.glob(f"{torch_dir}/*.so") if os.path.isfile(p)]
have = {os.path.basename(p) for d in (f"{torch_dir}/lib", f"{sysroot}/lib/aarch64-linux-gnu",
                                      f"{sysroot}/usr/lib/aarch64-linux-gnu") for p in glob.glob(f"{d}/*")}
needed = {lib: set(re.findall(r"\(NEEDED\).*\[(.+)\]", tool("readelf", "-d", "--wide", lib))) for lib in libs}
missing = set().union(*needed.values()) - have

# symbol version -> the file that must define it, from each library's "Version needs" section (e.g. NVSHMEM ->
# libnvshmem_host.so.3); a library linked against a versioned symbol refuses to load unless the version node exists
version_file = {}
for lib in libs:
    text = tool("readelf", "-V", "--wide", lib)
    file = None
    for line in text[text.find("Version needs"):].splitlines() if "Version needs" in text else []:
        if m := re.search(r"File: (\S+)", line):
            file = m[1]
        elif (m := re.search(r"Name: (\S+)", line)) and file in missing:
            version_file[m[1]] = file

# every dynamic symbol some torch library or sysroot library defines: those need no stub
defined = set()
for lib in (libs + glob.glob(f"{sysroot}/lib/aarch64-linux-gnu/*.so*")
            + glob.glob(f"{sysroot}/usr/lib/aarch64-linux-gnu/*.so*")):
    if os.path.isfile(lib) and not os.path.islink(lib):
        defined |= {line.split()[-1].split("@")[0] for line in tool("nm", "-D", "--defined-only", lib).splitlines()}

# stub library -> version node (None: unversioned) -> symbols
stubs = {name: defaultdict(set) for name in missing}
for lib in libs:
    for line in tool("nm", "-D", "--undefined-only", lib).splitlines():
        kind, sym = line.split()[-2:]
        name, _, version = sym.partition("@")
        if kind != "U" or name in defined:  # weak references (w, v) may stay unresolved
            continue
        if version in version_file:
            stubs[version_file[version]][version].add(name)
        elif not version:  # no version says where it comes from: every unversioned missing library this one links
            for target in needed[lib] & missing:
                if not any(v for v in version_file if version_file[v] == target):
                    stubs[target][None].add(name)

os.makedirs(out, exist_ok=True)
for soname, nodes in sorted(stubs.items()):
    base = os.path.join(out, soname)
    symbols = sorted(set().union(*nodes.values())) if nodes else []
    with open(f"{base}.c", "w") as f:
        f.write(f"/* stub for {soname}: every function fails with 100 (cudaErrorNoDevice) */\n")
        f.writelines(f"int {s}(void) {{ return 100; }}\n" for s in symbols)
    flags = []
    if any(v for v in nodes):
        with open(f"{base}.map", "w") as f:
            for v, syms in nodes.items():
                f.write(f"{v} {{ global: {' '.join(s + ';' for s in sorted(syms))} }};\n")
        flags = [f"-Wl,--version-script={base}.map"]
    tool("gcc", "-shared", "-fPIC", "-O0", f"-Wl,-soname,{soname}", *flags, "-o", base, f"{base}.c")
    print(f"  stub {soname}: {len(symbols)} symbols")
