"""Building the speculative runner: the drafter named by the config, and the budget controller for it.

The engine hands over explicit pieces (the target model and its config, tokenizer, device, dtype,
and how to make a KV pool for a model); drafters never see the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.backends import backend_of, count_weights
from infer.cache.protocol import CachePoolProtocol
from infer.core.model_runner import ModelRunner
from infer.engine.config import SpeculativeConfig
from infer.engine.continuous_runner import ContinuousRunner
from infer.engine.speculative_runner import SpeculativeRunner
from infer.loader import Tokenizer, load_model, load_tokenizer
from infer.loader.quantized import bytes_read_ratio, quantize_draft_head
from infer.models.config import ModelConfig
from infer.models.layers import DecoderOnlyLM
from infer.speculative.budget import BudgetController, EntropyStop
from infer.speculative.drafter import Drafter, NoDrafter


@dataclass
class TargetModel:
    """What a drafter may need to know about the target."""

    path: str
    model: DecoderOnlyLM
    config: ModelConfig
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    make_pool: Callable[[ModelConfig], CachePoolProtocol]  # a KV pool like the target's, for another model
    compile: bool = False  # compiled mode: a draft model is compiled like the target
    backend: str = "auto"  # the backend asked for (infer.backends): a draft model runs on the same
    cuda_graphs: bool = False  # the target's passes replay as CUDA graphs: a draft model's steps do too
    max_batch_size: int = 1  # the most sequences a pass holds (the graphs' largest batch)


def make_speculative_runner(spec: SpeculativeConfig | None, target_runner: ContinuousRunner, target: TargetModel,
                            say: Callable[[str], None], grammar_drafting: bool = False) -> SpeculativeRunner:
    """The runner for ``spec``'s drafter; without a speculator (``spec`` None) one whose rounds draft
    only what a request's grammar forces (``grammar_drafting``)."""
    if spec is None:
        # Never asked for a budget (NoDrafter matches nothing); the controller still times the passes.
        return SpeculativeRunner(target_runner, NoDrafter(), BudgetController(1), grammar_drafting=grammar_drafting)
    drafter = make_drafter(spec, target, say)
    return SpeculativeRunner(target_runner, drafter, make_budget(spec, drafter), grammar_drafting=grammar_drafting)


def make_drafter(spec: SpeculativeConfig, target: TargetModel, say: Callable[[str], None]) -> Drafter:
    """The drafter ``spec.speculator`` names."""
    if spec.speculator == "ngram":
        from infer.speculative.ngram import NgramDrafter

        return NgramDrafter(spec.ngram_min, spec.ngram_max, target.device)
    if spec.speculator == "draft":
        from infer.speculative.draft_model import DraftModelDrafter, check_compatible

        assert spec.draft_model is not None
        say(f"loading draft model {spec.draft_model}")
        model, config = load_model(spec.draft_model, target.dtype, str(target.device), backend=target.backend,
                                   compile=target.compile, quantization=spec.draft_quantization,
                                   cuda_graphs=target.cuda_graphs, progress=say)
        say(f"draft model: {model.weights_summary}")
        check_compatible(spec.draft_model, target.path, config.vocab_size, target.config.vocab_size,
                         load_tokenizer(spec.draft_model, config), target.tokenizer)
        # Same backend and sequence length as the target; its own (smaller) per-token footprint.
        stop = EntropyStop(spec.spec_length_min, spec.entropy_threshold) if spec.spec_length_policy == "entropy" else None
        runner = ModelRunner(model, target.make_pool(config))
        # Its steps are one token each; the first of a round catches up on what the target accepted
        # (up to a verification's width).
        runner.graphs = backend_of(model).step_graphs(model, runner.pool, target.max_batch_size,
                                                      1 + spec.spec_length_limit, say)
        return DraftModelDrafter(runner, count_weights(model) / max(1, count_weights(target.model)), stop)
    if spec.speculator == "medusa":
        from infer.speculative.medusa import MedusaDrafter, load_medusa_heads, medusa_tree

        say(f"loading Medusa heads for {target.path}")
        heads = load_medusa_heads(spec.medusa_heads, target.path, target.config, target.dtype, target.device)
        tree = medusa_tree(heads.config, spec.medusa_tree_size)
        cost_hint = count_weights(heads) / max(1, count_weights(target.model))
        return MedusaDrafter(heads, tree, target.device, cost_hint, max_depth=spec.spec_length_limit,
                             packer=backend_of(target.model).head_packer(next(heads.parameters())))
    if spec.speculator == "eagle":
        from infer.engine.config import EAGLE_MAX_TREE
        from infer.speculative.eagle import EagleDrafter, load_eagle_head

        say(f"loading the EAGLE-3 head for {target.path}")
        head = load_eagle_head(spec.eagle_head, target.path, target.config, target.dtype, target.device)
        converted = quantize_draft_head(head, target.model)  # the target's quantized kernels, if it has them
        if converted:
            say(f"EAGLE-3 head: {converted} projections in Q8_0 on the quantized kernels")
        head.fuse()
        cost_hint = bytes_read_ratio(head, target.model)  # bytes read per step, not parameters
        return EagleDrafter(head, target.model.model.embed_tokens, target.device,
                            max_draft_tokens=spec.eagle_tree_size or EAGLE_MAX_TREE, max_depth=spec.spec_length_limit,
                            cost_hint=cost_hint)
    if spec.speculator == "suffix":
        from infer.speculative.suffix import SuffixDrafter

        return SuffixDrafter(spec.spec_length_limit, spec.suffix_tree_size, spec.suffix_max_match, spec.suffix_min_prob,
                              spec.suffix_max_tokens, spec.suffix_max_requests, spec.suffix_scope,
                              device=target.device)
    raise ValueError(f"unknown speculator {spec.speculator!r}")


def make_budget(spec: SpeculativeConfig, drafter: Drafter) -> BudgetController:
    """The budget controller for this drafter: a tree is sized by measurement unless its size is
    fixed; a chain drafts ``spec_length`` (fixed), up to ``spec_length_limit`` (entropy: the draft
    loop stops early), or what goodput picks in 0..``spec_length_limit``."""
    info = drafter.info
    if info.tree:
        assert info.max_draft_tokens is not None
        fixed = {"medusa": spec.medusa_tree_size, "eagle": spec.eagle_tree_size}.get(spec.speculator)
        return BudgetController(info.max_draft_tokens, adaptive=fixed is None, tree=True,
                                cost_per_token=info.cost_per_token, prior_cost=info.cost_hint)
    max_draft_tokens = spec.spec_length if spec.spec_length_policy == "fixed" else spec.spec_length_limit
    # A one-call drafter's probe costs two verification rows and no draft steps: it probes often, so a
    # request re-engages within a few tokens once its text starts repeating (copying comes in bursts).
    probe_every, max_probe_every = (16, 128) if info.cost_per_token else (4, 16)
    return BudgetController(max_draft_tokens, adaptive=spec.spec_length_policy == "goodput", cost_per_token=info.cost_per_token,
                            prior_cost=info.cost_hint, probe_every=probe_every, max_probe_every=max_probe_every)
