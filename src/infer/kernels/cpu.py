"""The CPU kernels as Python calls: every input checked before a pointer is taken.

A decode step of a small model is a stream of weights through a handful of input rows, so tokens/s
is the speed those weights are read at. ``gemv`` runs the streaming dot-product loop of
``cpu_kernels.c`` for up to ``MAX_ROWS`` rows (decode steps, verification passes, draft trees);
``GemvLinear`` sends bigger products to ``F.linear`` (prefill, where oneDNN's GEMM is as fast).
``rms_norm``, ``rope`` and ``silu_mul`` are the small operators between the matmuls as one C call
each, and ``decoder_stack`` is every decoder layer in one call.

The C functions take raw pointers, so each wrapper checks device, dtype, contiguity, shapes and
index ranges first and raises ``ValueError`` naming the problem (plain ``if``s: ``assert`` would
vanish under ``python -O``) instead of letting a wrong input write past a buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import statistics
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.cache.protocol import KVBatch, SequenceRows
from infer.kernels import build
from infer.kernels.quant import QuantKernels, QuantWeight
from infer.kernels.quant import check_weight as check_quant_weight
from infer.phases import PHASES

# Rows above this go to F.linear: beyond a few dozen rows a product is bound by arithmetic, not by
# reading the weight, and oneDNN's blocked GEMM catches up.
MAX_ROWS = 64
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}  # each kernel's C name ends in its dtype's

# The kernels are plain C calls, invisible to torch.profiler: under the profiler each call is
# recorded as one of these events (``infer bench generation --profile`` counts the first with the
# weight matmuls).
PROFILER_EVENT = "infer::cpu_gemv"
FUSED_EVENT = "infer::cpu_fused"  # RMSNorm, RoPE, SwiGLU's activation
STACK_EVENT = "infer::cpu_stack"  # the whole decoder stack in one call (matmuls included)


class StackArgs(ctypes.Structure):
    """``StackArgs`` of cpu_kernels.c: one pass through the whole decoder stack."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("rows", "width", "batch", "hidden", "heads", "kv_heads", "head_dim",
                                              "inter", "layers", "qk_norm")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("tensors", "k_stores", "v_stores", "write_rows", "read_rows")),
        ("read_start", ctypes.c_int64), ("context", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("mask", "cos", "sin", "x")),
        ("threads", ctypes.c_int), ("quant_parts", ctypes.c_void_p), ("quant_index", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in ("norm_offset", "post_norms", "activation")),
        *((name, ctypes.c_void_p) for name in ("local_layers", "local_write_rows", "local_read_rows")),
        ("local_read_start", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("local_mask", "local_cos", "local_sin", "capture")),
        ("final_norm", ctypes.c_void_p), ("final_eps", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("head", "head_bias", "logits")), ("causal", ctypes.c_int64),
        ("capture_stride", ctypes.c_int64)]


class QuantPart(ctypes.Structure):
    """``QuantPart`` of cpu_kernels.c: one quantized matrix of a projection in the stack (the entry
    of ``infer.kernels.quant``'s library for its block type, ``quant_linear_x8_<type>``, its
    blocks, the output columns it computes)."""

    _fields_ = [("linear", ctypes.c_void_p), ("blocks", ctypes.c_void_p), ("offset", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("in_features", ctypes.c_int64)]


# The per-layer tensors of ``decoder_stack``'s table, in the C enum's order.
STACK_TENSORS = ("input_norm", "qkv_weight", "qkv_bias", "q_norm", "k_norm", "o_weight", "o_bias", "post_norm",
                 "gate_up_weight", "gate_up_bias", "down_weight", "down_bias", "post_attention_norm",
                 "post_feedforward_norm")
_C_TENSOR_NAMES = ("ln1", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b", "ln2", "gate_up_w", "gate_up_b",
                   "down_w", "down_b", "post_attn_norm", "post_ff_norm")
# A layer's projections, in the order of the C ``quant_index`` table (and of ``StackTable.quant``).
STACK_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The MLP gates ``StackArgs.activation`` names, in the C enum's order (``BlockSpec.activation``'s names).
STACK_ACTIVATIONS = ("silu", "gelu_tanh")
_PROJECTION_WEIGHTS = (1, 5, 8, 10)  # each projection's weight slot in STACK_TENSORS
MAX_STACK_HEAD_DIM = 256  # the attention keeps a key or value row in 16 registers of 16 floats
MAX_STACK_GROUP = 16  # query heads per KV head the attention takes (cpu_kernels.c's MAX_GROUP)
STACK_ATTN_SEGMENT = 128  # keys of a row's list per attention work item, merged in order (ATTN_SEGMENT)


def expected_layout(dtypes: Sequence[str]) -> str:
    """``infer_kernels_layout()``'s text for the interface mirrored here (see cpu_kernels.c)."""
    fields = " ".join(f"{field[0]}={getattr(StackArgs, field[0]).offset}" for field in StackArgs._fields_)
    tensors = ",".join(f"{name}:{i}" for i, name in enumerate(_C_TENSOR_NAMES))
    part = " ".join(f"part_{field[0]}={getattr(QuantPart, field[0]).offset}" for field in QuantPart._fields_)
    projections = ",".join(f"{name}:{i}" for i, name in enumerate(STACK_PROJECTIONS))
    activations = ",".join(f"{name}:{i}" for i, name in enumerate(STACK_ACTIVATIONS))
    return (f"size={ctypes.sizeof(StackArgs)} {fields} part_size={ctypes.sizeof(QuantPart)} {part} "
            f"projections={projections}/{len(STACK_PROJECTIONS)} "
            f"activations={activations}/{len(STACK_ACTIVATIONS)} tensors={tensors}/{len(_C_TENSOR_NAMES)} "
            f"max_group={MAX_STACK_GROUP} max_head_dim={MAX_STACK_HEAD_DIM} attn_segment={STACK_ATTN_SEGMENT} dtypes={','.join(dtypes)}")


# Set while ``kernel_threads_only`` runs a pass: the thread count the kernels use instead of torch's.
_kernel_threads: list[int | None] = [None]


def _threads() -> int:
    """The threads a kernel call uses: ``kernel_threads_only``'s count inside it, the count torch had
    before ``host_work_single_threaded`` inside that, else torch's."""
    return _kernel_threads[0] or (_wanted[0] if _host[0] is not None else torch.get_num_threads())


class ThreadChooser:
    """How many threads the kernels use for a kind of pass, measured rather than assumed.

    On a machine of its own a pass runs fastest on every core. Where another process keeps a core
    busy, a thread sharing that core is descheduled for whole time slices and every parallel loop
    waits for it at its end: two threads then ran a SmolLM2 decode step at half the speed of one.
    So each kind of pass (its label and row count) keeps a moving average of its time on the count
    it runs, and the time of the last try of the other, runs the faster, and now and then runs the
    other once to notice the machine changing. The first pass of a kind on a count is not
    measured: it pays one-time costs (faulting in the weight pages the loader had handed back), and
    as the only sample it made one thread look faster for hundreds of steps. The wait between tries
    grows while the choice stands, and starts over when the chosen count's time rises by DRIFT
    since the choice was last made or confirmed: a machine that turns busy is noticed within
    passes, not after the hundreds a long wait had grown to on a quiet one. Exactness does not
    depend on it: every output of a kernel is computed the same way whichever thread computes it."""

    EXPLORE = 32  # passes between tries of the other count; doubled while the try confirms the choice
    MAX_EXPLORE = 1024
    WEIGHT = 0.25  # of the newest time in the moving average
    DRIFT = 1.25  # the chosen count's time, over its time when last chosen or confirmed: try the other now

    def __init__(self) -> None:
        self.seconds: dict[tuple[Hashable, int], float] = {}
        self.countdown: dict[Hashable, int] = {}  # passes until the next try of the other count
        self.interval: dict[Hashable, int] = {}
        self.best: dict[Hashable, int] = {}
        self.warmed: set[tuple[Hashable, int]] = set()  # (kind, count)s past their unmeasured first pass
        self.reference: dict[Hashable, float] = {}  # the chosen count's time when last chosen or confirmed

    def pick(self, kind: Hashable, most: int) -> int:
        if most <= 1:
            return 1
        for threads in (most, 1):  # each measured before either is trusted
            if (kind, threads) not in self.seconds:
                return threads
        best = most if self.seconds[(kind, most)] <= self.seconds[(kind, 1)] else 1
        now = self.seconds[(kind, best)]
        if self.best.get(kind) != best:  # a new choice: try the other again soon
            self.best[kind], self.interval[kind] = best, self.EXPLORE
            self.countdown[kind], self.reference[kind] = self.EXPLORE, now
        elif now > self.DRIFT * self.reference[kind]:  # the chosen count slowed: try the other now
            self.interval[kind] = self.EXPLORE // 2  # (doubled below, as after any try)
            self.countdown[kind], self.reference[kind] = 1, now
        elif self.countdown[kind] == self.interval[kind]:  # a try since the last pass confirmed the choice
            self.reference[kind] = now
        self.countdown[kind] -= 1
        if self.countdown[kind] > 0:
            return best
        # A try of the other count; the wait doubles each time the choice stands (a try on a busy
        # machine costs a slow pass: two threads measured several times one's time there).
        self.interval[kind] = min(2 * self.interval[kind], self.MAX_EXPLORE)
        self.countdown[kind] = self.interval[kind]
        return 1 if best == most else most

    def record(self, kind: Hashable, threads: int, seconds: float) -> None:
        key = (kind, threads)
        if key not in self.warmed:  # a first pass: one-time costs, not the count's speed
            self.warmed.add(key)
            return
        previous = self.seconds.get(key)
        if previous is None or threads != self.best.get(kind):
            # A try of the other count replaces its figure: the last one is as old as the last try
            # (hundreds of passes), and blended with it, a count a passing disturbance made slow
            # kept losing its tries long after the machine was quiet again.
            self.seconds[key] = seconds
        else:
            self.seconds[key] = previous + self.WEIGHT * (seconds - previous)

    def settled(self, kind: Hashable, most: int) -> int:
        """The count ``kind``'s passes run on outside their tries of the other: the faster measured
        one, or every thread until both counts are measured."""
        every, one = self.seconds.get((kind, most)), self.seconds.get((kind, 1))
        if every is None or one is None:
            return most
        return most if every <= one else 1

    def preferred(self) -> dict[Hashable, int]:
        """The thread count each kind of pass runs on now (for reports)."""
        kinds = {kind for kind, _ in self.seconds}
        return {kind: min((t for k, t in self.seconds if k == kind), key=lambda t: self.seconds[(kind, t)])
                for kind in kinds}


THREADS = ThreadChooser()


class PairedChooser:
    """Which of two settings that give the same bits runs a kind of pass faster, measured the way the
    project benchmarks a noisy machine: the two take turns pass by pass, and the one with the lower
    median wins. The winner then runs alone for ``WAIT`` passes, a wait that doubles (to
    ``MAX_WAIT``) each time a new comparison confirms it, and starts over when the other wins.

    For a difference of a few percent, which one pass's noise can exceed, this is sounder than
    ``ThreadChooser``'s single tries (those catch a 2x difference at once, where a try of the
    losing count is what is expensive). Here a comparison costs at most half its passes at the
    slower setting's few percent. The first pass of each setting in a comparison is not counted:
    switching may leave the caches or the prefetcher's state to the other's."""

    TURNS = 12  # counted passes of each setting per comparison
    WAIT = 256  # passes on the winner before the next comparison; doubled while it stands
    MAX_WAIT = 4096

    def __init__(self, settings: tuple[Hashable, Hashable]) -> None:
        self.settings = settings
        self.winner: dict[Hashable, Hashable] = {}
        self.wait: dict[Hashable, int] = {}
        self.countdown: dict[Hashable, int] = {}  # passes on the winner before the next comparison
        self.times: dict[Hashable, dict[Hashable, list[float]]] = {}  # a comparison under way: each one's passes
        self.turn: dict[Hashable, int] = {}  # a comparison's passes so far
        self.comparisons: dict[Hashable, int] = {}  # finished, for reports and tests

    def pick(self, kind: Hashable) -> Hashable:
        """The setting ``kind``'s next pass runs with (then ``record`` its time)."""
        if self.countdown.get(kind, 0) > 0:
            self.countdown[kind] -= 1
            return self.winner[kind]
        if kind not in self.times:
            self.times[kind] = {setting: [] for setting in self.settings}
            self.turn[kind] = 0
        return self.settings[self.turn[kind] % 2]

    def record(self, kind: Hashable, setting: Hashable, seconds: float) -> None:
        times = self.times.get(kind)
        if times is None:  # a pass on the winner
            return
        turn = self.turn[kind]
        self.turn[kind] = turn + 1
        if turn >= 2:  # each setting's first pass of the comparison is not counted
            times[setting].append(seconds)
        if min(len(t) for t in times.values()) < self.TURNS:
            return
        first, second = self.settings
        best = first if statistics.median(times[first]) <= statistics.median(times[second]) else second
        wait = 2 * self.wait[kind] if self.winner.get(kind) == best else self.WAIT
        self.winner[kind], self.wait[kind] = best, min(wait, self.MAX_WAIT)
        self.countdown[kind] = self.wait[kind]
        self.comparisons[kind] = self.comparisons.get(kind, 0) + 1
        del self.times[kind], self.turn[kind]


# Whether a 1-row pass's weight streams prefetch in software (``QuantKernels.set_stream_prefetch``):
# which is faster changed on one machine from hour to hour (docs/cpu.md), so it is measured where
# it runs.
STREAMS = PairedChooser((True, False))


# The thread count a pass left torch at (None: none lowered it), and the count asked for before.
_left_at: list[int | None] = [None]
_wanted: list[int] = [0]
# Set while ``host_work_single_threaded`` runs: torch's count to restore at its end (a pass inside
# records there the count it settled on, and leaves torch on one thread).
_host: list[int | None] = [None]


def _asked_for(current: int) -> int:
    """The thread count the program asked for, given torch's ``current`` one: ``current`` unless a
    pass (or host work) lowered torch to it, in which case the count asked for before."""
    if _left_at[0] is None or current != _left_at[0]:  # no pass lowered it, or someone set it since
        _wanted[0] = current
    return _wanted[0]


@contextlib.contextmanager
def kernel_threads_only(kind: Hashable = None, streams: Callable[[bool], object] | None = None) -> Iterator[None]:
    """Run a small pass (a decode step, a verification) with PyTorch's operators on one thread and
    the kernels on torch's threads, or on one where that measured faster for this ``kind`` of pass
    (``ThreadChooser``: a shared machine). PyTorch's operators here work on rows of a few hundred
    elements, where handing work to another thread costs more than it saves. After a pass of a
    ``kind``, torch keeps the kind's settled count until the next one: where one thread won, the
    sampling and the prefill between passes run on one too (two threads lost there alike). A try of
    the other count leaves it alone: a 1B model's 512-token prefill after a one-thread try ran at
    half speed.

    ``streams`` (a 1-row pass on the quantized kernels: their ``set_stream_prefetch``): the pass
    also runs with the weight-stream setting ``STREAMS`` picks for its kind and thread count, and
    is measured for it, except on a try of the other thread count (which keeps the last setting)."""
    current = torch.get_num_threads()
    if _kernel_threads[0] is not None:
        yield
        return
    most = _asked_for(current)
    chosen = THREADS.pick(kind, most) if kind is not None else most
    streaming = None
    if streams is not None and kind is not None and chosen == THREADS.settled(kind, most):
        streaming = STREAMS.pick((kind, chosen))
        streams(bool(streaming))
    _kernel_threads[0] = chosen
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        yield
    finally:
        after = most
        if kind is not None:
            seconds = time.perf_counter() - start
            THREADS.record(kind, chosen, seconds)
            if streaming is not None:
                STREAMS.record((kind, chosen), streaming, seconds)
            after = THREADS.settled(kind, most)
        if _host[0] is not None:  # inside host work: torch stays on one thread until it ends
            _host[0] = after
            after = 1
        torch.set_num_threads(after)
        _left_at[0] = after if after != most else None
        _kernel_threads[0] = None


@contextlib.contextmanager
def host_work_single_threaded() -> Iterator[None]:
    """PyTorch's operators on one thread for host work around passes (a speculative round's drafting
    and rejection sampling over the vocabulary). On two threads such an operator wakes libgomp's
    workers, which then spin for a while on the cores the next pass's kernel threads need: 12% of a
    copy-heavy n-gram run's ``perf`` samples were libgomp's spin loop. Passes inside still choose and
    measure the kernels' count (``kernel_threads_only``), and kernel calls between them (a draft
    head's projections) use the count torch had. At the end torch gets the count the last pass
    settled on."""
    if _host[0] is not None or _kernel_threads[0] is not None:
        yield
        return
    current = torch.get_num_threads()
    most = _asked_for(current)
    _host[0] = current
    torch.set_num_threads(1)
    _left_at[0] = 1 if most != 1 else None
    try:
        yield
    finally:
        restore = _host[0] or current
        _host[0] = None
        torch.set_num_threads(restore)
        _left_at[0] = restore if restore != _wanted[0] else None


_data_ptr = torch.Tensor.data_ptr


def _recorded(event: str) -> contextlib.AbstractContextManager[Any]:
    return torch.profiler.record_function(event) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _check(tensor: torch.Tensor, what: str, dtype: torch.dtype, *, contiguous: bool = True) -> None:
    """ValueError unless ``tensor`` is a CPU tensor of ``dtype`` (and contiguous, unless told not)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what} is on {tensor.device}; the CPU kernels take CPU tensors")
    if tensor.dtype != dtype:
        raise ValueError(f"{what} is {tensor.dtype}, expected {dtype}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


def _check_shape(tensor: torch.Tensor, what: str, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {shape}")


def _check_index(index: torch.Tensor, what: str, low: int, high: int) -> None:
    """ValueError unless every element of the int64 ``index`` lies in [low, high)."""
    _check(index, what, torch.long)
    if index.numel():
        bounds = torch.aminmax(index)  # one pass over the index, not two
        least, most = int(bounds.min), int(bounds.max)
        if least < low or most >= high:
            raise ValueError(f"{what} holds {least}..{most}, outside [{low}, {high})")


class KernelLibrary:
    """One loaded variant of ``cpu_kernels.c``: its functions typed, its interface checked."""

    def __init__(self, variant: build.Variant, lib: ctypes.CDLL) -> None:
        self.variant = variant
        self.lib = lib
        try:
            layout_fn = lib.infer_kernels_layout
        except AttributeError:
            raise build.KernelUnavailable("the library has no infer_kernels_layout (an older build)") from None
        layout_fn.argtypes, layout_fn.restype = [], ctypes.c_char_p
        found = (layout_fn() or b"").decode()
        expected = expected_layout(variant.dtypes)
        if found != expected:
            raise build.KernelUnavailable(f"the C interface differs from the Python mirror: C says {found!r}, "
                                          f"Python expects {expected!r}")
        self.dtypes = tuple(dtype for dtype, suffix in SUFFIX.items() if suffix in variant.dtypes)
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        for suffix in variant.dtypes:
            for name, argtypes in (("gemv", [pointer] * 4 + [size] * 3 + [ctypes.c_int]),
                                   ("rmsnorm", [pointer] * 3 + [size] * 2 + [ctypes.c_float]),
                                   ("rope", [pointer, size, size] + [pointer] * 3 + [size] * 3),
                                   ("silu_mul", [pointer] * 2 + [size] * 2)):
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
            stack = getattr(lib, f"decoder_stack_{suffix}")
            stack.argtypes, stack.restype = [ctypes.POINTER(StackArgs)], ctypes.c_int

    def __repr__(self) -> str:
        return f"KernelLibrary({self.variant.name})"

    def _fn(self, name: str, dtype: torch.dtype) -> Any:
        if dtype not in self.dtypes:
            raise ValueError(f"the {self.variant.name} kernels have no {dtype} version "
                             f"(they take {', '.join(str(d) for d in self.dtypes)})")
        return getattr(self.lib, f"{name}_{SUFFIX[dtype]}")

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` (``x`` any leading dims, ``weight``'s dtype)."""
        fn = self._fn("gemv", weight.dtype)
        _check(weight, "weight", weight.dtype)
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        _check(x, "x", weight.dtype, contiguous=False)
        if x.dim() == 0 or x.shape[-1] != in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}; its last dimension must be the weight's {in_features}")
        if bias is not None:
            _check(bias, "bias", weight.dtype)
            _check_shape(bias, "bias", (out_features,))
        rows = x.reshape(-1, in_features).contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
        if rows.shape[0] and out_features:
            since = PHASES.mark()
            with _recorded(PROFILER_EVENT):
                fn(weight.data_ptr(), rows.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                   rows.shape[0], out_features, in_features, _threads())
            PHASES.add("kernels", since)
        return out.view(*x.shape[:-1], out_features)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of ``x`` (contiguous, ``weight``'s dtype) as ``layers.RMSNorm`` computes it."""
        fn = self._fn("rmsnorm", x.dtype)
        _check(x, "x", x.dtype)
        _check(weight, "weight", x.dtype)
        _check_shape(weight, "weight", (x.shape[-1],))
        out = torch.empty_like(x)
        with _recorded(FUSED_EVENT):
            fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(x.shape[-1], 1), x.shape[-1], eps)
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``layers.apply_rope`` for ``x`` [B, T, heads, head_dim], a view whose heads and head
        elements lie like a contiguous tensor's but whose tokens may be strided (heads sliced out of
        the fused projection); cos/sin [B, T, 1, head_dim] contiguous. Returns a contiguous tensor."""
        fn = self._fn("rope", x.dtype)
        _check(x, "x", x.dtype, contiguous=False)
        if x.dim() != 4 or x.shape[-1] % 2:
            raise ValueError(f"x must be [batch, tokens, heads, head_dim] with an even head_dim, got {tuple(x.shape)}")
        batch, width, heads, dim = x.shape
        if x.stride(3) != 1 or (heads > 1 and x.stride(2) != dim) or (batch > 1 and x.stride(0) != width * x.stride(1)):
            raise ValueError(f"x's heads must lie contiguously within each token (strides {x.stride()})")
        for name, table in (("cos", cos), ("sin", sin)):
            _check(table, name, x.dtype)
            _check_shape(table, name, (batch, width, 1, dim))
        out = torch.empty(batch, width, heads, dim, dtype=x.dtype)
        with _recorded(FUSED_EVENT):
            fn(x.data_ptr(), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
               batch * width, heads, dim)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` [..., 2 * inter] (contiguous; gate first)."""
        fn = self._fn("silu_mul", gate_up.dtype)
        _check(gate_up, "gate_up", gate_up.dtype)
        if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up's last dimension must be even (gate then up), got {tuple(gate_up.shape)}")
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        with _recorded(FUSED_EVENT):
            fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // max(gate_up.shape[-1], 1), inter)
        return out

    def decoder_stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: StackTable,
                      kv: KVBatch, local: tuple[torch.Tensor, torch.Tensor, KVBatch] | None = None,
                      capture: dict[int, torch.Tensor] | None = None, head: StackHead | None = None,
                      logits: torch.Tensor | None = None) -> torch.Tensor:
        """Every decoder layer over ``x`` [B, T, hidden] (contiguous) in one C call: ``table`` holds
        each layer's tensors, ``kv`` says where the new keys and values go and which cached ones
        each token sees. ``local`` (a table with sliding-window layers) is their RoPE tables and
        their view of the cache (its rows and window mask). ``capture`` {layer id: a buffer of x's
        dtype and shape}: the stream entering that layer is copied there during the call (id
        ``layers``: the last layer's output); a buffer's rows may lie apart (a column block of a
        wider buffer, every buffer's rows the same distance apart), so several layers' inputs can
        land side by side in one tensor. Returns the last layer's output (a new tensor);
        with ``head`` (a float32 stack whose norms are Llama's kind), that output after the final norm, and
        every row's logits written to ``logits`` (float32 [rows, vocab], contiguous)."""
        dtype, shape = table.dtype, table.shape
        fn = self._fn("decoder_stack", dtype)
        head_dim, layers = shape["head_dim"], shape["layers"]
        _check(x, "x", dtype)
        if x.dim() != 3 or x.shape[2] != shape["hidden"]:
            raise ValueError(f"x has shape {tuple(x.shape)}, expected [batch, tokens, {shape['hidden']}]")
        capture_table = _capture_table(capture, layers, x)
        if (local is None) != (table.local_layers is None):
            raise ValueError("a stack with sliding-window layers needs their RoPE tables and cache view (local), "
                             "and one without takes none")
        batch, width, _ = x.shape
        tables = [("cos", cos), ("sin", sin)] + ([] if local is None else [("local cos", local[0]),
                                                                          ("local sin", local[1])])
        for name, rope_table in tables:
            _check(rope_table, name, dtype)
            _check_shape(rope_table, name, (batch, width, 1, head_dim))
        storage, local_storage = _checked_stores(table, kv.k_layers, kv.v_layers)
        if local is not None and table.local_layers is not None and bool(table.local_layers.all()):
            # Every layer slides (Mistral): no layer reads or writes the shared rows, which a pool may
            # not even hold for the pass's positions; the local view stands for both.
            kv, storage = local[2], local_storage
        write_rows, read_rows, mask = _cache_view(kv, batch, width, storage)
        local_view: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
        local_kv = None
        if local is not None:
            local_kv = local[2]
            if local_kv.context_len != kv.context_len:
                raise ValueError(f"the local view's context is {local_kv.context_len}, the pass's {kv.context_len}")
            local_view = _cache_view(local_kv, batch, width, local_storage)
        out = x.clone()
        args = _stack_args(table, out, batch, width, cos.data_ptr(), sin.data_ptr(), write_rows.data_ptr(),
                           None if read_rows is None else read_rows.data_ptr(), kv.read_start or 0, kv.context_len)
        args.mask = None if mask is None else mask.data_ptr()
        if capture_table is not None:
            args.capture, args.capture_stride = ctypes.addressof(capture_table[0]), capture_table[1]
        if local is not None and local_view is not None and local_kv is not None and table.local_layers is not None:
            args.local_layers = table.local_layers.data_ptr()
            args.local_write_rows = local_view[0].data_ptr()
            args.local_read_rows = None if local_view[1] is None else local_view[1].data_ptr()
            args.local_read_start = local_kv.read_start or 0
            args.local_mask = None if local_view[2] is None else local_view[2].data_ptr()
            args.local_cos, args.local_sin = local[0].data_ptr(), local[1].data_ptr()
        self._run_stack(fn, args, table, head, logits)
        return out

    def sequence_stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: StackTable,
                       rows: SequenceRows, head: StackHead | None = None, logits: torch.Tensor | None = None,
                       capture: dict[int, torch.Tensor] | None = None) -> None:
        """``decoder_stack`` over one sequence's chain of new tokens, ``x`` [width, hidden] in place
        (contiguous): cos and sin [width, head_dim] (contiguous), the cache as ``rows`` gives it (the
        pool's own rows, trusted as ``build_kv_batch``'s are not: no index tensor is made or scanned
        per pass; the stores are checked once per pool), the keys each token sees those of a causal
        mask (the C call's ``causal``). The same C call with the same keys as ``decoder_stack`` over
        the same pass: the same bits, for a little Python instead of dozens of operators. ``capture``
        as ``decoder_stack``'s."""
        dtype, shape = table.dtype, table.shape
        fn = self._fn("decoder_stack", dtype)
        width = x.shape[0]
        if table.local_layers is not None:
            raise ValueError("a stack with sliding-window layers runs its passes through decoder_stack")
        for name, tensor in (("x", x), ("cos", cos), ("sin", sin)):
            _check(tensor, name, dtype)
            _check_shape(tensor, name, (width, shape["hidden"] if name == "x" else shape["head_dim"]))
        storage, _ = _checked_stores(table, rows.k_layers, rows.v_layers)
        if not 0 < width <= rows.context or rows.context - width != rows.start:
            raise ValueError(f"{width} new tokens at {rows.start} do not end the context of {rows.context}")
        if rows.read_start is not None:
            if not 0 <= rows.read_start <= storage - rows.context:
                raise ValueError(f"read_start={rows.read_start} with context {rows.context} does not fit the "
                                 f"{storage} cache rows")
            write = (ctypes.c_int64 * width)(*range(rows.read_start + rows.start, rows.read_start + rows.context))
            write_rows, read_rows = ctypes.addressof(write), None
        else:
            if rows.rows is None or rows.rows.dtype != torch.long or rows.rows.numel() < rows.context:
                raise ValueError(f"the sequence's rows must be int64 covering its {rows.context} positions")
            read_rows = rows.rows.data_ptr()
            write_rows = read_rows + 8 * rows.start
        capture_table = _capture_table(capture, shape["layers"], x)
        args = _stack_args(table, x, 1, width, cos.data_ptr(), sin.data_ptr(), write_rows, read_rows,
                           rows.read_start or 0, rows.context)
        args.causal = 1
        if capture_table is not None:
            args.capture, args.capture_stride = ctypes.addressof(capture_table[0]), capture_table[1]
        self._run_stack(fn, args, table, head, logits)

    @staticmethod
    def _run_stack(fn: Any, args: StackArgs, table: StackTable, head: StackHead | None,
                   logits: torch.Tensor | None) -> None:
        """The C stack call of ``args`` (ending with ``head``'s logits in ``logits`` where given)."""
        if head is not None:
            if table.dtype != torch.float32 or table.norm_offset or head.hidden != table.shape["hidden"]:
                raise ValueError("an LM head in the stack's call takes a float32 stack of its width with "
                                 "Llama's norms (the final norm's kind)")
            if logits is None:
                raise ValueError("an LM head in the stack's call needs its logits buffer")
            _check(logits, "logits", torch.float32)
            _check_shape(logits, "logits", (args.rows, head.vocab))
            part = head.part()
            args.final_norm, args.final_eps, args.head = head.norm.data_ptr(), head.eps, ctypes.addressof(part)
            args.head_bias = None if head.bias is None else head.bias.data_ptr()
            args.logits = logits.data_ptr()
        since = PHASES.mark()
        with _recorded(STACK_EVENT):
            status = fn(ctypes.byref(args))
        PHASES.add("kernels", since)
        if status == -2:  # StackTable checked every part: a mismatch between it and the C code
            raise RuntimeError("the C decoder stack refused a quantized projection's descriptor (or the block's form)")
        if status != 0:
            raise MemoryError("the C decoder stack could not allocate its scratch memory")


def _capture_table(capture: dict[int, torch.Tensor] | None, layers: int,
                   x: torch.Tensor) -> tuple[ctypes.Array[ctypes.c_int64], int] | None:
    """The C call's table of capture buffers (``decoder_stack``'s ``capture``): an address per layer
    id 0 .. ``layers`` (0 where none is wanted), and the distance in elements between a buffer's
    rows (``StackArgs.capture_stride``), each buffer checked against ``x``; None without any."""
    if not capture:
        return None
    table = (ctypes.c_int64 * (layers + 1))()
    hidden = x.shape[-1]
    stride = 0
    for index, buffer in capture.items():
        if not 0 <= index <= layers:
            raise ValueError(f"capture layer {index} is outside 0..{layers}")
        what = f"capture buffer {index}"
        _check(buffer, what, x.dtype, contiguous=False)
        if buffer.numel() != x.numel() or buffer.shape[-1] != hidden:
            raise ValueError(f"{what} has shape {tuple(buffer.shape)}, x {tuple(x.shape)}")
        rows = _row_stride(buffer)
        if rows is None or (stride and rows and rows != stride):
            raise ValueError(f"{what}'s rows must each be contiguous and lie evenly spaced, as far apart as "
                             "the other buffers' rows")
        stride = stride or rows
    for index, buffer in capture.items():
        table[index] = buffer.data_ptr()
    return table, stride or hidden


def _row_stride(t: torch.Tensor) -> int | None:
    """The distance in elements between consecutive rows of ``t`` (rows: its last dimension) where
    each row is contiguous and the rows lie evenly spaced without overlapping (a column block of a
    wider row-major tensor), 0 for a single row, else None."""
    if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    rows = t.numel() // max(t.shape[-1], 1)
    if rows <= 1:
        return 0
    stride, size = None, 1
    for dim in range(t.dim() - 2, -1, -1):  # each dimension steps over the rows inside it
        if t.shape[dim] == 1:
            continue
        if stride is None:
            stride = t.stride(dim)
        elif t.stride(dim) != stride * size:
            return None
        size *= t.shape[dim]
    return stride if stride is not None and stride >= t.shape[-1] else None


def _stack_args(table: StackTable, x: torch.Tensor, batch: int, width: int, cos: int, sin: int, write_rows: int,
                read_rows: int | None, read_start: int, context: int) -> StackArgs:
    """``StackArgs`` of a pass over ``x`` (written in place) through ``table``'s stack (stores from
    ``_checked_stores``); the rest given as addresses."""
    shape = table.shape
    k_stores, v_stores = table.store_addresses
    return StackArgs(rows=batch * width, width=width, batch=batch, hidden=shape["hidden"], heads=shape["heads"],
                     kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], inter=shape["inter"],
                     layers=shape["layers"], qk_norm=int(table.qk_norm), eps=table.eps, scale=table.scale,
                     tensors=table.addresses().data_ptr(), k_stores=k_stores.data_ptr(), v_stores=v_stores.data_ptr(),
                     write_rows=write_rows, read_rows=read_rows, read_start=read_start, context=context, cos=cos,
                     sin=sin, x=x.data_ptr(), threads=_threads(), quant_parts=table.quant_parts_address or None,
                     quant_index=table.quant_index_address or None, norm_offset=int(table.norm_offset),
                     post_norms=int(table.post_norms), activation=STACK_ACTIVATIONS.index(table.activation))


def _checked_stores(table: StackTable, k_layers: Sequence[torch.Tensor],
                    v_layers: Sequence[torch.Tensor]) -> tuple[int, int]:
    """The rows of the stores the main and the sliding-window layers reach (a pool may give those
    layers stores of their own size, PagedKVCachePool: each view's rows are checked against its
    own), every store checked and ``table.store_addresses`` made once per pool, not per pass (a
    pool keeps its lists of stores and never replaces one in them: lists seen last time, holding the
    same first stores, are not looked at again; weak references, so a pool dropped is freed)."""
    seen = table.checked_lists
    if (seen is not None and seen[0] == id(k_layers) and seen[1] == id(v_layers) and len(k_layers) == seen[4]
            and k_layers and seen[2]() is k_layers[0] and seen[3]() is v_layers[0]):
        return seen[5], seen[6]
    shape = table.shape
    layers = shape["layers"]
    if len(k_layers) != layers or len(v_layers) != layers:
        raise ValueError(f"the cache has {len(k_layers)} layers, the model {layers}")
    flags = [False] * layers if table.local_layers is None else [bool(f) for f in table.local_layers]
    rows_of = [t.shape[0] if t.dim() else 0 for t in k_layers]
    storage = min((r for r, f in zip(rows_of, flags, strict=True) if not f), default=0)
    local_storage = min((r for r, f in zip(rows_of, flags, strict=True) if f), default=storage)
    storage = storage if not all(flags) else local_storage  # (every layer local: the main view unused)
    k_pointers, v_pointers = list(map(_data_ptr, k_layers)), list(map(_data_ptr, v_layers))
    signature = (k_pointers, v_pointers, k_layers[0].dtype, rows_of)
    if signature != table.checked_cache:
        for name, stores in (("key", k_layers), ("value", v_layers)):
            for index, store in enumerate(stores):
                _check(store, f"layer {index}'s {name} cache", table.dtype)
                _check_shape(store, f"layer {index}'s {name} cache", (rows_of[index], shape["kv_heads"],
                                                                     shape["head_dim"]))
        table.checked_cache = signature
        table.store_addresses = (torch.tensor(k_pointers, dtype=torch.long), torch.tensor(v_pointers, dtype=torch.long))
    table.checked_lists = (id(k_layers), id(v_layers), weakref.ref(k_layers[0]), weakref.ref(v_layers[0]),
                           len(k_layers), storage, local_storage)
    return storage, local_storage


def _cache_view(kv: KVBatch, batch: int, width: int,
                storage: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``kv``'s rows for the C stack, checked: each token's write row (-1: padding), the context's
    read rows (None: ``read_start`` onward) and the mask (None: every key visible)."""
    rows, context = batch * width, kv.context_len
    valid = rows if kv.token_valid is None else int(kv.token_valid.sum())
    _check_index(kv.write_index, "write_index", 0, storage)
    _check_shape(kv.write_index, "write_index", (valid,))
    write_rows = kv.write_index
    if kv.token_valid is not None:  # padding tokens write nothing
        _check(kv.token_valid, "token_valid", torch.bool)
        _check_shape(kv.token_valid, "token_valid", (batch, width))
        write_rows = torch.full((rows,), -1, dtype=torch.long)
        write_rows[kv.token_valid.flatten()] = kv.write_index
    read_rows = None
    if kv.read_index is not None:
        read_rows = kv.read_index.contiguous()
        _check_index(read_rows, "read_index", 0, storage)
        _check_shape(read_rows, "read_index", (batch, context))
    elif kv.read_start is None or batch != 1 or not 0 <= kv.read_start <= storage - context:
        raise ValueError(f"read_start={kv.read_start} with context {context}, batch {batch} does not fit the "
                         f"{storage} cache rows (a contiguous context needs one sequence)")
    mask = None
    if kv.mask is not None:
        mask = kv.mask.contiguous()
        _check(mask, "mask", torch.bool)
        if mask.numel() != rows * context:
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected [{batch}, 1, {width}, {context}]")
    return write_rows, read_rows, mask


@dataclass(frozen=True)
class QuantProjection:
    """A projection of the stack on the quantized kernels: ``weights`` (``QuantKernels.pack``'s) are
    its matrices, their outputs side by side (a fused q/k/v of two block types is two)."""

    kernels: QuantKernels
    weights: tuple[QuantWeight, ...]


def _quant_part(kernels: QuantKernels, weight: QuantWeight, offset: int) -> QuantPart:
    """``weight``'s ``QuantPart``: its kernel entry and blocks, computing outputs ``offset`` on."""
    return QuantPart(linear=kernels.linear_entry(weight), blocks=weight.data.data_ptr(), offset=offset,
                     rows=weight.out_features, in_features=weight.in_features)


class StackHead:
    """The final RMSNorm and a one-matrix quantized LM head that a float32 stack's call can end with
    (``decoder_stack``'s ``head``): a decode step's or a verification's logits come out of the same C
    call, by the same kernels as the norm's and the head's own calls (``KernelLibrary.rms_norm``,
    ``QuantKernels.linear``), so with the same bits. Like ``StackTable``, it holds the tensors and
    checks them again whenever an address changed."""

    def __init__(self, norm: torch.Tensor, eps: float, projection: QuantProjection, bias: torch.Tensor | None) -> None:
        if len(projection.weights) != 1:
            raise ValueError(f"the stack's LM head is one quantized matrix, got {len(projection.weights)}")
        self.norm, self.eps, self.projection, self.bias = norm, eps, projection, bias
        weight = projection.weights[0]
        self.vocab, self.hidden = weight.out_features, weight.in_features
        self._part: tuple[tuple[int, ...], QuantPart] | None = None
        self.part()  # checks every tensor now

    def part(self) -> QuantPart:
        """The head's ``QuantPart`` for the C call, the tensors checked where an address changed."""
        weight = self.projection.weights[0]
        key = (weight.data.data_ptr(), self.norm.data_ptr(), 0 if self.bias is None else self.bias.data_ptr())
        if self._part is None or self._part[0] != key:
            check_quant_weight(weight)
            _check(self.norm, "the final norm's weight", torch.float32)
            _check_shape(self.norm, "the final norm's weight", (self.hidden,))
            if self.bias is not None:
                _check(self.bias, "the LM head's bias", torch.float32)
                _check_shape(self.bias, "the LM head's bias", (self.vocab,))
            self._part = (key, _quant_part(self.projection.kernels, weight, 0))
        return self._part[1]


class StackTable:
    """The per-layer tensors of a decoder stack and their addresses for the C call.

    It holds the Parameters (modules), not their storage: ``model.to(...)`` or a dtype round trip
    gives a Parameter new storage in place, so the address table is rebuilt, after checking every
    tensor again, whenever an address changed (a list of ``data_ptr``s per call: microseconds).

    ``quant`` (float32 stacks only) gives, per layer and projection (``STACK_PROJECTIONS``' order),
    a ``QuantProjection`` where that projection is quantized (its weight slot in ``tensors`` is then
    None; its bias, float32, stays there) or None where it is a float weight."""

    def __init__(self, tensors: list[torch.Tensor | None], shape: dict[str, int], eps: float, qk_norm: bool,
                 quant: Sequence[QuantProjection | None] | None = None, *, norm_offset: bool = False,
                 post_norms: bool = False, activation: str = "silu", local_layers: Sequence[bool] | None = None,
                 scale: float | None = None) -> None:
        if len(tensors) != shape["layers"] * len(STACK_TENSORS):
            raise ValueError(f"{len(tensors)} tensors for {shape['layers']} layers of {len(STACK_TENSORS)}")
        if quant is not None and len(quant) != shape["layers"] * len(STACK_PROJECTIONS):
            raise ValueError(f"{len(quant)} quantized projections for {shape['layers']} layers of "
                             f"{len(STACK_PROJECTIONS)}")
        for index, projection in enumerate(quant or ()):
            name = f"layer {index // len(STACK_PROJECTIONS)}'s quantized {STACK_PROJECTIONS[index % len(STACK_PROJECTIONS)]}"
            if projection is None:
                continue
            if not isinstance(projection, QuantProjection) or not isinstance(projection.kernels, QuantKernels):
                raise ValueError(f"{name} must be a QuantProjection on the quantized kernels, got {projection!r}")
            for weight in projection.weights:
                check_quant_weight(weight)
        heads, kv_heads = shape["heads"], shape["kv_heads"]
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
        if heads // kv_heads > MAX_STACK_GROUP or shape["head_dim"] > MAX_STACK_HEAD_DIM:
            raise ValueError(f"the C stack takes at most {MAX_STACK_GROUP} query heads per KV head and head_dim "
                             f"{MAX_STACK_HEAD_DIM}, got {heads // kv_heads} and {shape['head_dim']}")
        first = tensors[0]
        if first is None:
            raise ValueError("the stack needs each layer's input norm")
        self.tensors, self.shape, self.eps, self.qk_norm = tensors, shape, eps, qk_norm
        # The block's form where it is not Llama's (models.block.BlockSpec's fields of those names:
        # every norm scaling by 1 + weight, norms on the attention's and the MLP's outputs, the MLP's
        # gate), the sliding-window layers (their own RoPE table and cache view) and the attention's
        # score scale (default 1/sqrt(head_dim)).
        if activation not in STACK_ACTIVATIONS:
            raise ValueError(f"the C stack gates with {', '.join(STACK_ACTIVATIONS)}, not {activation!r}")
        self.norm_offset, self.post_norms, self.activation = norm_offset, post_norms, activation
        if local_layers is not None and len(local_layers) != shape["layers"]:
            raise ValueError(f"{len(local_layers)} window flags for {shape['layers']} layers")
        self.local_layers = (None if local_layers is None or not any(local_layers)
                             else torch.tensor([bool(f) for f in local_layers], dtype=torch.uint8))
        self.scale = float(shape["head_dim"] ** -0.5 if scale is None else scale)
        self.quant = None if quant is None or all(q is None for q in quant) else list(quant)
        self.dtype = first.dtype
        self._pointers: list[int] = []
        self._watched: tuple[tuple[object, object] | None, list[torch.Tensor]] = (None, [])
        self._table = torch.empty(0, dtype=torch.long)
        # The quantized parts for the C call (QuantPart array, [layers, projections, 2] index), and
        # their addresses (0 where the stack has no quantized projection).
        self._parts: ctypes.Array[QuantPart] | None = None
        self._index = torch.empty(0, dtype=torch.long)
        self.quant_parts_address = self.quant_index_address = 0
        # The KV stores last checked (their addresses, dtype and shape): a pool is checked once.
        self.checked_cache: tuple[object, ...] = ()
        # the lists of stores last checked (a pool's own) and their rows (_checked_stores)
        self.checked_lists: tuple[int, int, weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int, int,
                                  int] | None = None
        self.store_addresses = (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))  # their data_ptrs

    def _shapes(self) -> list[tuple[int, ...] | None]:
        s = self.shape
        hidden, hd, inter = s["hidden"], s["head_dim"], s["inter"]
        qkv = (s["heads"] + 2 * s["kv_heads"]) * hd
        norm = (hd,) if self.qk_norm else None
        post = (hidden,) if self.post_norms else None
        return [(hidden,), (qkv, hidden), (qkv,), norm, norm, (hidden, s["heads"] * hd), (hidden,), (hidden,),
                (2 * inter, hidden), (2 * inter,), (hidden, inter), (hidden,), post, post]

    def watched(self) -> list[torch.Tensor]:
        """The tensors whose addresses ``addresses`` compares on every pass: each tensor of the table
        and each quantized part's blocks (listed again where ``tensors`` or ``quant`` was replaced)."""
        source, watched = self._watched
        if source is None or source[0] is not self.tensors or source[1] is not self.quant:
            watched = [t for t in self.tensors if t is not None]
            watched += [w.data for q in self.quant or () if q is not None for w in q.weights]
            self._watched = ((self.tensors, self.quant), watched)
        return watched

    def addresses(self) -> torch.Tensor:
        """The tensor table's addresses (and ``quant_parts_address``/``quant_index_address``), every
        tensor and quantized part checked again where an address changed."""
        pointers = list(map(_data_ptr, self.watched()))
        if pointers != self._pointers:
            self._validate()
            self._table = torch.tensor([0 if t is None else t.data_ptr() for t in self.tensors], dtype=torch.long)
            self._build_parts()
            self._pointers = pointers
        return self._table

    def _build_parts(self) -> None:
        if self.quant is None:
            self._parts, self._index = None, torch.empty(0, dtype=torch.long)
            self.quant_parts_address = self.quant_index_address = 0
            return
        parts: list[QuantPart] = []
        index: list[int] = []
        for projection in self.quant:
            if projection is None:
                index += [len(parts), 0]
                continue
            index += [len(parts), len(projection.weights)]
            offset = 0
            for weight in projection.weights:
                parts.append(_quant_part(projection.kernels, weight, offset))
                offset += weight.out_features
        self._parts = (QuantPart * max(len(parts), 1))(*parts)
        self._index = torch.tensor(index, dtype=torch.long)
        self.quant_parts_address = ctypes.addressof(self._parts)
        self.quant_index_address = self._index.data_ptr()

    def _validate(self) -> None:
        shapes = self._shapes()
        for index, tensor in enumerate(self.tensors):
            layer, slot = divmod(index, len(STACK_TENSORS))
            name = f"layer {layer}'s {STACK_TENSORS[slot]}"
            expected = shapes[slot]
            projection = None
            if slot in _PROJECTION_WEIGHTS and self.quant is not None:
                projection = self.quant[layer * len(STACK_PROJECTIONS) + _PROJECTION_WEIGHTS.index(slot)]
            if projection is not None and expected is not None:  # (a projection's shape is always known)
                self._validate_quantized(projection, f"layer {layer}'s quantized {STACK_TENSORS[slot]}", expected)
                if tensor is not None:
                    raise ValueError(f"{name} is given beside its quantized matrices")
                continue
            required = (slot in (0, 1, 5, 7, 8, 10) or (self.qk_norm and slot in (3, 4))
                        or (self.post_norms and slot in (12, 13)))
            if tensor is None:
                if required:
                    raise ValueError(f"{name} is missing")
                continue
            if expected is None:
                raise ValueError(f"{name} is given but this stack has no such tensor")
            _check(tensor, name, self.dtype)
            _check_shape(tensor, name, expected)

    def _validate_quantized(self, projection: QuantProjection, name: str, shape: tuple[int, ...]) -> None:
        """ValueError unless ``projection``'s matrices make a float32 projection of ``shape`` [out, in]."""
        if self.dtype != torch.float32:
            raise ValueError(f"{name}: quantized projections take float32 activations, the stack is {self.dtype}")
        if not projection.weights:
            raise ValueError(f"{name} has no matrices")
        out_features, in_features = shape
        for weight in projection.weights:
            check_quant_weight(weight)
            if weight.in_features != in_features:
                raise ValueError(f"{name} has a matrix of {weight.in_features} inputs, the projection takes {in_features}")
        rows = sum(w.out_features for w in projection.weights)
        if rows != out_features:
            raise ValueError(f"{name}'s matrices have {rows} outputs together, the projection {out_features}")


def probe_gemv(library: KernelLibrary, dtype: torch.dtype) -> str | None:
    """None if ``library``'s product agrees with ``F.linear`` on small cases, else what differed:
    an odd inner size (the masked tail), a partial block of weight rows, with and without a bias,
    and every row count of an input block."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(38, 75, generator=gen).to(dtype)
    bias = torch.randn(38, generator=gen).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, 75, generator=gen).to(dtype)
        for b in (bias, None):
            ours, ref = library.gemv(x, weight, b).float(), F.linear(x, weight, b).float()
            if not torch.allclose(ours, ref, rtol=tol, atol=tol):
                return (f"the {dtype} product differs from F.linear on a {rows}-row probe "
                        f"({'with' if b is not None else 'without'} bias; max error "
                        f"{(ours - ref).abs().max().item():.3g})")
    return None


class GemvLinear(nn.Linear):
    """``nn.Linear`` whose products of up to ``MAX_ROWS`` rows run the streaming kernel. It shares
    the weight (and bias) of the linear it replaces: a tied LM head stays tied, nothing is copied."""

    def __init__(self, linear: nn.Linear, library: KernelLibrary) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.library = library
        # Products of more rows go to F.linear (faster there); None sends every product to the
        # kernel, whose rows then never depend on the row count (exact-greedy mode).
        self.max_rows: int | None = MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if ((self.max_rows is not None and rows > self.max_rows) or (torch.is_grad_enabled() and self.weight.requires_grad)
                or x.device.type != "cpu" or self.weight.dtype not in self.library.dtypes):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return gemv_op(x, self.weight, self.bias)
        return self.library.gemv(x, self.weight, self.bias)


@functools.cache
def _library_for_op(dtype: torch.dtype) -> KernelLibrary:
    from infer.kernels import library_for

    library = library_for(dtype)
    if library is None:
        raise ValueError(f"no CPU kernel for {dtype} here")
    return library


@torch.library.custom_op("infer::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel as an operator torch.compile keeps whole (it cannot trace into a C call)."""
    return _library_for_op(weight.dtype).gemv(x, weight, bias)


@gemv_op.register_fake
def _gemv_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
