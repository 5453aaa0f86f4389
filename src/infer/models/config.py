"""Model configuration read from a Hugging Face ``config.json``, and the families that read it.

``ModelConfig.from_dict`` reads the fields every decoder shares; what one architecture adds (its own
fields and refusals, how it writes back, its checkpoint's tensor names) is its ``ModelFamily``,
declared in its ``models/<family>.py`` and registered in ``models/__init__.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from infer.models.layers import DecoderOnlyLM

SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types values


class CheckpointError(ValueError):
    """A model folder that cannot be loaded; the message names the file and the problem."""


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    # Sliding-window attention: ``layer_types[i]`` is SLIDING (attends to the last ``sliding_window``
    # positions, its own included) or FULL; None with a window means every layer slides (Mistral).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers when it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    hidden_act: str = "silu"

    def layer_window(self, index: int) -> int | None:
        """How many positions layer ``index`` attends to (its own included); None: all of them."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[index] == SLIDING:
            return self.sliding_window
        return None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        family = _FAMILIES.get(raw.get("model_type"))  # type: ignore[arg-type]
        if family is None:
            archs = raw.get("architectures")
            raise CheckpointError(
                f"{source}: unsupported model_type {raw.get('model_type')!r} (architectures={archs}); "
                f"infer supports {', '.join(supported_model_types())}"
            )
        if family.unwrap is not None:
            raw = family.unwrap(raw)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers >= 5 nests RoPE settings under rope_parameters; older files use top-level keys.
            rope = dict(raw.get("rope_parameters") or {})
            rope_scaling = raw.get("rope_scaling") or None
            if rope_scaling is None and rope.get("rope_type", "default") != "default":
                rope_scaling = rope
            attention_bias = bool(raw.get("attention_bias", False))
            common: dict[str, Any] = dict(
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=attention_bias,  # Llama's attention_bias covers o_proj too
                o_bias=attention_bias,
            )
            common.update(family.fields(raw, source))  # the family's own fields, and its overrides of these
            return cls(
                model_type=family.model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                eos_token_ids=_as_id_list(raw.get("eos_token_id")),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                **common,
            )
        except KeyError as missing:
            raise CheckpointError(f"{source}: required field {missing.args[0]!r} is missing") from None

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        if not path.is_file():
            raise CheckpointError(f"{path}: config.json not found (is this a Hugging Face model folder?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path}: not valid JSON ({err})") from None
        return cls.from_dict(raw, str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that both infer and transformers load (used when saving trained models)."""
        family = model_family(self.model_type)
        out: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": family.hf_model_type or self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "torch_dtype": self.torch_dtype or "float32",
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        return out if family.hf_fields is None else family.hf_fields(self, out)


FieldsParser = Callable[[dict[str, Any], str], dict[str, Any]]


def window_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A Mistral-style ``sliding_window`` (every layer): the fields a family without its own parser reads."""
    window = raw.get("sliding_window")
    return {} if window is None else {"sliding_window": positive_int(window, "sliding_window", source)}


@dataclass(frozen=True)
class ModelFamily:
    """What one architecture declares, in its ``models/<family>.py``, beyond the fields every decoder
    shares: registered with ``register_families`` (``models/__init__.py``), it is all ``ModelConfig``
    and the loader need to know of it.

    ``fields`` reads the family's own ``ModelConfig`` fields from the raw config.json (and refuses
    what it cannot run, naming the field); what it returns overrides the common reading. ``aliases``:
    other config.json ``model_type`` spellings of it. ``unwrap``: the raw config a wrapping one nests
    (a multimodal checkpoint's text model). ``hf_fields``: ``to_hf_dict``'s dict made the family's.
    ``tensor_name``: a checkpoint tensor's name under the model's modules ("" for one not read).
    ``packed_modules``: a fused checkpoint projection and the modules it stacks, in order (Phi-3's
    ``qkv_proj``: ``q_proj``, ``k_proj``, ``v_proj``); the loader splits it along its rows by the
    sizes the architecture gives those modules, and ``pack_state`` stacks them back for saving.
    ``gguf_fields``: the config.json fields a GGUF file of the family gives beyond the common ones,
    from ``meta(suffix)`` (the file's ``<architecture>.<suffix>`` value, None where absent) and the
    hidden size, heads and head size the common reading found.
    """

    model_type: str
    architecture: str  # the Hugging Face class name to_hf_dict writes
    model_class: type[DecoderOnlyLM]
    fields: FieldsParser = window_fields
    aliases: tuple[str, ...] = ()
    hf_model_type: str | None = None  # the model_type to_hf_dict writes, where it is not model_type
    unwrap: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    hf_fields: Callable[[ModelConfig, dict[str, Any]], dict[str, Any]] | None = None
    tensor_name: Callable[[str], str] | None = None
    packed_modules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    gguf_fields: Callable[[Callable[[str], Any], int, int, int], dict[str, Any]] | None = None

    def pack_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the model's module names) with each packed group stacked back into the checkpoint's
        fused tensor, as the family's checkpoints store it."""
        out = dict(state)
        for fused, parts in self.packed_modules.items():
            for name in [n for n in state if _leaf_module(n)[1] == parts[0]]:
                parent, _, param = _leaf_module(name)
                names = [f"{parent}.{part}.{param}" for part in parts]
                out[f"{parent}.{fused}.{param}"] = torch.cat([out.pop(n) for n in names])
        return out


def _leaf_module(name: str) -> tuple[str, str, str]:
    """``a.b.qkv_proj.weight`` -> (``a.b``, ``qkv_proj``, ``weight``)."""
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    return parent, leaf, param


def split_packed(name: str, packed: Mapping[str, tuple[str, ...]]) -> list[str] | None:
    """The module tensors a packed checkpoint tensor ``name`` stacks (``packed_modules``), or None."""
    parent, leaf, param = _leaf_module(name)
    parts = packed.get(leaf)
    return None if parts is None else [f"{parent}.{part}.{param}" for part in parts]


_FAMILIES: dict[str, ModelFamily] = {}  # by model_type and by each alias


def register_families(*families: ModelFamily) -> tuple[ModelFamily, ...]:
    for family in families:
        for name in (family.model_type, *family.aliases):
            _FAMILIES[name] = family
    return families


def model_family(model_type: str) -> ModelFamily:
    """The registered family of ``model_type`` (a ``ModelConfig``'s, aliases resolved)."""
    family = _FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError(f"unsupported model_type {model_type!r}; infer supports {', '.join(supported_model_types())}")
    return family


def supported_model_types() -> tuple[str, ...]:
    """The registered families' model_type names, in registration order."""
    return tuple(dict.fromkeys(f.model_type for f in _FAMILIES.values()))


def whole(value: float | None) -> float | int | None:
    return int(value) if value is not None and float(value).is_integer() else value


def positive_int(value: Any, name: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{source}: {name} must be a positive integer, got {value!r}")
    return value


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
