"""What a family's decoder block computes, as data: each architecture declares a ``BlockSpec``
(``DecoderOnlyLM.block_spec``), and the code that runs a model some other way (the C decoder
stack, the Triton operators, the GGUF loader) reads its fields instead of asking which family
the model is.

The default is Llama's block (Qwen2, Qwen3 and Mistral share it); the fields say where another
family's differs. How many positions a layer attends to stays in the configuration
(``ModelConfig.layer_window``: a checkpoint's window and its layer pattern), since it varies
between checkpoints of one family; ``local_rope`` says what those windowed layers rotate with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class BlockSpec:
    # RMSNorm's kind. False: ``weight * round(norm(x))`` (Llama: the normalised row rounded to the
    # activations' dtype, then scaled). True: ``round(norm(x) * (1 + weight))``, all in float32 and
    # rounded once, the weight stored as its offset from one (a GGUF file stores ``1 + weight``).
    # Every norm of the model has this kind: the layers', the q/k norms and the final one.
    norm_offset: bool = False
    # The MLP's gate: SiLU (SwiGLU) or GELU with the tanh approximation, rounded to the dtype before
    # the product with ``up`` in either case.
    activation: Activation = "silu"
    # Every model of the family normalises each q and k head before RoPE (otherwise
    # ``ModelConfig.qk_norm`` says, as for Qwen3).
    qk_norm: bool = False
    # A norm on the attention's and on the MLP's output before each residual add, besides the norms
    # before them (the "sandwich": ``DecoderLayer.branch_norms`` gives all four).
    post_norms: bool = False
    # The embeddings are multiplied by sqrt(hidden), rounded to their dtype first (the model's ``embed``).
    embed_scale: bool = False
    # Attention scores are scaled by ``ModelConfig.query_pre_attn_scalar ** -0.5`` (``Attention.scale``)
    # rather than 1/sqrt(head_dim).
    query_scale: bool = False
    # The sliding-window layers rotate with a RoPE base of their own (``ModelConfig.rope_local_theta``,
    # never scaled; the model's ``local_rope``); otherwise with the model's one table.
    local_rope: bool = False
    # The final logits are soft-capped, ``cap * tanh(logits / cap)`` with
    # ``ModelConfig.final_logit_softcapping`` (the model's ``compute_logits``).
    logit_softcap: bool = False


LLAMA_BLOCK = BlockSpec()
