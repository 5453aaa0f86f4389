"""Matrix-vector products on GGUF-quantized weights, without expanding them to float.

``pack`` makes a weight kernel-ready once, at load: the file's blocks repacked into the x8 layout
(8 rows interleaved per group, a copy; see quant_x8.h), the one layout the kernels read.
``linear`` computes ``x @ W^T`` as ggml does: each activation row is quantized to int8 per 32
elements (scale ``max|x| / 127``, round to nearest even), each 32-element chunk of a weight row
meets it in an integer dot product, and the products times the blocks' float scales (and the min
terms of Q4_1, Q4_K, Q5_K) are summed in float32. One C library per ISA (``build.QUANT_VARIANTS``: AVX-512 VNNI,
AVX2, ARM NEON with dot products, portable C), the best this CPU runs chosen at run time.

Exactness: an output row depends only on its activation row and the weight, bit for bit, whatever
the number of rows in the call and the thread count, so a verification pass reproduces a decode
step. Every variant also does the same float operations in the same order (one fused multiply-add
per block, see quant_x8.h), so its results are the same bits on every variant and equal
``reference_linear_x8``'s (numpy). ``reference_linear`` is the same math summed in float64 (the
tests' independent yardstick, within float32 rounding).

Every entry point checks devices, dtypes, contiguity, shapes and index ranges and raises
``ValueError`` naming the problem before any pointer reaches C.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from infer.kernels import build
from infer.kernels.build import KernelUnavailable, Variant
from infer.memory import WEIGHTS
from infer.phases import PHASES

ACTIVATION_BLOCK = 32  # elements per int8 activation block (and per weight chunk)


@dataclass(frozen=True)
class QuantType:
    """A GGUF block type: its name, ggml's type id, elements and bytes per block in the file, and
    bytes per x8 block (8 rows' blocks of the same columns, repacked: quant_kernels.c's X8_TYPES)."""

    name: str
    ggml_type_id: int
    block_elems: int
    block_bytes: int
    x8_block_bytes: int

    @property
    def suffix(self) -> str:  # the C functions' suffix
        return self.name.lower()


QUANT_TYPES: dict[str, QuantType] = {t.name: t for t in (
    QuantType("Q8_0", 8, 32, 34, 272),
    QuantType("Q4_0", 2, 32, 18, 144),
    QuantType("Q4_1", 3, 32, 20, 160),
    QuantType("Q5_0", 6, 32, 22, 176),
    QuantType("Q4_K", 12, 256, 144, 1152),
    QuantType("Q5_K", 13, 256, 176, 1408),
    QuantType("Q6_K", 14, 256, 210, 1680),
)}
X8_ROWS = 8  # weight rows per x8 group
# The variants whose calls of several rows run on matrix tiles (quant_tiles.h; from how many rows:
# QuantKernels.set_tile_min_rows):
# AMX's, ARM I8MM's (the tile primitives on SMMLA), and the C emulation of them that runs the same
# tile code anywhere (the tests' way to check the tile path where there is no AMX). The emulated
# ones are never the default, only forced by name.
EMULATED = ("avx512-amx-emu", "portable-amx-emu")
TILE_VARIANTS = ("avx512-amx", "neon-i8mm", *EMULATED)
TILE_TYPES = tuple(QUANT_TYPES)  # every type: the K types one tile product per 32-value chunk (Q6_K: per half)


@dataclass(frozen=True)
class QuantWeight:
    """A weight ready for the kernels (``QuantKernels.pack`` makes it): ``data`` is uint8
    [ceil(out_features / 8), in_features / block_elems * x8_block_bytes], the x8 layout: groups of 8
    weight rows interleaved, stored in runs of 4 groups interleaved block by block (quant_x8.h; the
    last group padded with zeros)."""

    qtype: str
    out_features: int
    in_features: int
    data: torch.Tensor


def quant_type(qtype: str) -> QuantType:
    """The ``QuantType`` named ``qtype`` (any case); ValueError naming the ones there are."""
    found = QUANT_TYPES.get(qtype.upper()) if isinstance(qtype, str) else None
    if found is None:
        raise ValueError(f"unsupported quantization type {qtype!r}: the kernels take {', '.join(QUANT_TYPES)}")
    return found


def _check_raw(raw: torch.Tensor, qt: QuantType, in_features: int, what: str) -> None:
    if not isinstance(raw, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(raw).__name__}")
    if raw.device.type != "cpu":
        raise ValueError(f"{what} must be on the CPU, got {raw.device}")
    if raw.dtype != torch.uint8:
        raise ValueError(f"{what} must be uint8 (the file's {qt.name} blocks), got {raw.dtype}")
    if raw.dim() != 2:
        raise ValueError(f"{what} must be 2-D [out_features, bytes per row], got shape {tuple(raw.shape)}")
    if not isinstance(in_features, int) or isinstance(in_features, bool) or in_features <= 0:
        raise ValueError(f"in_features must be a positive int, got {in_features!r}")
    if in_features % qt.block_elems:
        raise ValueError(f"in_features {in_features} is not a multiple of {qt.name}'s block of {qt.block_elems}")
    row_bytes = in_features // qt.block_elems * qt.block_bytes
    if raw.shape[1] != row_bytes:
        raise ValueError(f"{what} has {raw.shape[1]} bytes per row; {in_features} {qt.name} elements take "
                         f"{row_bytes}")
    if raw.shape[0] == 0:
        raise ValueError(f"{what} has no rows")
    if not raw.is_contiguous():
        raise ValueError(f"{what} must be contiguous (the repacking reads the blocks in place)")


def check_weight(weight: QuantWeight) -> QuantType:
    """The weight's ``QuantType``; ValueError unless it is a well-formed ``QuantWeight``."""
    if not isinstance(weight, QuantWeight):
        raise ValueError(f"weight must be a QuantWeight (from QuantKernels.pack), got {type(weight).__name__}")
    qt = quant_type(weight.qtype)
    if not isinstance(weight.out_features, int) or isinstance(weight.out_features, bool) or weight.out_features <= 0:
        raise ValueError(f"out_features must be a positive int, got {weight.out_features!r}")
    groups = -(-weight.out_features // X8_ROWS)
    if not isinstance(weight.in_features, int) or isinstance(weight.in_features, bool) or weight.in_features <= 0 \
            or weight.in_features % qt.block_elems:
        raise ValueError(f"in_features {weight.in_features!r} is not a positive multiple of {qt.name}'s block "
                         f"of {qt.block_elems}")
    shape = (groups, weight.in_features // qt.block_elems * qt.x8_block_bytes)
    data = weight.data
    if not isinstance(data, torch.Tensor) or data.device.type != "cpu" or data.dtype != torch.uint8 \
            or tuple(data.shape) != shape or not data.is_contiguous():
        raise ValueError(f"weight.data of an x8 {qt.name} weight of {weight.out_features} x {weight.in_features} "
                         f"must be a contiguous uint8 CPU tensor of shape {shape}, got "
                         f"{getattr(data, 'dtype', type(data).__name__)} {tuple(getattr(data, 'shape', ()))}")
    return qt


class QuantKernels:
    """One loaded variant of ``quant_kernels.c``: its functions typed, its interface checked."""

    def __init__(self, variant: Variant, lib: ctypes.CDLL) -> None:
        self.variant = variant
        self.lib = lib
        try:
            layout_fn = lib.infer_quant_layout
        except AttributeError:
            raise KernelUnavailable("the library has no infer_quant_layout (not quant_kernels.c)") from None
        layout_fn.argtypes, layout_fn.restype = [], ctypes.c_char_p
        found = (layout_fn() or b"").decode()
        if found != expected_layout(variant.name):
            raise KernelUnavailable(f"the C interface differs from the Python mirror: C says {found!r}, "
                                    f"Python expects {expected_layout(variant.name)!r}")
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        for qt in QUANT_TYPES.values():
            linear = getattr(lib, f"quant_linear_x8_{qt.suffix}")
            linear.argtypes, linear.restype = [pointer, size, size, pointer, size, pointer, pointer, ctypes.c_int], ctypes.c_int
            rows = getattr(lib, f"quant_dequantize_rows_x8_{qt.suffix}")
            rows.argtypes, rows.restype = [pointer, size, size, pointer, size, pointer], None
            repack = getattr(lib, f"quant_repack_x8_{qt.suffix}")
            repack.argtypes, repack.restype = [pointer, size, size, pointer], None
        lib.infer_quant_set_stream_prefetch.argtypes = [ctypes.c_int]
        lib.infer_quant_set_stream_prefetch.restype = ctypes.c_int
        self.tiles: str | None = None  # "amx", "smmla" or "emu": how this library's tile primitives run
        if variant.name in TILE_VARIANTS:
            lib.infer_quant_tiles.argtypes, lib.infer_quant_tiles.restype = [], ctypes.c_char_p
            lib.infer_quant_tile_permission.argtypes, lib.infer_quant_tile_permission.restype = [], ctypes.c_int
            lib.infer_quant_tile_products.argtypes, lib.infer_quant_tile_products.restype = [], ctypes.c_int64
            lib.infer_quant_tile_selftest.argtypes = [pointer, ctypes.c_int, ctypes.c_int, size, pointer, ctypes.c_int,
                                                      ctypes.c_int, pointer]
            lib.infer_quant_tile_selftest.restype = ctypes.c_int
            lib.infer_quant_set_tile_min_rows.argtypes, lib.infer_quant_set_tile_min_rows.restype = [ctypes.c_int], ctypes.c_int
            self.tiles = (lib.infer_quant_tiles() or b"").decode()
        # A decode step's tiles each stream a run of weight groups, with software prefetches or with
        # the hardware prefetcher alone. The engine's passes measure which is faster where they run
        # (kernels.cpu.STREAMS); this is the setting of calls outside them: on AMD's cores the
        # hardware alone measured faster in one session and slower in another, and the prefetches paid
        # on the Xeon they were tuned on (docs/cpu.md). The same bits either way.
        self.set_stream_prefetch(build.cpu_vendor() != "AuthenticAMD")

    def set_stream_prefetch(self, on: bool) -> bool:
        """Whether a 1-row call's whole-run tiles prefetch in software (this library, from now on);
        returns the setting before."""
        return bool(self.lib.infer_quant_set_stream_prefetch(int(on)))

    def __repr__(self) -> str:
        return f"QuantKernels({self.variant.name})"

    def request_tiles(self) -> int:
        """Asks the OS for tile state (once per process; AMX needs it, the emulation does not) and turns
        the tile path on where granted: 0, or the errno of the refusal."""
        if self.tiles is None:
            raise ValueError(f"the {self.variant.name} quantized kernels have no tiles")
        return int(self.lib.infer_quant_tile_permission())

    def set_tile_min_rows(self, rows: int) -> int:
        """Calls of at least ``rows`` rows (>= 2) take the tiles from now on, fewer the vectors (the same
        bits); returns the setting before. The default is the crossover measured for the tiles'
        implementation (docs/cpu.md): 64 rows on AMX, 2 on the emulation and SMMLA."""
        if self.tiles is None:
            raise ValueError(f"the {self.variant.name} quantized kernels have no tiles")
        if rows < 2:
            raise ValueError(f"tile_min_rows must be 2 or more (a 1-row call stays on the vectors), got {rows}")
        return int(self.lib.infer_quant_set_tile_min_rows(rows))

    def tile_products(self) -> int:
        """How many products have run on tiles in this process (0 for a library without them)."""
        return 0 if self.tiles is None else int(self.lib.infer_quant_tile_products())

    def tile_dot(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, op: str = "su") -> int:
        """One tile product through this library's tile primitives (the tests' check of them): ``c``
        (int32 [m, n], updated in place) += ``a`` (int8 or uint8 [m, K]: A, rows of K bytes) times
        ``b`` (uint8 or int8 [K / 4, 4n]: B in VNNI layout), with A's and B's bytes read as signed
        or unsigned as ``op`` says ("su": tdpbsud, "ss": tdpbssd, "us": tdpbusd). Returns the C
        function's code: 0 done, 1 shapes no tile holds, 2 the tiles are not usable here."""
        if self.tiles is None:
            raise ValueError(f"the {self.variant.name} quantized kernels have no tiles")
        ops = {"su": 0, "ss": 1, "us": 2}
        m, kbytes = a.shape
        n = c.shape[1]
        if a.dtype.itemsize != 1 or b.dtype.itemsize != 1 or c.dtype != np.int32 or b.shape != (kbytes // 4, 4 * n) \
                or c.shape[0] != m or not (a.flags.c_contiguous and b.flags.c_contiguous and c.flags.c_contiguous):
            raise ValueError("tile_dot takes contiguous bytes a [m, K], b [K / 4, 4n] and int32 c [m, n]")
        return int(self.lib.infer_quant_tile_selftest(a.ctypes.data, m, kbytes, kbytes, b.ctypes.data, n, ops[op],
                                                      c.ctypes.data))

    def _function(self, name: str, weight: QuantWeight) -> Any:
        """This library's ``<name>_x8_<type>`` for ``weight`` (checked first)."""
        return getattr(self.lib, f"{name}_x8_{check_weight(weight).suffix}")

    def linear_entry(self, weight: QuantWeight) -> int:
        """The address of the C function ``linear`` calls for ``weight`` (``quant_linear_x8_<type>``,
        one signature for every type; the C decoder stack calls it directly; this library stays
        loaded for the process)."""
        address = ctypes.cast(self._function("quant_linear", weight), ctypes.c_void_p).value
        return int(address or 0)

    def pack(self, raw: torch.Tensor, qtype: str, in_features: int) -> QuantWeight:
        """``raw`` (uint8 [out_features, bytes per row], ggml's blocks as the file stores them)
        repacked into the x8 layout: a new tensor made once (the file's view can then be dropped), in
        the weights' huge-page arena (``infer.memory``: a decode step streams every one of them)."""
        qt = quant_type(qtype)
        _check_raw(raw, qt, in_features, "raw")
        rows = int(raw.shape[0])
        packed = WEIGHTS.zeros((-(-rows // X8_ROWS), in_features // qt.block_elems * qt.x8_block_bytes), torch.uint8)
        getattr(self.lib, f"quant_repack_x8_{qt.suffix}")(raw.data_ptr(), rows, in_features, packed.data_ptr())
        return QuantWeight(qt.name, rows, in_features, packed)

    def linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None, *,
               threads: int | None = None) -> torch.Tensor:
        """``x @ W^T + bias`` for float32 ``x`` [..., in_features]: float32 [..., out_features].
        ``threads``: the pool's threads (default: the kernels' count, ``infer.kernels.cpu``); the result
        is the same bits for any count."""
        function = self._function("quant_linear", weight)
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype != torch.float32:
            raise ValueError(f"x must be a float32 CPU tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}"
                             f"{' on ' + str(x.device) if isinstance(x, torch.Tensor) else ''}")
        if x.dim() == 0 or x.shape[-1] != weight.in_features:
            raise ValueError(f"x's last dimension must be in_features={weight.in_features}, got shape {tuple(x.shape)}")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or bias.device.type != "cpu" or bias.dtype != torch.float32:
                raise ValueError("bias must be a float32 CPU tensor")
            if tuple(bias.shape) != (weight.out_features,) or not bias.is_contiguous():
                raise ValueError(f"bias must be contiguous with shape ({weight.out_features},), got "
                                 f"{tuple(bias.shape)}")
        if threads is None:
            from infer.kernels.cpu import _threads

            threads = _threads()
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        rows = x.numel() // weight.in_features
        y = torch.empty(*x.shape[:-1], weight.out_features, dtype=torch.float32)
        if rows == 0:
            return y
        since = PHASES.mark()
        failed = function(
            weight.data.data_ptr(), weight.out_features, weight.in_features, x.data_ptr(), rows,
            None if bias is None else bias.data_ptr(), y.data_ptr(), threads)
        PHASES.add("kernels", since)
        if failed:
            raise MemoryError(f"the quantized kernel could not allocate {rows} x {weight.in_features} activations")
        return y

    def dequantize_rows(self, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight in float32 (an embedding lookup): ids.shape + [in_features],
        the values gguf-py's ``dequantize`` gives."""
        function = self._function("quant_dequantize_rows", weight)
        if not isinstance(ids, torch.Tensor) or ids.device.type != "cpu" or ids.dtype.is_floating_point \
                or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError("ids must be an integer CPU tensor")
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= weight.out_features):
            raise ValueError(f"ids must lie in [0, {weight.out_features}), got values in "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        out = torch.empty(*ids.shape, weight.in_features, dtype=torch.float32)
        if flat.numel():  # out_features: where the last run of groups ends (quant_x8.h)
            function(weight.data.data_ptr(), weight.out_features, weight.in_features, flat.data_ptr(), flat.numel(),
                     out.data_ptr())
        return out

    def dequantize_ids(self, weight: QuantWeight, ids: Sequence[int], out: torch.Tensor) -> None:
        """``dequantize_rows`` of ``ids`` given as Python ints, into ``out`` (float32 [len(ids),
        in_features], contiguous): a decode step's embedding rows without an index tensor."""
        function = self._function("quant_dequantize_rows", weight)
        if any(not 0 <= i < weight.out_features for i in ids):
            raise ValueError(f"ids must lie in [0, {weight.out_features}), got {list(ids)}")
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() \
                or tuple(out.shape) != (len(ids), weight.in_features):
            raise ValueError(f"out must be a contiguous float32 CPU tensor [{len(ids)}, {weight.in_features}]")
        index = (ctypes.c_int64 * len(ids))(*ids)
        function(weight.data.data_ptr(), weight.out_features, weight.in_features, ctypes.addressof(index), len(ids),
                 out.data_ptr())


def expected_layout(isa: str) -> str:
    """``infer_quant_layout()``'s text for the variant ``isa`` (see quant_kernels.c)."""
    types = " ".join(f"{t.suffix}={t.block_elems}:{t.block_bytes}" for t in QUANT_TYPES.values())
    x8 = ",".join(f"{t.suffix}:{t.x8_block_bytes}" for t in QUANT_TYPES.values())
    return f"isa={isa} qk={ACTIVATION_BLOCK} {types} x8={x8}"


# ---------------------------------------------------------------------------------------------
# The reference: the same math in numpy, written from gguf-py's layouts (the tests check that its
# weights dequantize to gguf.quants.dequantize's values, and the kernels against it).


@dataclass
class DecodedWeight:
    """A weight as the kernels see it, per 32-element chunk: value = scale * lane_scale * q + min."""

    q: np.ndarray  # int64 [n, chunks, 32]
    lane_scale: np.ndarray  # int64 [n, chunks, 2]: the integer scale of each 16-element half (Q6_K; else 1)
    scale: np.ndarray  # float32 [n, chunks]
    min: np.ndarray  # float32 [n, chunks] (0 for the types without a min)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve scale bytes [blocks, 12] -> six-bit sc, m [blocks, 8]."""
    d, m, md = scales[:, 0:4].astype(np.int64), scales[:, 4:8].astype(np.int64), scales[:, 8:12].astype(np.int64)
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=1)
    return sc, mn


def decode_weight(raw: np.ndarray | torch.Tensor, qtype: str, in_features: int) -> DecodedWeight:
    """``raw``'s blocks as integers and float scales per 32-element chunk (see ``DecodedWeight``)."""
    qt = quant_type(qtype)
    data = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    n = data.shape[0]
    blocks = data.reshape(n * (in_features // qt.block_elems), qt.block_bytes)
    nb = blocks.shape[0]

    def f16(at: int) -> np.ndarray:
        return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32).reshape(nb, 1)

    def nibbles16(qs: np.ndarray) -> np.ndarray:  # [nb, 16] -> [nb, 32]: low nibbles, then high
        return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int64)

    ones = np.ones((nb, qt.block_elems // ACTIVATION_BLOCK, 2), dtype=np.int64)
    zero = np.zeros((nb, qt.block_elems // ACTIVATION_BLOCK), dtype=np.float32)
    if qt.name == "Q8_0":
        q, scale, mins = blocks[:, 2:].view(np.int8).astype(np.int64), f16(0), zero
    elif qt.name == "Q4_0":
        q, scale, mins = nibbles16(blocks[:, 2:]) - 8, f16(0), zero
    elif qt.name == "Q4_1":
        q, scale, mins = nibbles16(blocks[:, 4:]), f16(0), f16(2)
    elif qt.name == "Q5_0":
        qh = blocks[:, 2:6].copy().view("<u4").astype(np.int64)  # [nb, 1]
        high = (qh >> np.arange(32)) & 1
        q, scale, mins = (nibbles16(blocks[:, 6:]) | (high << 4)) - 16, f16(0), zero
    elif qt.name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(blocks[:, 4:16])
        qs = blocks[:, 16:144] if qt.name == "Q4_K" else blocks[:, 48:176]
        chunks = []
        for c in range(8):
            part = qs[:, 32 * (c // 2):32 * (c // 2) + 32].astype(np.int64)
            values = (part >> 4) if c & 1 else (part & 15)
            if qt.name == "Q5_K":
                values = values | (((blocks[:, 16:48].astype(np.int64) >> c) & 1) << 4)
            chunks.append(values)
        q = np.stack(chunks, axis=1)
        scale = f16(0) * sc.astype(np.float32)
        mins = -(f16(2) * mn.astype(np.float32))
    elif qt.name == "Q6_K":
        ql, qh = blocks[:, 0:128].astype(np.int64), blocks[:, 128:192].astype(np.int64)
        lane_scales = blocks[:, 192:208].view(np.int8).astype(np.int64)
        chunks, halves = [], []
        for c in range(8):
            half, k = divmod(c, 4)
            low = ql[:, 64 * half + 32 * (k & 1):64 * half + 32 * (k & 1) + 32]
            low = (low >> 4) if k >> 1 else (low & 15)
            high = (qh[:, 32 * half:32 * half + 32] >> (2 * k)) & 3
            chunks.append((low | (high << 4)) - 32)
            halves.append(lane_scales[:, 8 * half + 2 * k:8 * half + 2 * k + 2])
        q, ones = np.stack(chunks, axis=1), np.stack(halves, axis=1)
        scale, mins = np.repeat(f16(208), 8, axis=1), zero
    else:  # pragma: no cover - QUANT_TYPES and this list are the same
        raise ValueError(qt.name)
    chunks_per_row = in_features // ACTIVATION_BLOCK
    return DecodedWeight(q.reshape(n, chunks_per_row, 32), ones.reshape(n, chunks_per_row, 2),
                         np.broadcast_to(scale, (nb, qt.block_elems // 32)).reshape(n, chunks_per_row).astype(np.float32),
                         np.broadcast_to(mins, (nb, qt.block_elems // 32)).reshape(n, chunks_per_row).astype(np.float32))


def dequantize_reference(raw: np.ndarray | torch.Tensor, qtype: str, in_features: int) -> np.ndarray:
    """float32 [n, in_features], rounding as gguf-py does: (scale * lane_scale) * q + min."""
    w = decode_weight(raw, qtype, in_features)
    lane = np.repeat(w.lane_scale, 16, axis=2).astype(np.float32)
    values = (w.scale[..., None] * lane) * w.q.astype(np.float32) + w.min[..., None]
    return values.reshape(w.q.shape[0], in_features).astype(np.float32)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 [m, k] -> int8 values [m, k/32, 32], scales dx and d * sum(q) [m, k/32], as the C code."""
    m, k = x.shape
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[..., None]).astype(np.int64)
    return q, d.astype(np.float32), (d * q.sum(axis=2).astype(np.float32)).astype(np.float32)


def reference_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``QuantKernels.linear`` computes, in numpy: the integer dot products exactly, their
    float sum in float64 (the kernels sum in float32, in their own order)."""
    w = decode_weight(raw, qtype, in_features)
    xs = x.detach().to(torch.float32).reshape(-1, in_features).numpy()
    xq, dx, sx = quantize_activations(xs)
    lo = np.einsum("ncl,mcl->mnc", w.q[..., :16], xq[..., :16])
    hi = np.einsum("ncl,mcl->mnc", w.q[..., 16:], xq[..., 16:])
    isum = lo * w.lane_scale[None, ..., 0] + hi * w.lane_scale[None, ..., 1]
    coef = (w.scale[None] * dx[:, None]).astype(np.float64)  # scale * dx rounds to float32 in C too
    y = (isum * coef).sum(axis=2) + (w.min[None] * sx[:, None]).astype(np.float64).sum(axis=2)
    out = torch.from_numpy(y.astype(np.float32)).reshape(*x.shape[:-1], w.q.shape[0])
    return out if bias is None else out + bias.to(torch.float32)


def fmaf(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once (C's fmaf), elementwise, for float32 arrays.

    a * b is exact in float64 (48 bits), so only the sum rounds: s = fl64(a*b + c) and its exact
    error e (TwoSum) give the exact value s + e, which rounds to float32 as s does unless s lies
    exactly halfway between two float32 neighbours (then e's sign picks the side)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    back = s - p
    e = (p - (s - back)) + (c64 - back)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
    tie = (s != r64) & (s == (r64 + other.astype(np.float64)) / 2) & (e != 0)
    toward = np.where(e > 0, np.maximum(r, other), np.minimum(r, other))
    return np.where(tie, toward, r).astype(np.float32)


def reference_linear_x8(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``QuantKernels.linear`` computes on the x8 layout, bit for bit (quant_x8.h's sequence,
    and the K types' beside their code in quant_kernels.c): per output, over the 32-value chunks
    in order from acc = 0, acc = fmaf(float(isum), scale * d_x, acc), then acc = fmaf(min, sx, acc)
    for the types with a min; then + bias. ``isum`` is the chunk's exact integer dot product (Q6_K:
    its two 16-value halves times their integer scales), ``scale`` the chunk's float scale
    (Q4_K: d * sc; Q6_K: d) and ``min`` its float min (Q4_K: -dmin * m)."""
    qt = quant_type(qtype)
    w = decode_weight(raw, qt.name, in_features)
    xq, dx, sx = quantize_activations(x.detach().to(torch.float32).reshape(-1, in_features).numpy())
    lo = np.einsum("ncl,mcl->mnc", w.q[..., :16], xq[..., :16])
    hi = np.einsum("ncl,mcl->mnc", w.q[..., 16:], xq[..., 16:])
    isum = (lo * w.lane_scale[None, ..., 0] + hi * w.lane_scale[None, ..., 1]).astype(np.float32)  # |isum| < 2^24
    has_min = qt.name in ("Q4_1", "Q4_K", "Q5_K")
    acc = np.zeros(isum.shape[:2], dtype=np.float32)
    for c in range(isum.shape[2]):
        acc = fmaf(isum[..., c], w.scale[None, :, c] * dx[:, None, c], acc)
        if has_min:
            acc = fmaf(np.broadcast_to(w.min[None, :, c], acc.shape), np.broadcast_to(sx[:, None, c], acc.shape), acc)
    out = torch.from_numpy(acc).reshape(*x.shape[:-1], w.q.shape[0])
    return out if bias is None else out + bias.to(torch.float32)


def reference_terms_scale(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The sum of the magnitudes of the terms ``reference_linear`` adds per output: float32
    rounding in any order stays within a few ulps of it (the tests' tolerance)."""
    w = decode_weight(raw, qtype, in_features)
    xq, dx, sx = quantize_activations(x.detach().to(torch.float32).reshape(-1, in_features).numpy())
    lo = np.abs(np.einsum("ncl,mcl->mnc", np.abs(w.q[..., :16]), np.abs(xq[..., :16])))
    hi = np.abs(np.einsum("ncl,mcl->mnc", np.abs(w.q[..., 16:]), np.abs(xq[..., 16:])))
    isum = lo * np.abs(w.lane_scale[None, ..., 0]) + hi * np.abs(w.lane_scale[None, ..., 1])
    total = (isum * np.abs(w.scale[None] * dx[:, None])).sum(axis=2) + np.abs(w.min[None] * sx[:, None]).sum(axis=2)
    return torch.from_numpy(total.astype(np.float32)).reshape(*x.shape[:-1], w.q.shape[0])


# ---------------------------------------------------------------------------------------------
# Choosing the variant.


def _probe(kernels: QuantKernels) -> str | None:
    """None where the library computes what the reference does on a small product of every
    type, else what went wrong (a miscompiled or mismatched build must not produce logits)."""
    generator = torch.Generator().manual_seed(0)
    for qt in QUANT_TYPES.values():
        k = 256
        raw = random_blocks(qt.name, 8, k, generator)
        x = torch.randn(3, k, generator=generator)
        got = kernels.linear(x, kernels.pack(raw, qt.name, k), threads=1)
        want = reference_linear(x, raw, qt.name, k)
        bound = 1e-5 * reference_terms_scale(x, raw, qt.name, k) + 1e-6
        if not bool(((got - want).abs() <= bound).all()):
            return f"{qt.name} product differs from the reference by {float((got - want).abs().max()):.3g}"
    return None


def random_blocks(qtype: str, rows: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Random but valid blocks (uint8 [rows, bytes per row]): random bits with every float16
    scale replaced by a small finite one, so the reference dequantizer defines the values."""
    qt = quant_type(qtype)
    blocks = rows * (in_features // qt.block_elems)
    data = torch.randint(0, 256, (blocks, qt.block_bytes), dtype=torch.uint8, generator=generator)
    scale_at = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                "Q6_K": (208,)}[qt.name]
    for at in scale_at:
        scales = (torch.rand(blocks, generator=generator) * 0.02 + 0.001).to(torch.float16)
        if qt.name == "Q4_1" and at == 2:  # the min of a Q4_1 block: either sign
            scales = (torch.rand(blocks, generator=generator) * 0.2 - 0.1).to(torch.float16)
        data[:, at:at + 2] = scales.view(torch.uint8).reshape(blocks, 2)
    return data.reshape(rows, -1).contiguous()


@functools.cache
def _load(name: str) -> QuantKernels:
    variant = next(v for v in build.QUANT_VARIANTS if v.name == name)
    missing = build.missing_cpu_flags(variant)
    if missing:
        raise KernelUnavailable(f"{name}: CPU lacks {', '.join(missing)}")
    try:
        kernels = QuantKernels(variant, build.load(variant))
    except KernelUnavailable as err:
        raise KernelUnavailable(f"{name}: {err}") from None
    if kernels.tiles is not None:
        # AMX's register file is process state Linux hands out only on request; a VM or kernel
        # that does not enable it refuses, and the tiles would fault: the variant is refused.
        refusal = kernels.request_tiles()
        if refusal:
            raise KernelUnavailable(f"{name}: the CPU has AMX but the OS does not grant this process tile state "
                                    f"(arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): "
                                    f"{os.strerror(refusal) if refusal > 0 else 'failed'})")
    failure = _probe(kernels)
    if failure is not None:
        raise KernelUnavailable(f"{name}: probe failed: {failure}")
    return kernels


@functools.cache
def _best() -> tuple[QuantKernels | None, str, str]:
    """The default choice, why nothing runs ("" where something does), and why better variants
    whose CPU flags this CPU has were refused (their build, the OS's tile permission, a probe)."""
    refused: list[str] = []
    notes: list[str] = []
    for variant in build.QUANT_VARIANTS:
        if variant.name in EMULATED:
            continue
        has_flags = not build.missing_cpu_flags(variant)
        try:
            return _load(variant.name), "", "; ".join(notes)
        except KernelUnavailable as err:
            refused.append(str(err))
            if has_flags:
                notes.append(str(err))
        except Exception as err:  # anything else a build can raise must still not break a model load
            refused.append(f"{variant.name}: {type(err).__name__}: {err}")
            if has_flags:
                notes.append(refused[-1])
    return None, "; ".join(refused), ""


def quant_kernels(variant: str | None = None) -> QuantKernels | None:
    """The quantized kernels: by default the best variant this CPU runs, never an emulated one
    (None where none does; ``quant_unavailable_reason()`` says why). A named variant is that one or an error:
    ValueError for an unknown name, KernelUnavailable naming why it cannot run here."""
    if variant is None:
        return _best()[0]
    names = [v.name for v in build.QUANT_VARIANTS]
    if variant not in names:
        raise ValueError(f"unknown quantized-kernel variant {variant!r}: one of {', '.join(names)}")
    return _load(variant)


def quant_unavailable_reason() -> str:
    """Why ``quant_kernels()`` is None, one line per refused variant joined by '; ' ("" where it is not)."""
    return _best()[1]


def quant_selection_note() -> str:
    """Why the default choice is not a better variant whose CPU flags this CPU has, one line per
    such variant joined by '; ' ("" where none was refused): the CPU has AMX but the OS does not
    grant tile state, say. The startup line adds it to the kernels it names."""
    return _best()[2]


def reset() -> None:
    """Forget the choice (tests that fake another CPU or compiler call this; ``infer.kernels.reset`` does)."""
    _load.cache_clear()
    _best.cache_clear()


__all__ = ["ACTIVATION_BLOCK", "EMULATED", "QUANT_TYPES", "TILE_TYPES", "TILE_VARIANTS", "QuantKernels", "QuantType",
           "QuantWeight", "decode_weight", "dequantize_reference", "quant_kernels", "quant_selection_note",
           "quant_unavailable_reason", "reference_linear", "reference_linear_x8", "reset"]
