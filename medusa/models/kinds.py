"""The heads kinds, one registry: what each kind is, as data.

Code that behaves differently per kind asks :func:`kind` (``kind(cfg.kind).drafts_per_step``)
instead of comparing the kind's name. A kind's implementation is named by dotted path and
imported only when asked for (:meth:`Kind.heads_class`), so this module imports nothing heavy
and ties no other module to it. Adding a kind starts with an entry in :data:`REGISTRY`
(CONTRIBUTING.md lists the other files it touches).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from medusa.errors import MedusaError


@dataclass(frozen=True)
class Kind:
    """One heads kind's facts."""

    name: str  # the ``kind`` a heads folder's config.json names, and the mode that runs it alone
    summary: str  # one line: what the heads are
    heads: str  # "module:Class" of the heads, built from a HeadsConfig
    # "module:Class" of its proposer (medusa.decoding), a HeadsProposer: every kind's is built by
    # Class.for_heads(heads, device, size=, paths=, dtype=, hybrid=) (proposers/factory.py, sizing)
    proposer: str
    # its training hooks, "module:function" in its own training module (medusa.training), which
    # training/heads_task.py calls (see TRAINING_HOOKS for their signatures):
    fresh_heads: str  # new heads for a target: (target, cfg, vocab) -> heads
    loss: str  # one micro-batch's loss: (heads, target, batch, cfg, weights, vocab) -> (loss, counts)
    cached_batches: str  # micro-batches read from a feature cache: (cache, cfg, device) -> Batches
    # the modules that are this kind's alone (they may compare its name); the others ask this registry
    own_modules: tuple[str, ...] = ()
    # over several target layers fused (``feature_layers``), with its own lm_head over a draft
    # vocabulary (``draft_vocab_size``): training reads a frozen target's layers
    fused: bool = False
    # drafts autoregressively, growing a dynamic tree per step (EAGLE-1/2 and EAGLE-3)
    dynamic_tree: bool = False
    # drafts its proposal per step (not a static tree): sized per device (medusa/autotune/sizing.py)
    drafts_per_step: bool = False
    # built on its target (holds it by reference; the loader needs the target to build it)
    on_target: bool = False
    # trained on a frozen target's feature cache only (no lora, cache_dir needed)
    cache_only: bool = False
    # trained on blocks of tokens from sampled anchors (block_anchors, block_decay)
    block_trained: bool = False
    int8: bool = False  # may draft on int8 weights (draft_dtype int8: its linears and draft vocabulary)
    layers: tuple[int, ...] | None = None  # the decoder layers (num_layers) it may have; None: any
    # the HeadsConfig fields only this kind writes to config.json (other kinds drop them)
    own_fields: tuple[str, ...] = ()
    # the published layouts it exports to (medusa/hub/export.py), the default first; () none
    exports: tuple[str, ...] = ()

    @property
    def modes(self) -> tuple[str, ...]:
        """The engine modes that run these heads: its own name, and hybrid (beside a lookup chain)."""
        return (self.name, "hybrid")

    @property
    def sized(self) -> bool:
        """Sized for the machine (trees or proposals measured per device): the kinds that draft per step."""
        return self.drafts_per_step

    def heads_class(self) -> type:
        """The class of these heads, imported now."""
        return named(self.heads)

    def proposer_class(self) -> type:
        """The class of its proposer (a ``HeadsProposer``), imported now."""
        return named(self.proposer)


# The fields naming a kind's training hooks, and the parameters each one takes (cfg: a
# TrainConfig; vocab: the training vocabulary subset, None: all; weights: per-head loss weights).
TRAINING_HOOKS = {
    "fresh_heads": ("target", "cfg", "vocab"),
    "loss": ("heads", "target", "batch", "cfg", "weights", "vocab"),
    "cached_batches": ("cache", "cfg", "device"),
}


def named(dotted: str):
    """The object a ``"module:name"`` path names, its module imported now."""
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


REGISTRY: dict[str, Kind] = {k.name: k for k in (
    Kind("medusa", "independent heads, one per future token, over a static tree",
         heads="medusa.models.heads:MedusaHeads", proposer="medusa.decoding.proposers.medusa:MedusaProposer",
         fresh_heads="medusa.training.medusa_train:fresh_heads", loss="medusa.training.medusa_train:batch_loss",
         cached_batches="medusa.training.medusa_train:cached_batches",
         own_modules=("medusa.models.heads", "medusa.training.medusa_train"),
         exports=("vllm", "speculators", "fasterdecoding")),  # vllm first: vLLM serves no speculators medusa folder
    Kind("eagle", "one autoregressive decoder layer over the target's last feature",
         heads="medusa.models.eagle_heads:EagleHeads", proposer="medusa.decoding.proposers.eagle:EagleProposer",
         fresh_heads="medusa.training.eagle_ttt:fresh_heads", loss="medusa.training.eagle_ttt:batch_loss",
         cached_batches="medusa.training.eagle_ttt:cached_batches",
         own_modules=("medusa.models.eagle_heads", "medusa.decoding.proposers.eagle", "medusa.training.eagle_ttt"),
         dynamic_tree=True, drafts_per_step=True,
         on_target=True, cache_only=True, int8=True, own_fields=("eagle_layout", "fc_bias"), exports=("vllm",)),
    Kind("eagle3", "one decoder layer over several target layers fused, with its own vocabulary",
         heads="medusa.models.eagle3_heads:Eagle3Heads", proposer="medusa.decoding.proposers.eagle:EagleProposer",
         fresh_heads="medusa.training.eagle3_ttt:fresh_heads", loss="medusa.training.eagle3_ttt:batch_loss",
         cached_batches="medusa.training.eagle3_ttt:cached_batches",
         own_modules=("medusa.models.eagle3_heads", "medusa.training.eagle3_ttt"),
         fused=True, dynamic_tree=True, drafts_per_step=True,
         on_target=True, own_fields=("feature_layers", "draft_vocab_size", "norm_before_residual", "draft_layer"),
         exports=("speculators", "vllm")),
    Kind("block", "a block of num_heads tokens drafted in one pass over fused layers",
         heads="medusa.models.block_heads:BlockHeads", proposer="medusa.decoding.proposers.block:BlockProposer",
         fresh_heads="medusa.training.block_train:fresh_heads", loss="medusa.training.block_train:batch_loss",
         cached_batches="medusa.training.eagle3_ttt:cached_batches",  # the cache EAGLE-3 heads of its layers use
         own_modules=("medusa.models.block_heads", "medusa.decoding.proposers.block", "medusa.training.block_train"),
         fused=True, drafts_per_step=True, on_target=True,
         block_trained=True, layers=(1, 2), own_fields=("feature_layers", "draft_vocab_size")),
)}
KINDS = tuple(REGISTRY)  # every kind's name, in registry order
# the HeadsConfig fields of one kind or a few (Kind.own_fields), in registry order: other kinds drop them
KIND_FIELDS = tuple(dict.fromkeys(f for k in REGISTRY.values() for f in k.own_fields))


def kind(name: str) -> Kind:
    """The registered kind called ``name``; one line naming the known kinds otherwise."""
    found = REGISTRY.get(name)
    if found is None:
        raise MedusaError(f"unknown heads kind {name!r}: use one of {', '.join(KINDS)}")
    return found


def kinds_where(fact: str) -> tuple[str, ...]:
    """The names of the kinds whose ``fact`` (a :class:`Kind` field or property) is true."""
    return tuple(k.name for k in REGISTRY.values() if getattr(k, fact))
