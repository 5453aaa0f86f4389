"""Build and load the CPU kernels (``cpu_kernels.c``): one library per instruction-set variant.

Each variant is the same source compiled with explicit ``-m`` flags (never ``-march=native``), so a
variant holds only the instructions it names: ``avx512-bf16`` has the bfloat16 and float32 kernels,
``avx512`` the float32 ones for AVX-512 CPUs without BF16 (most of them), ``avx2`` the float32 ones
for x86-64 CPUs without AVX-512. The best variant this CPU runs is used; an ARM NEON variant is one
more ``Variant`` entry and its float-vector section in ``cpu_kernels.c``.

Nothing here ever breaks a model load. A missing compiler, an unusable cache directory, a failed
build, a library that will not ``dlopen`` or whose interface differs from the one Python mirrors:
each makes ``load`` raise ``KernelUnavailable`` with a one-line reason, and the caller keeps the
PyTorch path and says why. A failed build leaves a marker next to where the library would be, so
the next start reads the reason instead of compiling again (delete the marker to retry).

The library is cached under ``$XDG_CACHE_HOME/infer/kernels`` (or ``~/.cache/infer/kernels``),
keyed by the source, the flags, the compiler's path and its version. The directory is created
``0700``; a directory or library not owned by this user, or writable by group or others, is refused
(with the cache on a shared path another user could otherwise plant the code this process runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infer.fileio import default_cache_dir

_HERE = Path(__file__).parent
SOURCES = (_HERE / "cpu_kernels.c", _HERE / "cpu_kernels_impl.h", _HERE / "thread_pool.h")
# -ffp-contract=off: a * b + c rounds twice, as the PyTorch operators the kernels replace do.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma")
_AVX512_CPU = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")


class KernelUnavailable(Exception):
    """The kernels cannot run here; the message is the one-line reason."""


@dataclass(frozen=True)
class Variant:
    """One build of ``cpu_kernels.c``: its compiler flags and the CPU flags they need."""

    name: str
    description: str  # how the startup line names it
    flags: tuple[str, ...]
    cpu_needs: tuple[str, ...]  # /proc/cpuinfo flags
    dtypes: tuple[str, ...]  # the C suffixes it holds, as infer_kernels_layout lists them
    sources: tuple[Path, ...] = SOURCES  # the file compiled first, then the headers it includes
    machine: str | None = "x86_64"  # the Linux machine it runs on (None: any, plain C)


# Best first: the first one this CPU runs is the one used.
VARIANTS = (
    Variant("avx512-bf16", "AVX-512 BF16 kernels (bfloat16 and float32)", (*_AVX512, "-mavx512bf16"),
            (*_AVX512_CPU, "avx512_bf16"), ("f32", "bf16")),
    Variant("avx512", "AVX-512 float32 kernels", _AVX512, _AVX512_CPU, ("f32",)),
    Variant("avx2", "AVX2 float32 kernels", ("-mavx2", "-mfma"), ("avx2", "fma"), ("f32",)),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)

# The quantized matrix-vector kernels (quant_kernels.c, infer.kernels.quant), best first. Each
# holds every GGUF block type; only the int8 dot product and the nibble unpacking differ per ISA.
QUANT_SOURCES = (_HERE / "quant_kernels.c", _HERE / "quant_x8.h", _HERE / "quant_x8_impl.h", _HERE / "quant_tiles.h",
                 _HERE / "thread_pool.h")
_QUANT_DTYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
_VNNI_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c")
_VNNI_CPU = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c")
# The tile variants (quant_tiles.h): AMX for every type's calls of 64 rows or more, AVX-512
# VNNI for the rest; it also needs the OS to grant tile state, asked at load (quant.py). On ARM,
# neon-i8mm: the same tile path on I8MM's SMMLA, sdot for 1-row calls; chosen where the CPU's
# Features list i8mm (Linux reports HWCAP2_I8MM there; a kernel too old to know it gets
# neon-dotprod). The emulated ones run the same tile code through C, on any CPU of their vectors:
# never chosen by default (quant.EMULATED), forced by name for the tests.
QUANT_VARIANTS = (
    Variant("avx512-amx", "AMX tile and AVX-512 VNNI quantized kernels", (*_VNNI_FLAGS, "-mamx-tile", "-mamx-int8"),
            (*_VNNI_CPU, "amx_tile", "amx_int8"), _QUANT_DTYPES, QUANT_SOURCES),
    Variant("avx512-vnni", "AVX-512 VNNI quantized kernels", _VNNI_FLAGS, _VNNI_CPU, _QUANT_DTYPES, QUANT_SOURCES),
    Variant("avx2", "AVX2 quantized kernels", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"),
            _QUANT_DTYPES, QUANT_SOURCES),
    Variant("neon-i8mm", "ARM I8MM (smmla) tile and NEON dot-product quantized kernels",
            ("-march=armv8.2-a+dotprod+i8mm",), ("asimddp", "i8mm"), _QUANT_DTYPES, QUANT_SOURCES, machine="aarch64"),
    Variant("neon-dotprod", "ARM NEON dot-product quantized kernels", ("-march=armv8.2-a+dotprod",), ("asimddp",),
            _QUANT_DTYPES, QUANT_SOURCES, machine="aarch64"),
    Variant("portable", "portable C quantized kernels", (), (), _QUANT_DTYPES, QUANT_SOURCES, machine=None),
    Variant("avx512-amx-emu", "AMX tiles emulated in C (avx512-amx-emu), AVX-512 VNNI quantized kernels",
            (*_VNNI_FLAGS, "-DX8_TILES_EMU"), _VNNI_CPU, _QUANT_DTYPES, QUANT_SOURCES),
    Variant("portable-amx-emu", "AMX tiles emulated in C (portable-amx-emu), portable C quantized kernels",
            ("-DX8_TILES_EMU",), (), _QUANT_DTYPES, QUANT_SOURCES, machine=None),
)


def _cpuinfo_field(*names: str) -> str | None:
    """The value of /proc/cpuinfo's first line naming one of ``names`` (None: no such line); OSError
    where the file cannot be read."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(names):
            return line.split(":", 1)[1].strip()
    return None


@functools.cache
def _detected_cpu_flags() -> frozenset[str]:
    try:
        return frozenset((_cpuinfo_field("flags", "Features") or "").split())
    except OSError:
        try:
            import cpuinfo

            return frozenset(cpuinfo.get_cpu_info().get("flags", []))
        except Exception:  # not installed, or it cannot tell
            return frozenset()


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``, ...); "" where unknown."""
    try:
        return _cpuinfo_field("vendor_id") or ""
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags: /proc/cpuinfo's ``flags`` (x86) or ``Features`` (ARM) on Linux,
    else py-cpuinfo's when it is installed, else none known. Tests replace this function to fake
    another CPU (then ``infer.kernels.reset()``)."""
    return _detected_cpu_flags()


def missing_cpu_flags(variant: Variant) -> list[str]:
    """The CPU flags ``variant`` needs that this CPU lacks (empty: it runs here)."""
    if variant.machine is None:
        return []
    if platform.system() != "Linux" or platform.machine() != variant.machine:
        return [f"an {variant.machine} Linux host (this is {platform.system()} {platform.machine()})"]
    return [flag for flag in variant.cpu_needs if flag not in cpu_flags()]


def _check_private(path: Path, what: str) -> None:
    info = path.stat()
    if info.st_uid != os.getuid():
        raise KernelUnavailable(f"{what} {path} is owned by uid {info.st_uid}, not this user: refusing it")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelUnavailable(f"{what} {path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}): "
                                "refusing it")


def compiler() -> tuple[str, str]:
    """The C compiler (``$CC``, else ``cc``, else ``gcc``) as a resolved path, and its version line."""
    name = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    path = shutil.which(name) if name else None
    if path is None:
        raise KernelUnavailable(f"no C compiler ({'CC=' + name + ' not found' if name else 'no cc or gcc on PATH'})")
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelUnavailable(f"the C compiler {path} does not run: {err}") from None
    lines = result.stdout.splitlines()
    if result.returncode != 0 or not lines:
        raise KernelUnavailable(f"the C compiler {path} does not run (`{path} --version` failed)")
    return os.path.realpath(path), lines[0]


def cache_dir() -> Path:
    """The private directory the libraries live in, created 0700 (KernelUnavailable if unusable)."""
    try:
        folder = default_cache_dir() / "kernels"
        if not folder.is_absolute():
            raise KernelUnavailable(f"no usable cache directory (HOME is unset; got {folder})")
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (OSError, RuntimeError) as err:
        raise KernelUnavailable(f"cache directory unusable: {err}") from None
    _check_private(folder, "cache directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise KernelUnavailable(f"cache directory {folder} is not writable")
    return folder


def library_path(variant: Variant) -> Path:
    """Where ``variant``'s library is (or will be) for this source, these flags and this compiler."""
    path, version = compiler()
    digest = hashlib.sha256()
    for source in variant.sources:
        digest.update(source.read_bytes())
    digest.update("\0".join((*COMMON_FLAGS, *variant.flags, path, version)).encode())
    return cache_dir() / f"{variant.sources[0].stem}-{variant.name}-{digest.hexdigest()[:16]}.so"


def _compile(variant: Variant, target: Path) -> None:
    cc, _ = compiler()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        base = [cc, *COMMON_FLAGS, *variant.flags, str(variant.sources[0]), "-o", str(built)]
        errors = []
        # libmvec (glibc's vector math) where it links, else the scalar expf.
        for command in (base + ["-lmvec", "-lm"], base + ["-DINFER_NO_LIBMVEC", "-lm"]):
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as err:
                errors.append(str(err))
                continue
            if result.returncode == 0:
                os.chmod(built, 0o700)
                os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
                return
            errors.append(next((line for line in result.stderr.splitlines() if "error" in line),
                               result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"))
        raise KernelUnavailable(f"compiling the {variant.name} kernels failed: {errors[-1]}")


def load(variant: Variant) -> ctypes.CDLL:
    """``variant``'s library, built first if needed; KernelUnavailable with the reason otherwise.
    Builds whatever this CPU can run; running it is the caller's choice (``missing_cpu_flags``)."""
    target = library_path(variant)
    marker = target.with_suffix(".failed")
    if marker.exists():
        reason = marker.read_text(errors="replace").strip() or "unknown"
        raise KernelUnavailable(f"{reason} (an earlier start; delete {marker} to retry)")
    if not target.exists():
        try:
            _compile(variant, target)
        except KernelUnavailable as err:
            with contextlib.suppress(OSError):  # unwritable: the next start retries, nothing worse
                marker.write_text(f"{err}\n")
            raise
    _check_private(target, "kernel library")
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        raise KernelUnavailable(f"loading {target.name} failed: {err}") from None
    _share_pool(lib)
    return lib


# The thread pool every kernel library of this process runs its loops on (thread_pool.h): the first
# library's, handed to each one loaded after it. Two pools' idle threads would spin against each
# other's work (a quantized model's decoder stack calls both libraries in every layer).
_pool: list[int] = []


def _share_pool(lib: ctypes.CDLL) -> None:
    try:
        handle, adopt = lib.infer_pool_handle, lib.infer_pool_adopt
    except AttributeError:
        raise KernelUnavailable("the library has no infer_pool_handle (an older build)") from None
    handle.argtypes, handle.restype = [], ctypes.c_void_p
    adopt.argtypes, adopt.restype = [ctypes.c_void_p], None
    if not _pool:
        _pool.append(handle())
    adopt(_pool[0])
