#!/usr/bin/env python3
"""Build llama-cpp-python 0.3.36 from its PyPI sdist with edgekv's native ops in it.

edgekv's own C++ (``native/llama/``: the public header ``include/llama-edgekv.h``
and the ops in ``src/llama-edgekv.cpp``) is copied into ``vendor/llama.cpp`` at
the same relative paths, then ``ggml_patches/`` applies the small edits to
llama.cpp's own files that hook it in. The result is a wheel cached outside
the clone under ``$EDGEKV_HOME/wheels/<key>/`` (default ``~/.cache/edgekv``),
keyed by everything that changes the binary: the llama-cpp-python version, the
hash of every source and patch, the CMake flags, the compiler and the CPU features (ggml builds
with -march=native). CI and fresh clones on the same machine reuse it; a
machine without the cache builds it (about 9 minutes on 2 cores; ccache makes
rebuilds after a patch change much faster).

Options:

- ``--cpu avx2`` (or ``EDGEKV_CPU=avx2``): ``-DGGML_NATIVE=OFF`` with ggml's
  default x86-64 set (SSE3 SSSE3 AVX AVX2 F16C FMA BMI2), no AVX-512, so an
  AVX-512 machine runs the kernels an AVX2-only CPU (AMD EPYC here) runs.
- ``--cuda``: ggml's CUDA backend too, for every architecture ggml lists.
  ggml-cuda links cuBLAS; a toolkit without it gets PyPI's ``nvidia-cublas``
  (installed into this Python on first use, about 450 MB);
  ``--cuda-arch 86`` (or ``EDGEKV_CUDA_ARCH``) compiles one
  (``CMAKE_CUDA_ARCHITECTURES``), which bounds the time: each architecture
  compiles every kernel again.
- ``--stock``: llama-cpp-python without edgekv's sources and patches, same flags (the
  baseline of ``bench/patch_overhead.py``).
- ``--target DIR``: install the wheel into DIR (``pip install --target``)
  instead of this Python.
- ``--install`` (and ``--target``) also put llama.cpp's rpc-server, compiled against the
  wheel's libggml, into the installed ``llama_cpp/lib`` (``edgekv rpc-server`` runs it);
  ``--install`` also installs the gguf-py of the same vendored llama.cpp in place of
  PyPI's ``gguf`` (same version number, older names), so generated models use the
  names this libllama loads.
- ``EDGEKV_BLAS=1``: ggml's OpenBLAS backend too (needs Debian's
  ``libopenblas-dev``), for experiments: it took large matrix products and
  prefilled slower here than the CPU kernels (``bench/RESULTS.md``), so
  setup does not build it.

Usage: python native/build_llama.py [--cuda [--cuda-arch N]] [--cpu native|avx2] [--stock]
                                    [--install | --target DIR] [--print-key]
"""

from __future__ import annotations

import argparse
import ctypes.util
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "ggml_patches"
SOURCE_DIR = ROOT / "native" / "llama"  # copied into vendor/llama.cpp at the same relative paths
CACHE = Path(os.environ.get("EDGEKV_HOME", Path.home() / ".cache" / "edgekv")).expanduser()  # as edgekv.models

# AMX is compiled out: the AMX buffer type segfaults on batches of ~21+ tokens
# on this CPU family (docs/design.md section 5); the other extra buffer types
# (weight repacking) stay. Tools, tests, examples and llava are not needed.
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BASE_FLAGS = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    # llama.cpp's RPC backend (libggml-rpc): a model and its KV cache on other machines'
    # rpc-servers (``edgekv ... --rpc HOST:PORT``); the server itself is built beside the wheel.
    "-DGGML_RPC=ON",
    f"-DCMAKE_C_FLAGS={AMX_OFF}",
    f"-DCMAKE_CXX_FLAGS={AMX_OFF}",
]
CUDA_FLAGS = ["-DGGML_CUDA=ON"]
# ggml's BLAS backend (OpenBLAS, Debian's libopenblas-dev) takes matrix products of 32+ rows
BLAS_FLAGS = ["-DGGML_BLAS=ON", "-DGGML_BLAS_VENDOR=OpenBLAS"]
# ggml's defaults without GGML_NATIVE: AVX, AVX2, BMI2, FMA, F16C on; AVX-512 and AMX off
CPU_FLAGS = {"native": [], "avx2": ["-DGGML_NATIVE=OFF"]}


def log(msg: str) -> None:
    print(f"[edgekv build] {msg}", file=sys.stderr, flush=True)


def patches(stock: bool = False) -> list[Path]:
    return [] if stock else sorted(PATCH_DIR.glob("*.patch"))


def sources(stock: bool = False) -> list[Path]:
    """edgekv's files to copy into llama.cpp, relative to ``SOURCE_DIR``."""
    return [] if stock else sorted(p.relative_to(SOURCE_DIR) for p in SOURCE_DIR.rglob("*") if p.is_file())


def cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}|{flags}"


def compiler_signature() -> str:
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=False).stdout
        return out.splitlines()[0] if out else "?"
    except OSError:
        return "?"


def cuda_toolkit_flags() -> list[str]:
    """ggml-cuda links cuBLAS and, for its memory pool, the driver library. A CUDA toolkit without it (nvcc and the runtime only, as on
    this project's machines) gets it from PyPI's nvidia-cublas wheel, installed into this
    Python on first use, and CMake is pointed at its headers and libraries. Without a
    driver library (no GPU, no stubs) the pool is ggml's legacy one (GGML_CUDA_NO_VMM)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        sys.exit("[edgekv build] --cuda needs nvcc (the CUDA toolkit) on PATH")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    major = next((ln.split("release ")[1].split(".")[0] for ln in out.splitlines() if "release " in ln), "")
    home = Path(os.environ.get("CUDA_HOME", Path(nvcc).resolve().parent.parent))
    flags = []
    if not list(home.glob("lib*/stubs/libcuda.so")) and ctypes.util.find_library("cuda") is None:
        # no driver library to link (no GPU, no stubs): ggml's legacy memory pool needs none
        flags.append("-DGGML_CUDA_NO_VMM=ON")
    if any((home / d / "cublas_v2.h").exists() for d in ("include", "targets/x86_64-linux/include")):
        return flags
    site = Path(sysconfig.get_paths()["purelib"])
    found = sorted(site.glob("nvidia/*/include/cublas_v2.h"))
    if not found:
        pkg = "nvidia-cublas" if major and int(major) >= 13 else f"nvidia-cublas-cu{major}"
        log(f"the CUDA toolkit has no cuBLAS: installing {pkg} from PyPI (about 450 MB)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"{pkg}=={major}.*"], check=True)
        found = sorted(site.glob("nvidia/*/include/cublas_v2.h"))
    if not found:
        sys.exit("[edgekv build] no cuBLAS headers in the CUDA toolkit or in nvidia-cublas")
    inc = found[0].parent
    lib = inc.parent / "lib"
    libs = {n: next(iter(sorted(lib.glob(f"lib{n}.so*"))), None) for n in ("cublas", "cublasLt")}
    if None in libs.values():
        sys.exit(f"[edgekv build] cuBLAS libraries missing in {lib}")
    return flags + [f"-DCMAKE_CUDA_FLAGS=-I{inc}"] + [f"-DCUDA_{n}_LIBRARY={p}" for n, p in libs.items()]


def cmake_flags(cuda: bool, cpu: str = "native") -> list[str]:
    flags = list(BASE_FLAGS) + CPU_FLAGS[cpu]
    if cuda:
        flags += CUDA_FLAGS + cuda_toolkit_flags()
        if os.environ.get("EDGEKV_CUDA_ARCH"):
            flags += [f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['EDGEKV_CUDA_ARCH']}"]
    if os.environ.get("EDGEKV_BLAS") == "1":
        flags += BLAS_FLAGS
    if shutil.which("ccache"):
        flags += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        if cuda:  # ggml-cuda's template instances take hours on 2 cores: keep each one compiled
            flags += ["-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
    return flags


def build_key(cuda: bool, cpu: str = "native", stock: bool = False) -> str:
    h = hashlib.sha256()
    h.update(f"llama-cpp-python=={VERSION}\n".encode())
    for rel in sources(stock):
        h.update(rel.as_posix().encode() + b"\n" + (SOURCE_DIR / rel).read_bytes())
    for p in patches(stock):
        h.update(p.name.encode() + b"\n" + p.read_bytes())
    if stock:
        h.update(b"stock\n")
    # ccache is a launcher, not an input: leave it out of the key.
    h.update(" ".join(f for f in cmake_flags(cuda, cpu) if "LAUNCHER" not in f).encode())
    h.update(cpu_signature().encode())
    h.update(compiler_signature().encode())
    h.update(f"py{sys.version_info.major}.{sys.version_info.minor}".encode())
    return h.hexdigest()[:20]


def fetch_sdist() -> Path:
    dest = CACHE / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    found = list(dest.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    log(f"downloading llama-cpp-python=={VERSION} sdist from PyPI")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         f"llama-cpp-python=={VERSION}", "-d", str(dest)],
        check=True,
    )
    return next(dest.glob(f"llama_cpp_python-{VERSION}.tar.gz"))


def apply_patches(src: Path, stock: bool = False) -> None:
    """Copy edgekv's sources into the vendored llama.cpp, then apply the patches in order."""
    vendor = src / "vendor" / "llama.cpp"
    for rel in sources(stock):
        dest = vendor / rel
        if dest.exists():
            sys.exit(f"[edgekv build] llama.cpp in llama-cpp-python {VERSION} already has {rel}; "
                     f"edgekv's copy would replace it")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SOURCE_DIR / rel, dest)
    for p in patches(stock):
        log(f"applying {p.name}")
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(p)], cwd=vendor,
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"[edgekv build] patch {p.name} does not apply to llama.cpp in "
                     f"llama-cpp-python {VERSION}:\n{r.stdout}{r.stderr}")


def build(cuda: bool, cpu: str = "native", stock: bool = False) -> Path:
    key = build_key(cuda, cpu, stock)
    out = CACHE / "wheels" / key
    wheels = list(out.glob("llama_cpp_python-*.whl")) if out.is_dir() else []
    what = f"sources: {len(sources(stock))}, patches: {len(patches(stock))}, cpu: {cpu}"
    if wheels:
        log(f"cached build {key} ({what})")
        return wheels[0]
    sdist = fetch_sdist()
    with tempfile.TemporaryDirectory(prefix="edgekv-build-") as tmp:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        src = Path(tmp) / f"llama_cpp_python-{VERSION}"
        apply_patches(src, stock)
        env = dict(os.environ)
        env["CMAKE_ARGS"] = " ".join(f"'{f}'" if " " in f else f for f in cmake_flags(cuda, cpu))
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        env.setdefault("CCACHE_DIR", str(CACHE / "ccache"))
        # ccache keys on paths: the source and scikit-build's build tree both live
        # under one temp dir given as base dir, so every build sees the same relative paths.
        env.setdefault("CCACHE_BASEDIR", tmp)
        env.setdefault("SKBUILD_BUILD_DIR", str(Path(tmp) / "build"))
        env.setdefault("CCACHE_NOHASHDIR", "1")
        tmp_out = Path(tmp) / "wheel"
        log(f"building llama-cpp-python {VERSION} ({what}), key {key} "
            f"(about 9 minutes on 2 cores the first time)")
        r = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_out), str(src)], env=env
        )
        if r.returncode != 0:
            sys.exit("[edgekv build] building llama-cpp-python failed (see the log above)")
        built = next(tmp_out.glob("llama_cpp_python-*.whl"))
        out.mkdir(parents=True, exist_ok=True)
        final = out / built.name
        shutil.copy2(built, out / (built.name + ".part"))
        os.replace(out / (built.name + ".part"), final)
        return final


RPC_SERVER = "ggml-rpc-server"  # the name llama.cpp's CMake gives it; edgekv.rpc looks for it


def build_rpc_server(whl: Path) -> Path:
    """llama.cpp's rpc-server (``tools/rpc/rpc-server.cpp`` of the same sdist), compiled
    against this wheel's libggml and kept beside the wheel. llama-cpp-python's CMake does
    not build llama.cpp's tools, and the server is one file over ggml's public API, so it
    is compiled here in seconds instead of a second CMake build of ggml. Linked to the
    very libggml the client loads, it speaks the same protocol and runs the same kernels."""
    out = whl.parent / RPC_SERVER
    if out.is_file():
        return out
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        sys.exit("[edgekv build] building llama.cpp's rpc-server needs a C++ compiler (c++)")
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory(prefix="edgekv-rpc-") as tmp:
        with tarfile.open(fetch_sdist()) as tf:
            wanted = [m for m in tf.getmembers() if m.name.startswith(prefix + "ggml/include/")
                      or m.name == prefix + "tools/rpc/rpc-server.cpp"]
            tf.extractall(tmp, members=wanted, filter="data")
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(tmp, members=[n for n in zf.namelist() if n.startswith("llama_cpp/lib/")])
        src, libdir = Path(tmp) / prefix, Path(tmp) / "llama_cpp" / "lib"
        origin = "@loader_path" if sys.platform == "darwin" else "$ORIGIN"
        log(f"building llama.cpp's rpc-server against {whl.name}")
        r = subprocess.run([cxx, "-O2", "-std=c++17", f"-I{src / 'ggml/include'}", str(src / "tools/rpc/rpc-server.cpp"),
                            f"-L{libdir}", "-lggml", "-lggml-base", f"-Wl,-rpath,{origin}", "-o", str(out) + ".part"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"[edgekv build] building llama.cpp's rpc-server failed:\n{r.stderr[-4000:]}")
    os.replace(str(out) + ".part", out)
    return out


def install_rpc_server(whl: Path, site: Path) -> None:
    """Put the rpc-server into the installed wheel's library folder, beside its libggml."""
    dest = site / "llama_cpp" / "lib"
    if not dest.is_dir():
        sys.exit(f"[edgekv build] {dest} is missing after installing {whl.name}")
    shutil.copy2(build_rpc_server(whl), dest / (RPC_SERVER + ".part"))
    os.replace(dest / (RPC_SERVER + ".part"), dest / RPC_SERVER)


def install_gguf_py() -> None:
    """pip install the gguf-py that ships inside the vendored llama.cpp, in place of PyPI's:
    its tensor and key names are the ones this libllama loads (``edgekv/tinymodels.py``
    writes models with them; PyPI's release of the same version number lags behind)."""
    dest = CACHE / "gguf-py" / VERSION
    if not (dest / "pyproject.toml").is_file():
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/gguf-py/"
        with tempfile.TemporaryDirectory(prefix="edgekv-gguf-") as tmp, tarfile.open(fetch_sdist()) as tf:
            tf.extractall(tmp, members=[m for m in tf.getmembers() if m.name.startswith(prefix)], filter="data")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.move(str(Path(tmp) / prefix), dest)
    log(f"installing llama.cpp's own gguf-py ({dest})")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(dest)],
                   check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", default=os.environ.get("EDGEKV_CUDA") == "1",
                    help="build the CUDA backend too (or EDGEKV_CUDA=1)")
    ap.add_argument("--cuda-arch", default=os.environ.get("EDGEKV_CUDA_ARCH"),
                    help="with --cuda: one CUDA architecture, e.g. 86 (or EDGEKV_CUDA_ARCH)")
    ap.add_argument("--cpu", choices=sorted(CPU_FLAGS), default=os.environ.get("EDGEKV_CPU", "native"),
                    help="native: -march=native (default); avx2: an AVX2-only CPU's kernels (or EDGEKV_CPU=avx2)")
    ap.add_argument("--stock", action="store_true", help="without ggml_patches/ (a baseline to compare against)")
    ap.add_argument("--install", action="store_true", help="pip install the wheel into this Python")
    ap.add_argument("--target", type=Path, help="install the wheel into this directory instead")
    ap.add_argument("--print-key", action="store_true")
    a = ap.parse_args()
    if a.cpu not in CPU_FLAGS:
        sys.exit(f"[edgekv build] unknown --cpu/EDGEKV_CPU {a.cpu!r}; use {' or '.join(CPU_FLAGS)}")
    if a.cuda_arch and not a.cuda:
        sys.exit("[edgekv build] --cuda-arch needs --cuda (or EDGEKV_CUDA=1)")
    if a.cuda_arch:
        os.environ["EDGEKV_CUDA_ARCH"] = a.cuda_arch
    if a.print_key:
        print(build_key(a.cuda, a.cpu, a.stock))
        return
    whl = build(a.cuda, a.cpu, a.stock)
    print(whl)
    if a.target:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade",
                        "--target", str(a.target), str(whl)], check=True)
        install_rpc_server(whl, a.target)
    elif a.install:
        pip = [sys.executable, "-m", "pip", "install", "-q"]
        # Same version as a stock install, so force the swap; then a second
        # pass brings in the bindings' own dependencies.
        subprocess.run([*pip, "--force-reinstall", "--no-deps", str(whl)], check=True)
        subprocess.run([*pip, str(whl)], check=True)
        install_rpc_server(whl, Path(sysconfig.get_paths()["platlib"]))
        install_gguf_py()


if __name__ == "__main__":
    main()
