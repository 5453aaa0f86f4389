"""Fused element-wise operators in Triton for the decoder layers on CUDA: fewer passes over the
activations per layer, where a decode step's time is memory traffic and kernel launches.

* ``rms_norm``: RMSNorm of each row, optionally after adding a residual branch in the same pass
  (``h = x + y``, then ``norm(h)``: the residual is read once and the sum written once), in the
  Llama form (``weight * norm(x)``, rounded to the input's dtype before the weight as
  ``models.layers.RMSNorm`` rounds) and the offset form (``norm(x) * (1 + weight)`` in float32,
  rounded once: ``BlockSpec.norm_offset``); a block with post norms (``BlockSpec.post_norms``) can
  also normalise the branch before adding it (``h = x + norm_y(y)``, then ``norm(h)``);
* ``rope_qk``: RoPE on the q and k heads of the fused q/k/v projection's output in one kernel,
  with the cos/sin tables ``models.layers.rope_cos_sin`` makes (the rotate-half convention, the
  first half of ``sin`` negated) at the pass's own positions;
* ``swiglu``: ``silu(gate) * up`` over the fused gate/up projection's output ``[..., 2 * I]``.

Each rounds where the PyTorch layer rounds (products and sums of half-precision values are
rounded to that precision before the next operation), so the results differ from the layers'
only by float32 summation order. ``install(model)`` gives a model's layers these operators where
``unavailable_reason`` is None (CUDA; the CPU under ``TRITON_INTERPRET=1``, for the tests).

Triton is imported lazily: this module imports on any machine.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

from infer.backends import triton_attention
from infer.cache.protocol import LayerKV
from infer.models.block import LLAMA_BLOCK
from infer.models.layers import MLP, Attention, DecoderLayer, DecoderOnlyLM, RMSNorm


def unavailable_reason(device: torch.device | str) -> str | None:
    """None when the operators can run on tensors on ``device``; otherwise why not. They need what
    the paged-attention kernel needs (Triton, and CUDA or the interpreter), so they say the same."""
    return triton_attention.unavailable_reason(device)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _kernels() -> dict[str, Any]:
    """The kernels, defined on first use so that importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, y_ptr, wy_ptr, w_ptr, h_ptr, n_ptr, stride_x, stride_y, stride_h, stride_n,
                        dim, eps, eps_y, HAS_Y: tl.constexpr, NORM_Y: tl.constexpr, WRITE_N: tl.constexpr,
                        OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < dim
        dtype = x_ptr.dtype.element_ty
        h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_Y:
            y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
            if NORM_Y:
                wy = tl.load(wy_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                inv_y = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / dim + eps_y)
                y = y * inv_y * (1.0 + wy) if OFFSET else wy * (y * inv_y).to(dtype).to(tl.float32)
                y = y.to(dtype).to(tl.float32)
            h = (h + y).to(dtype)
            tl.store(h_ptr + row * stride_h + cols, h, mask=ok)
            h = h.to(tl.float32)
        if WRITE_N:
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / dim + eps)
            # Llama rounds the normalised row to the activations' dtype, then applies the weight.
            n = h * inv * (1.0 + w) if OFFSET else w * (h * inv).to(dtype).to(tl.float32)
            tl.store(n_ptr + row * stride_n + cols, n.to(n_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def rope_kernel(out_ptr, x_ptr, cos_ptr, sin_ptr, width, heads,
                    stride_xb, stride_xt, stride_xh, stride_cb, stride_ct, stride_sb, stride_st,
                    stride_ob, stride_ot, stride_oh,
                    HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
        token = tl.program_id(0)
        b, t = token // width, token % width
        hs = tl.arange(0, HEADS_PAD)
        ds = tl.arange(0, DIM_PAD)
        dim_ok = ds < HEAD_DIM
        ok = (hs < heads)[:, None] & dim_ok[None, :]
        # x.roll(half): element d meets element d + half (mod head_dim), the sign being in sin.
        partner = tl.where(ds < HEAD_DIM // 2, ds + HEAD_DIM // 2, ds - HEAD_DIM // 2)
        base = x_ptr + b.to(tl.int64) * stride_xb + t * stride_xt + hs[:, None] * stride_xh
        x = tl.load(base + ds[None, :], mask=ok, other=0.0).to(tl.float32)
        x_rolled = tl.load(base + partner[None, :], mask=ok, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + b * stride_cb + t * stride_ct + ds, mask=dim_ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + b * stride_sb + t * stride_st + ds, mask=dim_ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        # x * cos + roll(x) * sin, each product rounded as the layer's half-precision products are.
        out = (x * c[None, :]).to(dtype).to(tl.float32) + (x_rolled * s[None, :]).to(dtype).to(tl.float32)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + hs[:, None] * stride_oh + ds[None, :],
                 out.to(dtype), mask=ok)

    @triton.jit
    def swiglu_kernel(out_ptr, x_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=ok)

    return {"rms_norm": rms_norm_kernel, "rope": rope_kernel, "swiglu": swiglu_kernel}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last dim] with the last dim contiguous (a view where the layout allows)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             branch_weight: torch.Tensor | None = None, branch_eps: float | None = None, offset: bool = False,
             normalise: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h, norm(h))`` where ``h = x + residual`` (``x`` itself when ``residual`` is None) and the
    norm has ``weight`` (Llama's form; ``1 + weight`` with ``offset``, ``BlockSpec.norm_offset``).
    With ``branch_weight`` the residual branch is normalised first (``h = x + norm_b(residual)``, a
    post norm; its epsilon ``branch_eps``, default ``eps``).
    ``normalise=False`` returns ``(h, None)`` (the add alone, after the branch's norm).
    Shapes ``[..., dim]``; the results are ``[..., dim]`` in ``x``'s dtype (Llama's norm in the
    dtype ``weight * x`` has, as the layer's)."""
    dim = x.shape[-1]
    if weight.shape != (dim,) or (branch_weight is not None and branch_weight.shape != (dim,)):
        raise ValueError(f"norm weights must be [{dim}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if branch_weight is not None and residual is None:
        raise ValueError("branch_weight normalises the residual branch: give the residual too")
    rows = _rows(x)
    ys = _rows(residual) if residual is not None else rows
    h = torch.empty_like(rows) if residual is not None else rows
    n_dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    n = torch.empty(rows.shape, dtype=n_dtype, device=x.device) if normalise else h
    if rows.shape[0]:
        _kernels()["rms_norm"][(rows.shape[0],)](
            rows, ys, branch_weight if branch_weight is not None else weight, weight, h, n,
            rows.stride(0), ys.stride(0), h.stride(0), n.stride(0), dim, eps, eps if branch_eps is None else branch_eps,
            HAS_Y=residual is not None, NORM_Y=branch_weight is not None, WRITE_N=normalise, OFFSET=offset,
            BLOCK=_next_power_of_2(dim))
    return h.view(x.shape), n.view(x.shape) if normalise else None


def rope_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on every head of ``qk`` [B, T, heads, head_dim] (a view of the fused projection's output
    is fine) with ``models.layers.rope_cos_sin``'s tables [B, T, 1, head_dim]; a new contiguous
    tensor, as ``models.layers.apply_rope`` returns."""
    batch, width, heads, head_dim = qk.shape
    if head_dim % 2 or qk.stride(-1) != 1:
        raise ValueError(f"RoPE needs an even, contiguous head dim (got {head_dim}, stride {qk.stride(-1)})")
    if cos.shape != (batch, width, 1, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [{batch}, {width}, 1, {head_dim}], got {tuple(cos.shape)}/{tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos/sin's head dim must be contiguous")
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    if batch * width:
        _kernels()["rope"][(batch * width,)](
            out, qk, cos, sin, width, heads, qk.stride(0), qk.stride(1), qk.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim, HEADS_PAD=_next_power_of_2(heads), DIM_PAD=_next_power_of_2(head_dim))
    return out


SWIGLU_BLOCK = 1024


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up projection's output [..., 2 * I] (gate first): [..., I]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"the fused gate/up output must have an even last dim, got {gate_up.shape[-1]}")
    inter = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and inter:
        block = min(SWIGLU_BLOCK, _next_power_of_2(inter))
        _kernels()["swiglu"][(rows.shape[0], -(-inter // block))](
            out, rows, rows.stride(0), out.stride(0), inter, BLOCK=block)
    return out.view(*gate_up.shape[:-1], inter)


# ----------------------------------------------------------------------------- the layers' forwards


def _norm_forward(self: nn.Module, x: torch.Tensor, offset: bool = False) -> torch.Tensor:
    normed = rms_norm(x, self.weight, self.eps, offset=offset)[1]  # type: ignore[arg-type]
    assert normed is not None
    return normed


def _layer_forward(self: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv: LayerKV | None) -> torch.Tensor:
    """``DecoderLayer.forward`` with the attention's residual add fused into the MLP's norm."""
    norm = self.post_attention_layernorm
    h, normed = rms_norm(x, norm.weight, norm.eps, residual=self.self_attn(self.input_layernorm(x), cos, sin, kv))
    return h + self.mlp(normed)


def _post_norm_layer_forward(self: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             kv: LayerKV | None, offset: bool = False) -> torch.Tensor:
    """The sandwich of a block with post norms (``BlockSpec.post_norms``; their kind ``offset``): each
    branch's output norm, the residual add and (after attention) the MLP's input norm in one kernel."""
    before_attn, post, pre, post_ff = self.branch_norms()
    assert post is not None and post_ff is not None
    h, normed = rms_norm(x, pre.weight, pre.eps, residual=self.self_attn(before_attn(x), cos, sin, kv),  # type: ignore[arg-type]
                         branch_weight=post.weight, branch_eps=post.eps, offset=offset)  # type: ignore[arg-type]
    out, _ = rms_norm(h, post_ff.weight, post_ff.eps, residual=self.mlp(normed),  # type: ignore[arg-type]
                      branch_weight=post_ff.weight, branch_eps=post_ff.eps, offset=offset,  # type: ignore[arg-type]
                      normalise=False)
    return out


def _rotate_qk(self: Attention, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope_qk(qkv[:, :, : self.num_heads + self.num_kv_heads], cos, sin)


def _activate(self: MLP, gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu(gate_up)


def install(model: nn.Module) -> str | None:
    """Give ``model``'s layers the fused operators, in place, where they can run on the model's
    device: every RMSNorm, each layer's residual add with the norm after it, RoPE on the fused
    q/k/v output, SwiGLU's activation. Returns None when installed, else why not (nothing changed).

    What each layer gets follows the model's ``block_spec``: the norms of its kind (``norm_offset``)
    and, with post norms, the sandwich's fused adds; a block gating otherwise than with SiLU keeps its
    MLP's PyTorch activation (and one normalising q and k before RoPE never calls ``rotate_qk``).
    """
    parameter = next(model.parameters(), None)
    if parameter is None:
        return "the model has no parameters"
    reason = unavailable_reason(parameter.device)
    if reason is not None:
        return reason
    spec = model.block_spec if isinstance(model, DecoderOnlyLM) else LLAMA_BLOCK
    # The block's norm type: of the offset kind where the block says so (a plain RMSNorm never is).
    block_norm = model.layer_type.norm_type if isinstance(model, DecoderOnlyLM) else RMSNorm
    bind = types.MethodType
    for module in model.modules():
        if isinstance(module, (RMSNorm, block_norm)):
            offset = spec.norm_offset and isinstance(module, block_norm)
            module.forward = functools.partial(_norm_forward, module, offset=offset)  # type: ignore[method-assign]
        elif isinstance(module, DecoderLayer) and spec.post_norms:
            module.forward = functools.partial(_post_norm_layer_forward, module,  # type: ignore[method-assign]
                                               offset=spec.norm_offset)
        elif isinstance(module, DecoderLayer):
            module.forward = bind(_layer_forward, module)  # type: ignore[method-assign]
        elif isinstance(module, Attention):
            # rotate_qk serves the fused projection without q/k norms (a q/k-normed forward never calls it).
            module.rotate_qk = bind(_rotate_qk, module)  # type: ignore[method-assign]
        elif isinstance(module, MLP) and spec.activation == "silu":
            module.activate = bind(_activate, module)  # type: ignore[method-assign]
    return None
