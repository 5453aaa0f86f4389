"""llama.cpp's own server, the peer of ``infer bench serving --peer llama-server``.

``build`` fetches the llama-cpp-python source distribution from PyPI (its ``vendor/llama.cpp`` is a
whole llama.cpp tree, and PyPI is a source this project may reach), and builds ``llama-server``
and ``llama-bench`` from it under ``~/.cache/infer/llama.cpp``; a finished build is reused.

The build names this CPU's features instead of ``GGML_NATIVE``: a native build also turns on the
AMX kernels wherever ``/proc/cpuinfo`` reports AMX, and a VM that reports AMX without enabling it
kills the server on its first tile instruction. ``cmake_flags`` is that choice, from the cpuinfo
``flags`` line alone, so it is testable without a build. ``--amx on`` builds the other way on
purpose, into ``build-amx`` next to the default ``build``: the same named features plus the AMX
ones the CPU reports (``amx_tile``, ``amx_int8``, ``amx_bf16``), to measure llama.cpp's AMX backend
against its plain AVX-512 one on a machine where the tiles work (benchmarks/runs/llama-amx/).

``LlamaServer`` starts a built (or given) binary on one GGUF and stops it.

Usage: ``python -m infer.bench.llama_server [--jobs 2] [--force] [--amx on|off]``
(``scripts/build_llama_server.sh``) prints the path of ``llama-server``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from infer.fileio import default_cache_dir

SDIST = "llama-cpp-python"
TARGETS = ("llama-server", "llama-bench")
# cpuinfo flag -> the GGML option that compiles for it. AMX is deliberately absent (see above); it is
# _AMX_FEATURES, turned on only by ``amx=True``.
_X86_FEATURES = (
    ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
)
# GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw together, so it needs all five.
_AVX512_BASE = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
_AMX_FEATURES = (("amx_tile", "GGML_AMX_TILE"), ("amx_int8", "GGML_AMX_INT8"), ("amx_bf16", "GGML_AMX_BF16"))


def cache_dir() -> Path:
    return default_cache_dir() / "llama.cpp"


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature names of the first ``flags`` line of a ``/proc/cpuinfo`` text (empty off x86)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_flags(flags: set[str], amx: bool = False) -> list[str]:
    """The GGML CPU options for a CPU with these cpuinfo ``flags``: every x86 feature named, AMX off;
    with ``amx`` the AMX features the flags report on as well (ValueError when they report none, or
    lack the AVX-512 base that ggml's AMX code is compiled with).

    With no x86 flags at all (another architecture) the build stays native: the AMX trap is x86's.
    """
    if amx and ("amx_tile" not in flags or not all(f in flags for f in _AVX512_BASE)):
        raise ValueError("--amx on needs a CPU whose cpuinfo flags report amx_tile and AVX-512 "
                         "(avx512f/cd/vl/dq/bw)")
    if "avx" not in flags:
        return []
    avx512 = all(f in flags for f in _AVX512_BASE)
    out = ["-DGGML_NATIVE=OFF", f"-DGGML_AVX512={'ON' if avx512 else 'OFF'}"]
    for flag, option in _X86_FEATURES:
        on = flag in flags and (avx512 or not option.startswith("GGML_AVX512_"))
        out.append(f"-D{option}={'ON' if on else 'OFF'}")
    for flag, option in _AMX_FEATURES:
        out.append(f"-D{option}={'ON' if amx and flag in flags else 'OFF'}")
    return out


def host_cmake_flags(amx: bool = False) -> list[str]:
    """This machine's llama.cpp CMake flags (``cmake_flags`` of /proc/cpuinfo; none off Linux): what
    the peer builds use, and ``make install`` gives llama-cpp-python's build on a CPU with AMX."""
    if platform.system() != "Linux":
        if amx:
            raise ValueError("--amx on reads the CPU's features from /proc/cpuinfo (Linux only)")
        return []
    try:
        return cmake_flags(cpu_flags(Path("/proc/cpuinfo").read_text()), amx=amx)
    except OSError:
        if amx:
            raise
        return []


def build_dir_name(amx: bool = False) -> str:
    """The build folder inside ``vendor/llama.cpp``: ``build``, or ``build-amx`` for ``--amx on``."""
    return "build-amx" if amx else "build"


def configure_args(source: Path, build_dir: Path, cpu: list[str]) -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF", *cpu]


def _source_dir(root: Path, log: IO[str]) -> tuple[Path, str]:
    """The unpacked ``vendor/llama.cpp`` of the newest llama-cpp-python sdist in ``root`` (downloaded
    when there is none), and the sdist's version."""
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        SDIST, "-d", str(root)], check=True, stdout=log, stderr=subprocess.STDOUT)
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise RuntimeError(f"pip download {SDIST} left no sdist in {root}")
    sdist = sdists[-1]
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    unpacked = root / sdist.name.removesuffix(".tar.gz")
    source = unpacked / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    if not (source / "CMakeLists.txt").exists():
        raise RuntimeError(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt")
    return source, version


def build(root: Path | None = None, jobs: int = 2, force: bool = False, log: IO[str] | None = None,
          amx: bool = False) -> Path:
    """Build (or reuse) ``llama-server`` and ``llama-bench``; return the ``llama-server`` path. With
    ``amx`` the build has llama.cpp's AMX backend too, in its own folder (``build_dir_name``)."""
    root = root or cache_dir()
    log = log or sys.stderr
    cpu = host_cmake_flags(amx)
    source, version = _source_dir(root, log)
    build_dir = source / build_dir_name(amx)
    server = build_dir / "bin" / "llama-server"
    info_path = build_dir / "infer-build.json"
    if server.exists() and info_path.exists() and not force:
        return server
    configure = configure_args(source, build_dir, cpu)
    print("+ " + " ".join(configure), file=log, flush=True)
    subprocess.run(configure, check=True, stdout=log, stderr=subprocess.STDOUT)
    compile_ = ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
                "--target", *TARGETS]
    print("+ " + " ".join(compile_), file=log, flush=True)
    subprocess.run(compile_, check=True, stdout=log, stderr=subprocess.STDOUT)
    info = {"llama_cpp_python": version, "configure": configure[configure.index(str(build_dir)) + 1:],
            "targets": list(TARGETS), "amx": amx}
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return server


def build_info(server: Path) -> dict[str, Any]:
    """What ``build`` recorded next to this binary (empty for a binary built elsewhere), with the
    llama.cpp commit the sdist vendors (its CHANGELOG names it; the sdist carries no git history)."""
    info_path = server.parent.parent / "infer-build.json"
    if not info_path.exists():
        return {}
    info = json.loads(info_path.read_text())
    commit = vendored_commit(server.parent.parent.parent.parent.parent / "CHANGELOG.md", info.get("llama_cpp_python"))
    if commit:
        info["llama_cpp_commit"] = commit
    return info


def vendored_commit(changelog: Path, version: str | None) -> str | None:
    """The ``ggml-org/llama.cpp@HASH`` the CHANGELOG's section for ``version`` updates to."""
    if not version or not changelog.exists():
        return None
    section = False
    for line in changelog.read_text(errors="replace").splitlines():
        if line.startswith("## "):
            if section:
                return None
            section = line.startswith(f"## [{version}]")
        elif section and "llama.cpp@" in line:
            return line.split("llama.cpp@", 1)[1].split()[0].strip(".,)")
    return None


def find_or_build(binary: str | None = None, jobs: int = 2) -> Path:
    """``binary`` when given (a path or a name on PATH), else the cached build, built when missing."""
    if binary:
        found = shutil.which(binary) or (binary if Path(binary).is_file() else None)
        if found is None:
            raise FileNotFoundError(f"no llama-server binary {binary!r}")
        return Path(found)
    return build(jobs=jobs)


def server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr).strip() else ""


def spec_types(binary: Path) -> list[str]:
    """The ``--spec-type`` values this ``llama-server`` accepts (empty when it has no such flag)."""
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    for line in (out.stdout + out.stderr).splitlines():
        stripped = line.strip()
        if stripped.startswith("--spec-type"):
            return [t for t in stripped.split()[1].split(",") if t]
    return []


def free_port() -> int:
    """A local port nothing listens on now (for a server this bench starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float, what: str,
                 output: Callable[[], str] = lambda: "") -> None:
    """Wait until the server ``proc`` started answers 200 on ``url``/health; RuntimeError naming
    ``what`` (with the tail of ``output()``, its log) if it exits first, TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = output()[-4000:]
            raise RuntimeError(f"{what} exited with code {proc.returncode}" + (f":\n{log}" if log else ""))
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{what} at {url} gave no healthy /health in {timeout:.0f} s")


def start_infer_serve(serve_args: list[str], stack: contextlib.ExitStack, env: dict[str, str] | None = None,
                      stop_timeout: float = 90.0) -> tuple[subprocess.Popen[bytes], str]:
    """``infer serve SERVE_ARGS`` launched on a free local port (not waited for: ``wait_healthy``),
    terminated when ``stack`` closes (``stop_timeout``: Ray Serve replicas stop gracefully first);
    the process and its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "infer.cli", "serve", *serve_args, "--port", str(port)],
                            stdout=subprocess.DEVNULL, env=env or os.environ.copy())

    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=stop_timeout)

    stack.callback(stop)
    return proc, f"http://127.0.0.1:{port}"


class LlamaServer:
    """``llama-server -m GGUF`` on a free local port, for as long as the ``with`` block lasts."""

    def __init__(self, binary: Path, gguf: Path, threads: int, context: int, extra: list[str] | None = None,
                 startup_timeout: float = 300.0):
        self.binary, self.gguf, self.threads, self.context = binary, gguf, threads, context
        self.extra = list(extra or [])
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def command(self) -> list[str]:
        # One slot: the peer bench sends one request at a time, and a second slot would only split the
        # context. No web UI, and no prompt kept across requests (infer's prefix caching is off by
        # default): every request pays its own prefill on both servers.
        return [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.context), "-np", "1",
                "--no-webui", "--cache-reuse", "0", "--cache-ram", "0", *self.extra]

    def __enter__(self) -> LlamaServer:
        import tempfile
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self._proc, self.startup_timeout, "llama-server", self.output)
        except TimeoutError:
            self.__exit__(None, None, None)
            raise
        return self

    def output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.bench.llama_server",
                                description="build llama.cpp's llama-server and llama-bench from the "
                                            "llama-cpp-python sdist (reused once built)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default: 2)")
    p.add_argument("--force", action="store_true", help="configure and build again even when built")
    p.add_argument("--root", default=None, help="cache folder (default: ~/.cache/infer/llama.cpp)")
    p.add_argument("--amx", choices=("on", "off"), default="off",
                   help="on: also compile llama.cpp's AMX backend (the AMX features cpuinfo reports), "
                        "into vendor/llama.cpp/build-amx; off (default): AMX off, into build/")
    args = p.parse_args(argv)
    server = build(Path(args.root) if args.root else None, jobs=args.jobs, force=args.force,
                   amx=args.amx == "on")
    print(server)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
