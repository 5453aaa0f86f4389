"""Memory-bound matrix-vector products for CPU decoding (``cpu_kernels.c``), built on first use.

A decode step of a small model is a stream of weights through a handful of input rows, so tokens/s
is the speed those weights are read at. On the project's AVX-512 CPUs oneDNN's pre-packed bf16
linears read them at ~13 GB/s (one thread, all 121 of SmolLM2-135M's per step), a plain AVX-512
BF16 dot-product loop at ~23 GB/s; float32 gains alike. ``GemvLinear`` runs the loop for up to
``MAX_ROWS`` rows (decode steps, verification passes, draft trees) and ``F.linear`` above (prefill,
where the matmul is compute-bound and oneDNN's). The loop takes four weight rows and up to four
input rows at a time in registers and fetches the weight two blocks ahead: on the Xeon of
2026-11-23 (one thread, the 121 products of a SmolLM2 step) that took a 1-row step from 31.5 to
20.1 ms and a 6-row verification pass from 51.6 to 34.4 ms; past 6 rows the dot-product
instructions, not memory, set the pace.

The C file is compiled once per machine with the system C compiler into ``~/.cache/infer/kernels``;
where that fails, or the CPU lacks AVX-512 (BF16), or the result does not match ``F.linear`` on a
probe, the loader keeps the oneDNN path (``PackedLinear``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.cache.protocol import KVBatch
from infer.fileio import default_cache_dir

# Rows above this go to F.linear: beyond a few dozen rows a product is bound by arithmetic, not by
# reading the weight, and oneDNN's blocked GEMM catches up (measured even at 32-64 rows).
MAX_ROWS = 64
_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_CPU_FLAGS = {torch.bfloat16: ("avx512f", "avx512bw", "avx512_bf16"), torch.float32: ("avx512f",)}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}  # each kernel's C name ends in its dtype's


@functools.cache
def cpu_flags() -> set[str]:
    """This CPU's feature flags: /proc/cpuinfo's ``flags`` (x86) or ``Features`` (ARM) on Linux,
    else py-cpuinfo's when it is installed, else none known."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
        return set()
    except OSError:
        try:
            import cpuinfo

            return set(cpuinfo.get_cpu_info().get("flags", []))
        except Exception:  # not installed, or it cannot tell
            return set()


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where this machine cannot build them."""
    if platform.system() != "Linux" or platform.machine() != "x86_64" or "avx512f" not in cpu_flags():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = _SOURCE.read_bytes()
    # -march=native code is for this CPU only: the key names the CPU's flags as well as the source.
    key = hashlib.sha256(source + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    target = default_cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            # -ffp-contract=off: a * b + c rounds twice, as the PyTorch operators it replaces do;
            # libmvec (glibc's vector math) where it links, else the scalar expf.
            base = [compiler, "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared",
                    "-fPIC", str(_SOURCE), "-o", str(built)]
            for command in (base + ["-lmvec", "-lm"], base + ["-DINFER_NO_LIBMVEC", "-lm"]):
                try:
                    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                except (OSError, subprocess.TimeoutExpired):
                    return None
                if result.returncode == 0:
                    break
            else:
                return None
            os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
    lib = ctypes.CDLL(str(target))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for suffix in ("bf16", "f32"):
        for name, argtypes in (("gemv", [pointer] * 4 + [size] * 3 + [ctypes.c_int]),
                               ("rmsnorm", [pointer] * 3 + [size] * 2 + [ctypes.c_float]),
                               ("rope", [pointer, size, size] + [pointer] * 3 + [size] * 3),
                               ("silu_mul", [pointer] * 2 + [size] * 2)):
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
        stack = getattr(lib, f"decoder_stack_{suffix}")
        stack.argtypes, stack.restype = [ctypes.POINTER(StackArgs)], None
    return lib


# Set while ``kernel_threads_only`` runs a pass: the thread count the kernels use instead of torch's.
_kernel_threads: list[int | None] = [None]


def _threads() -> int:
    """The threads a kernel call uses: ``kernel_threads_only``'s count inside it, else torch's."""
    return _kernel_threads[0] or torch.get_num_threads()


@contextlib.contextmanager
def kernel_threads_only() -> Iterator[None]:
    """Run a small pass (a decode step, a verification) with PyTorch's operators on one thread and
    the kernels on all of torch's threads. Those operators work on rows of a few hundred elements,
    where handing work to another thread costs more than it saves: on the 2-core Xeon of
    2026-11-23 a SmolLM2 bf16 decode step took 29.4 ms with two threads for everything, 25.7 ms with
    two for the kernels and one for the rest."""
    threads = torch.get_num_threads()
    if threads == 1 or _kernel_threads[0] is not None:
        yield
        return
    _kernel_threads[0] = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _kernel_threads[0] = None


# The kernels are plain C calls, invisible to torch.profiler: under the profiler each call is
# recorded as one of these events (``infer bench generation --profile`` counts the first with the
# weight matmuls).
PROFILER_EVENT = "infer::cpu_gemv"
FUSED_EVENT = "infer::cpu_fused"  # RMSNorm, RoPE, SwiGLU's activation
STACK_EVENT = "infer::cpu_stack"  # the whole decoder stack in one call (matmuls included)


def _recorded(event: str) -> contextlib.AbstractContextManager[Any]:
    return torch.profiler.record_function(event) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the kernel (``x`` CPU, bfloat16 or float32, any leading dims)."""
    with _recorded(PROFILER_EVENT):
        return _gemv(x, weight, bias)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lib = _library()
    assert lib is not None and weight.dtype in _SUFFIX and weight.is_contiguous()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
    getattr(lib, f"gemv_{_SUFFIX[weight.dtype]}")(weight.data_ptr(), rows.data_ptr(),
                                                  None if bias is None else bias.data_ptr(), out.data_ptr(),
                                                  rows.shape[0], weight.shape[0], weight.shape[1],
                                                  _threads())
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("infer::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gemv`` as an operator torch.compile keeps whole (it cannot trace into a C call)."""
    return gemv(x, weight, bias)


@gemv_op.register_fake
def _gemv_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _call(name: str, dtype: torch.dtype, *args: object) -> None:
    """One fused small operator (RMSNorm, RoPE, SwiGLU's activation): one C call."""
    lib = _library()
    assert lib is not None and dtype in _SUFFIX
    with _recorded(FUSED_EVENT):
        getattr(lib, f"{name}_{_SUFFIX[dtype]}")(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` (contiguous, ``weight``'s dtype) as ``layers.RMSNorm`` computes it."""
    out = torch.empty_like(x)
    _call("rmsnorm", x.dtype, x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
          x.shape[-1], eps)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``layers.apply_rope`` for ``x`` [B, T, heads, head_dim], a view whose heads and head
    elements lie like a contiguous tensor's but whose tokens may be strided (heads sliced out of
    the fused projection); cos/sin [B, T, 1, head_dim] contiguous. Returns a contiguous tensor."""
    batch, width, heads, dim = x.shape
    out = torch.empty(batch, width, heads, dim, dtype=x.dtype)
    _call("rope", x.dtype, x.data_ptr(), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
          batch * width, heads, dim)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [..., 2 * inter] (contiguous; gate first)."""
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    _call("silu_mul", gate_up.dtype, gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter)
    return out


class StackArgs(ctypes.Structure):
    """``StackArgs`` of cpu_kernels.c: one pass through the whole decoder stack."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("rows", "width", "batch", "hidden", "heads", "kv_heads", "head_dim",
                                              "inter", "layers")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("tensors", "k_stores", "v_stores", "write_rows", "read_rows")),
        ("read_start", ctypes.c_int64), ("context", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("mask", "cos", "sin", "x")),
        ("threads", ctypes.c_int)]


# The per-layer tensors of ``decoder_stack``'s table, in the C enum's order.
STACK_TENSORS = ("input_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias", "post_norm",
                 "gate_up_weight", "gate_up_bias", "down_weight", "down_bias")
MAX_STACK_HEAD_DIM = 256  # the attention keeps a key or value row in 16 registers of 16 floats
MAX_STACK_GROUP = 16  # query heads per KV head the attention takes (cpu_kernels.c's MAX_GROUP)


def decoder_stack(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: torch.Tensor, kv: KVBatch,
                  shape: dict[str, int], eps: float) -> torch.Tensor:
    """Every decoder layer over ``x`` [B, T, hidden] (contiguous) in one C call: ``table`` holds
    each layer's tensor addresses (``STACK_TENSORS``), ``kv`` says where the new keys and values go
    and which cached ones each token sees. Returns the last layer's output (a new tensor)."""
    lib = _library()
    assert lib is not None and x.dtype in _SUFFIX
    batch, width, hidden = x.shape
    out = x.clone()
    write_rows = kv.write_index
    if kv.token_valid is not None:  # padding tokens write nothing
        write_rows = torch.full((batch * width,), -1, dtype=torch.long)
        write_rows[kv.token_valid.flatten()] = kv.write_index
    k_stores = torch.tensor([t.data_ptr() for t in kv.k_layers], dtype=torch.long)
    v_stores = torch.tensor([t.data_ptr() for t in kv.v_layers], dtype=torch.long)
    mask = None if kv.mask is None else kv.mask.contiguous()
    read_rows = None if kv.read_index is None else kv.read_index.contiguous()
    args = StackArgs(rows=batch * width, width=width, batch=batch, hidden=hidden, eps=eps,
                     scale=shape["head_dim"] ** -0.5, tensors=table.data_ptr(), k_stores=k_stores.data_ptr(),
                     v_stores=v_stores.data_ptr(), write_rows=write_rows.data_ptr(),
                     read_rows=None if read_rows is None else read_rows.data_ptr(),
                     read_start=kv.read_start or 0, context=kv.context_len,
                     mask=None if mask is None else mask.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
                     x=out.data_ptr(), threads=_threads(), **shape)
    with _recorded(STACK_EVENT):
        getattr(lib, f"decoder_stack_{_SUFFIX[x.dtype]}")(ctypes.byref(args))
    return out


@functools.cache
def gemv_available(dtype: torch.dtype) -> bool:
    """Whether this CPU runs the kernel for ``dtype`` and it agrees with ``F.linear`` on a probe
    (an odd inner size, so the masked tail is checked too)."""
    if dtype not in _SUFFIX or not set(_CPU_FLAGS[dtype]) <= cpu_flags() or _library() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 75, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(2, 3, 75, generator=gen).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    return bool(torch.allclose(gemv(x, weight, bias).float(), F.linear(x, weight, bias).float(), rtol=tol, atol=tol))


class GemvLinear(nn.Linear):
    """``nn.Linear`` whose products of up to ``MAX_ROWS`` rows run the streaming kernel. It shares
    the weight (and bias) of the linear it replaces: a tied LM head stays tied, nothing is copied."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # Products of more rows go to F.linear (faster there); None sends every product to the
        # kernel, whose rows then never depend on the row count (exact-greedy mode).
        self.max_rows: int | None = MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if (self.max_rows is not None and rows > self.max_rows) or torch.is_grad_enabled() and self.weight.requires_grad:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return gemv_op(x, self.weight, self.bias)
        return gemv(x, self.weight, self.bias)
