"""Phi-3: the Llama block (RMSNorm, SiLU-gated MLP, RoPE, GQA, no biases) under fused checkpoint names.

Its checkpoints store q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``; the loader
splits them into the shared decoder's modules by the rows those take (``packed_modules``), and
``hf_state_dict`` stacks them back, so a saved model loads in transformers. An optional
``sliding_window`` applies to every layer, as Mistral's does. Refused by name: RoPE on part of each
head (``partial_rotary_factor`` below 1, Phi-4-mini) and LongRoPE (``rope_scaling`` longrope/su,
the 128k-context checkpoints), whose short/long factors switch with the sequence length. There is
no GGUF phi3 reading.
"""

from __future__ import annotations

from typing import Any

from infer.models.config import CheckpointError, ModelConfig, ModelFamily, window_fields
from infer.models.layers import DecoderOnlyLM

PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Phi3ForCausalLM(DecoderOnlyLM):
    """The shared decoder as it is: only the checkpoint's names differ from Llama's."""

    def hf_state_dict(self) -> dict[str, Any]:
        return FAMILY.pack_state(super().hf_state_dict())


def phi3_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The sliding window (every layer), after refusing what the shared decoder does not compute."""
    rope = raw.get("rope_parameters") or {}
    # transformers 5 writes it inside rope_parameters; older files at the top level
    partial = next((p for p in (raw.get("partial_rotary_factor"), rope.get("partial_rotary_factor"))
                    if p is not None and float(p) != 1.0), None)
    if partial is not None:
        raise CheckpointError(f"{source}: phi3 partial_rotary_factor={partial} (RoPE on part of each head) "
                              "is not supported; infer rotates whole heads (1.0)")
    scaling = raw.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"{source}: phi3 rope_scaling type {kind!r} (LongRoPE: short and long factors "
                              "chosen by the sequence length) is not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: phi3 hidden_act {act!r} is not supported (silu)")
    return window_fields(raw, source)


def phi3_hf_fields(config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
    # Written as null: left out, transformers' Phi3Config default (32000, the released vocabulary's
    # padding id) is past the end of a smaller vocabulary, and its embedding refuses it.
    return {**out, "pad_token_id": None}


FAMILY = ModelFamily("phi3", "Phi3ForCausalLM", Phi3ForCausalLM, phi3_fields, hf_fields=phi3_hf_fields,
                     packed_modules=PACKED_MODULES)
