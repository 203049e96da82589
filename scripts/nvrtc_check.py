"""Compiles CUDA C with NVRTC, no GPU needed: the check CI runs on Kiln's
kernels. Usage: nvrtc_check.py SOURCE ARCH...  (e.g. compute_90).
Needs the pip packages nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12
(the library and the cuda_fp16/bf16/fp8 headers) in this interpreter."""

import ctypes
import os
import sys

import nvidia.cuda_nvrtc
import nvidia.cuda_runtime


def main() -> int:
    source, archs = sys.argv[1], sys.argv[2:]
    libdir = os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib")
    include = os.path.join(list(nvidia.cuda_runtime.__path__)[0], "include")
    lib = ctypes.CDLL(os.path.join(libdir, "libnvrtc.so.12"))
    src = open(source, "rb").read()
    failed = 0
    for arch in archs:
        prog = ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kiln.cu", 0, None, None) != 0:
            print("nvrtcCreateProgram failed")
            return 1
        # Fast compilation (CUDA 12.8+): the same front end and the same
        # errors in a tenth of the time; this check keeps no code.
        opts = [
            f"--gpu-architecture={arch}".encode(),
            b"-std=c++17",
            b"--Ofast-compile=max",
            f"-I{include}".encode(),
        ]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        print(f"{arch}: {'ok' if rc == 0 else 'FAILED'}\n{log.value.decode().strip()}")
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        failed |= rc != 0
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
