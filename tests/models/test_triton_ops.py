"""The fused Triton operators (``backends.triton_ops``) against the PyTorch layers they replace.

As in test_triton_attention.py: without a GPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors, in a child pytest on this file (``test_interpreted_tests_pass``);
each process deselects the other's tests (tests/conftest.py). Random inputs at odd sizes (rows and
widths that are not powers of two, head counts that pad), every form of each operator, then whole
models with the operators installed against the same models without. The ``cuda`` tests run the
compiled kernels on a GPU (``pytest -m cuda``; skipped without one).
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import run_interpreted_half
from infer.backends import triton_ops
from infer.models import MODEL_REGISTRY
from infer.models.config import FULL, SLIDING, ModelConfig
from infer.models.gemma3 import GemmaRMSNorm
from infer.models.layers import MLP, DecoderOnlyLM, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

pytest.importorskip("triton", reason="triton is in the dev extra (pip install -e '.[dev]')")

# float32 differs from the layers only by summation order; a half-precision result may land one
# rounding step away where that order tips a rounding (the layers round at the same points).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
interpreted = pytest.mark.triton_interpreted
in_parent = pytest.mark.triton_parent


@in_parent
def test_interpreted_tests_pass() -> None:
    """This file's interpreted tests, in a child pytest with Triton's interpreter on."""
    run_interpreted_half(__file__)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


def randn(*shape: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def norms(dim: int, dtype: torch.dtype, device: str) -> tuple[RMSNorm, GemmaRMSNorm, GemmaRMSNorm]:
    """A Llama norm and two Gemma norms with random weights (a Gemma checkpoint's are offsets from 1)."""
    llama, gemma, branch = RMSNorm(dim, 1e-6), GemmaRMSNorm(dim, 1e-6), GemmaRMSNorm(dim, 1e-5)
    with torch.no_grad():
        for seed, norm in enumerate((llama, gemma, branch)):
            norm.weight.copy_(randn(dim, dtype=torch.float32, seed=10 + seed) * 0.5 + (1.0 if norm is llama else 0.0))
    return llama.to(device, dtype), gemma.to(device, dtype), branch.to(device, dtype)


def check_norms(dtype: torch.dtype, device: str, shape: tuple[int, ...]) -> None:
    llama, gemma, branch = norms(shape[-1], dtype, device)
    x, y = randn(*shape, dtype=dtype, device=device, seed=1), randn(*shape, dtype=dtype, device=device, seed=2)
    # Llama: the norm alone, and the residual add with the norm after it.
    close(triton_ops.rms_norm(x, llama.weight, llama.eps)[1], llama(x))
    h, n = triton_ops.rms_norm(x, llama.weight, llama.eps, residual=y)
    close(h, x + y)
    close(n, llama(x + y))
    # Gemma: (1 + w), and its sandwich: the branch normalised, added, then the next norm.
    close(triton_ops.rms_norm(x, gemma.weight, gemma.eps, offset=True)[1], gemma(x))
    h, n = triton_ops.rms_norm(x, gemma.weight, gemma.eps, residual=y, branch_weight=branch.weight,
                               branch_eps=branch.eps, offset=True)
    close(h, x + branch(y))
    close(n, gemma(x + branch(y)))
    h, none = triton_ops.rms_norm(x, gemma.weight, gemma.eps, residual=y, branch_weight=branch.weight,
                                  branch_eps=branch.eps, offset=True, normalise=False)
    assert none is None
    close(h, x + branch(y))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 72), (7, 200), (1, 1, 33)], ids=str)
def test_rms_norm_matches_the_layers(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    check_norms(dtype, "cpu", shape)


def check_rope(dtype: torch.dtype, device: str, batch: int, width: int, heads: int, kv_heads: int,
               head_dim: int) -> None:
    """RoPE on the q and k heads of a fused projection's output (a strided view) at scattered positions
    with llama3 scaling, against ``apply_rope``."""
    config = ModelConfig(model_type="llama", vocab_size=10, hidden_size=heads * head_dim, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=512,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    positions = torch.randint(0, 500, (batch, width), generator=torch.Generator().manual_seed(3)).to(device)
    cos, sin = rope_cos_sin(rope_inv_freq(config).to(device), positions, dtype)
    qkv = randn(batch, width, heads + 2 * kv_heads, head_dim, dtype=dtype, device=device, seed=4)
    qk = qkv[:, :, : heads + kv_heads]
    got = triton_ops.rope_qk(qk, cos, sin)
    assert got.is_contiguous()
    close(got, apply_rope(qk, cos, sin))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [(2, 3, 6, 2, 16), (1, 5, 5, 1, 24), (3, 1, 3, 3, 64)], ids=str)
def test_rope_matches_apply_rope(dtype: torch.dtype, dims: tuple[int, int, int, int, int]) -> None:
    check_rope(dtype, "cpu", *dims)


def check_swiglu(dtype: torch.dtype, device: str, shape: tuple[int, ...]) -> None:
    gate_up = randn(*shape, dtype=dtype, device=device, seed=5) * 3
    mlp = MLP.__new__(MLP)  # activate() reads nothing of the module
    close(triton_ops.swiglu(gate_up), MLP.activate(mlp, gate_up))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 2 * 37), (5, 2 * (triton_ops.SWIGLU_BLOCK + 9)), (1, 2)], ids=str)
def test_swiglu_matches_the_activation(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    check_swiglu(dtype, "cpu", shape)


@interpreted
def test_bad_shapes_are_refused() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"norm weights must be \[8\]"):
        triton_ops.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        triton_ops.rms_norm(x, torch.ones(8), 1e-6, residual=torch.zeros(2, 9))
    with pytest.raises(ValueError, match="even last dim"):
        triton_ops.swiglu(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="cos/sin"):
        triton_ops.rope_qk(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))


def random_model(model_type: str, dtype: torch.dtype) -> DecoderOnlyLM:
    """A small random model in the inference layout with random norm weights (a fresh checkpoint's
    are all ones, or zeros for Gemma, which would hide a weight applied wrongly)."""
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=5,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
    if model_type == "gemma3":
        config = ModelConfig(model_type="gemma3", **common, sliding_window=4, layer_types=[SLIDING, FULL],
                             rope_local_theta=10_000.0, rope_theta=1_000_000.0, query_pre_attn_scalar=24,
                             qk_norm=True, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)
    else:
        config = ModelConfig(model_type=model_type, **common, qk_norm=model_type == "qwen3")
    model = MODEL_REGISTRY[model_type](config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (RMSNorm, GemmaRMSNorm)):
                module.weight.normal_(1.0 if isinstance(module, RMSNorm) else 0.0, 0.3)
    model.fuse_projections()
    return model.to(dtype).eval()


def check_installed_model(model_type: str, dtype: torch.dtype, device: str) -> None:
    model = random_model(model_type, dtype).to(device)
    fused = copy.deepcopy(model)
    assert triton_ops.install(fused) is None
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6)).to(device)
    with torch.no_grad():
        want, got = model(ids), fused(ids)
    # Differences of one rounding step compound over the layers: twice a single operator's tolerance.
    tol = 2 * TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)
    assert not torch.equal(want, model(ids.flip(1))), "the inputs must matter"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3"])
def test_installed_model_matches_the_layers(model_type: str, dtype: torch.dtype) -> None:
    """Every layer with the fused operators (norms, residual adds, RoPE, SwiGLU) gives the hidden
    states of the same model run by its PyTorch layers."""
    check_installed_model(model_type, dtype, "cpu")


@interpreted
def test_install_replaces_the_layers_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed model runs the kernels (not the PyTorch path by mistake): each is called."""
    model = random_model("llama", torch.float32)
    triton_ops.install(model)
    calls: dict[str, int] = {}
    for name in ("rms_norm", "rope_qk", "swiglu"):
        def counted(*args: object, _name: str = name, _real: object = getattr(triton_ops, name), **kw: object) -> object:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kw)  # type: ignore[operator]
        monkeypatch.setattr(triton_ops, name, counted)
    model(torch.tensor([[1, 2, 3]]))
    layers = model.config.num_hidden_layers
    # per layer: the input norm and the fused add + norm; then the final norm
    assert calls == {"rms_norm": 2 * layers + 1, "rope_qk": layers, "swiglu": layers}


# ------------------------------------------------------------------------- compiled for a GPU, without one

POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


@in_parent
@pytest.mark.parametrize("name", ["rms_norm-offset", "rms_norm-llama", "rope", "swiglu"])
def test_kernels_compile_for_hopper(name: str) -> None:
    """Triton compiles each kernel for sm_90 here (no GPU needed), in bfloat16 at Llama 3.2 3B's sizes
    (hidden 3072, 24 + 8 heads of 128, intermediate 8192) with every optional part switched on."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = triton_ops._kernels()[name.split("-")[0]]
    constants = {
        "rms_norm-offset": dict(HAS_Y=True, NORM_Y=True, WRITE_N=True, OFFSET=True, BLOCK=4096),
        "rms_norm-llama": dict(HAS_Y=True, NORM_Y=True, WRITE_N=True, OFFSET=False, BLOCK=4096),
        "rope": dict(HEAD_DIM=128, HEADS_PAD=32, DIM_PAD=128),
        "swiglu": dict(BLOCK=triton_ops.SWIGLU_BLOCK),
    }[name]
    signature = {arg: "constexpr" if arg in constants else POINTER[torch.bfloat16] if arg.endswith("_ptr")
                 else "fp32" if arg == "eps" else "i32" for arg in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert "cubin" in compiled.asm and compiled.asm["cubin"]


@in_parent
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_install_without_cuda_says_why_and_changes_nothing() -> None:
    model = random_model("llama", torch.float32)
    forward = model.model.layers[0].forward
    assert triton_ops.install(model) == triton_ops.unavailable_reason("cpu")
    assert "not on cpu" in str(triton_ops.install(model))
    assert model.model.layers[0].forward == forward


# ------------------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.cuda
@needs_cuda
@in_parent
def test_ops_on_cuda_match_the_layers(dtype: torch.dtype) -> None:
    check_norms(dtype, "cuda", (9, 3072))
    check_rope(dtype, "cuda", 4, 7, 24, 8, 128)
    check_swiglu(dtype, "cuda", (33, 2 * 8192))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3"])
@pytest.mark.cuda
@needs_cuda
@in_parent
def test_installed_model_on_cuda_matches_the_layers(model_type: str) -> None:
    check_installed_model(model_type, torch.bfloat16, "cuda")
