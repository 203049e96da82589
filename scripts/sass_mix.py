"""The instruction mix of a kernel's loops, with no GPU: NVRTC (PyPI)
compiles Kiln's CUDA source to a cubin and nvdisasm (PyPI) disassembles
it, so a kernel change's instructions a byte can be counted before any
device time is spent on it (docs/perf.md, session 34).

Usage: sass_mix.py SOURCE ARCH KERNEL...  (e.g. kiln.cu sm_90a
gemv_int4_one_g128_r2). SOURCE is `kiln_kernels::cuda::SOURCE` as written
by the cuda_source test (target/nvrtc-check/kiln.cu). Needs, in this
interpreter: nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (as
scripts/nvrtc_check.py) and nvidia-cuda-nvdisasm (its bin/nvdisasm)."""

import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile

import nvidia.cuda_nvrtc
import nvidia.cuda_runtime


def cubin(source: bytes, arch: str) -> bytes:
    libdir = os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib")
    include = os.path.join(list(nvidia.cuda_runtime.__path__)[0], "include")
    lib = ctypes.CDLL(os.path.join(libdir, "libnvrtc.so.12"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"kiln.cu", 0, None, None) != 0:
        raise SystemExit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"-I{include}".encode()]
    if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) != 0:
        raise SystemExit("NVRTC rejected the source (scripts/nvrtc_check.py shows why)")
    size = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, out)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.raw


def nvdisasm() -> str:
    import nvidia

    for root in nvidia.__path__:
        for dirpath, _, files in os.walk(root):
            if "nvdisasm" in files:
                return os.path.join(dirpath, "nvdisasm")
    raise SystemExit("no nvdisasm: pip install nvidia-cuda-nvdisasm")


def instructions(sass: str, kernel: str):
    """The kernel's instructions (opcode text) and its labels' positions."""
    m = re.search(r"\.text\." + re.escape(kernel) + r":(.*?)(?=\n\s*\.section|\Z)", sass, re.S)
    if not m:
        raise SystemExit(f"no kernel {kernel} in the cubin")
    lines, labels = [], {}
    for line in m.group(1).split("\n"):
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(lines)
            continue
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?);", line)
        if ins:
            lines.append(ins.group(1))
    return lines, labels


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def main() -> int:
    source, arch, kernels = sys.argv[1], sys.argv[2], sys.argv[3:]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kiln.cubin")
        with open(path, "wb") as f:
            f.write(cubin(open(source, "rb").read(), arch))
        sass = subprocess.run([nvdisasm(), "-c", path], capture_output=True, text=True, check=True).stdout
    for kernel in kernels:
        lines, labels = instructions(sass, kernel)
        print(f"{kernel}: {len(lines)} instructions")
        # A loop: a branch back to a label before it. Print each with its mix.
        for end, ins in enumerate(lines):
            back = re.search(r"BRA\s.*?`\(\.(L_x_\d+)\)", ins)
            if back and labels.get(back.group(1), len(lines)) <= end:
                start = labels[back.group(1)]
                mix = collections.Counter(opcode(i) for i in lines[start : end + 1])
                loads = sum(n for op, n in mix.items() if op in ("LDG", "LDGSTS"))
                top = ", ".join(f"{op} {n}" for op, n in mix.most_common(16))
                print(f"  loop at {start}..{end}: {end - start + 1} instructions, {loads} global loads: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
