"""make_proposer: the proposer for a mode name, and the per-mode settings (ProposerConfig)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from medusa.decoding.proposers.autoregressive import Autoregressive
from medusa.decoding.proposers.draft_model import DraftModel
from medusa.decoding.proposers.eagle import DynamicTree
from medusa.decoding.proposers.hybrid import Hybrid
from medusa.decoding.proposers.lookahead import LookaheadProposer, LookaheadSize, size_lookahead
from medusa.decoding.proposers.lookup import MATCH_TOKENS, PromptLookup
from medusa.decoding.state import Proposer
from medusa.errors import MedusaError
from medusa.models.heads import MedusaHeads
from medusa.models.kinds import KINDS, REGISTRY, kind

DRAFT_WINDOW = 512  # ProposerConfig.draft_window's default


def _lookahead(device: torch.device, config: ProposerConfig, size, max_rows: int | None) -> Proposer:
    """Mode lookahead: ``size`` (sized for the machine) or the device's default, then the config's W, N, G."""
    size = size or size_lookahead(None, device.type, max_rows)
    asked = {"window": config.lookahead_window, "ngram": config.lookahead_ngram, "guesses": config.lookahead_guesses}
    if any(v is not None for v in asked.values()):
        size = LookaheadSize(**{k: getattr(size, k) if v is None else v for k, v in asked.items()}, reason="as set")
    return LookaheadProposer(device, size, text=config.lookahead_text)


MODES = ("baseline", *KINDS, "draft", "lookup", "hybrid", "lookahead")
HEADS_MODES = KINDS  # the modes named after a heads kind (each needs heads of it)
LOOKUP_TOKENS = 8  # tokens a lookup chain copies after a match, unless set or sized


@dataclass(frozen=True)
class ProposerConfig:
    """The per-mode settings, in one place: the engine, ``medusa.load``, the bench and the
    chat take their defaults from here."""

    draft_tokens: int = 4  # mode "draft": tokens drafted per step
    adaptive_draft: bool = False  # grow/shrink draft_tokens per step by acceptance
    # > 0: end a draft chain after a token the draft gave less probability (0.4: transformers' default)
    draft_confidence: float = 0.4
    # modes "lookup"/"hybrid": tokens copied after a match (None: LOOKUP_TOKENS, or for hybrid with
    # eagle or block heads the chain length sized with their tree for this device, medusa/autotune/sizing.py)
    lookup_tokens: int | None = None
    lookup_ngram: int = 3  # longest n-gram looked up
    # mode hybrid: where the text has no match, draft the chain from the heads folder's n-gram
    # table of the target's answers (medusa/runtime/ngrams.py), if it has one
    answer_ngrams: bool = True
    # mode lookahead: window columns W, n-gram size N, n-grams verified per pass G (None: sized
    # for this machine, medusa/decoding/proposers/lookahead.py), and whether the text's n-grams join the pool
    lookahead_window: int | None = None
    lookahead_ngram: int | None = None
    lookahead_guesses: int | None = None
    lookahead_text: bool = True
    # mode hybrid: also run lookahead's window and verify its pool's n-grams in the same pass
    hybrid_lookahead: bool = False
    # sampled requests (lossless): heads draw their candidates from their own processed
    # distribution (medusa/decoding/proposers/drawn.py), as many per depth as the plan sized at the
    # request's temperature (None; one where nothing was calibrated), or this many at each depth
    # it sized; 0: their deterministic top-k tree, verified as point masses
    draw: int | None = None
    # EAGLE heads: the accepted pairs their own cache keeps and attends to, a sliding window
    # (None: the whole context). Bounded by default: the drafting's cost stays flat in the context,
    # and heads trained on short chats accept more with it on long prompts
    # (docs/benchmarks/2026-12-05-epyc-zen4-draft-window-fixed.md)
    draft_window: int | None = DRAFT_WINDOW
    # a greedy sequence decoding alone decodes plainly while its drafts keep fewer tokens than
    # their drafting and rows cost, as its own steps measure (medusa/decoding/payoff.py)
    check_drafting: bool = True
    # modes "lookup"/"hybrid" where the plan timed this machine's passes and lookup_tokens is not
    # set: each step's chain as long as its match's length has paid for in the answer so far, up to
    # MATCH_TOKENS (medusa/decoding/proposers/lookup.py: MatchChains); False: the fixed or sized length
    match_chains: bool = True

    def chain(self, sized: int | None = None) -> int:
        """The lookup chain's length: as set, else ``sized`` (a hybrid tree's), else LOOKUP_TOKENS."""
        return self.lookup_tokens or sized or LOOKUP_TOKENS


def _heads_proposer(heads, device: torch.device, config: ProposerConfig, paths: list[tuple[int, ...]] | None,
                    size: DynamicTree | None, dtype: torch.dtype, hybrid: bool) -> tuple[Proposer, int]:
    """The heads' own proposer, built as the registry names it (Medusa's static tree, EAGLE's
    dynamic tree, the block's chain), and the lookup chain's length mode hybrid puts beside it
    (0: none, as sized)."""
    guessed = kind(heads.config.kind).proposer_class().for_heads(heads, device, size=size, paths=paths, dtype=dtype,
                                                                hybrid=hybrid, draw=1 if config.draw is None else config.draw,
                                                                window=config.draft_window)
    sized = getattr(guessed, "size", None)  # a proposal sized per step (a static tree has none)
    if not isinstance(sized, DynamicTree):
        return guessed, config.chain()
    chain = config.chain(sized.chain)
    return guessed, 0 if hybrid and sized.chain == 0 and not config.lookup_tokens else chain


def _lookup(device: torch.device, config: ProposerConfig, chain: int, costs, table=None) -> PromptLookup:
    """Prompt lookup with ``chain``-token chains, or where ``costs`` (the plan's pass costs) are
    known and the chain is neither set nor turned off, chains sized per match up to MATCH_TOKENS."""
    matched = costs if config.match_chains and not config.lookup_tokens and costs is not None else None
    return PromptLookup(device, num_tokens=MATCH_TOKENS if matched else chain, max_ngram=config.lookup_ngram,
                        table=table, costs=matched)


def _hybrid(guessed: Proposer, chain: int, heads, device: torch.device, config: ProposerConfig,
            lookahead: LookaheadSize | None, max_rows: int | None, costs) -> Hybrid:
    """Mode hybrid: the heads' proposer ``guessed`` beside a lookup chain (``chain`` tokens as
    sized, per context length where the heads' size says), and lookahead's part if asked."""
    table = heads.ngrams if config.answer_ngrams else None
    jacobi = _lookahead(device, config, lookahead, max_rows) if config.hybrid_lookahead else None
    lookup = _lookup(device, config, chain, costs, table)
    sized = getattr(guessed, "size", None)  # eagle and block heads: their chain per context length
    chain_at = None
    if not config.lookup_tokens and isinstance(sized, DynamicTree) and sized.longer:
        def chain_at(length: int, sized: DynamicTree = sized) -> int:
            here = sized.at(length).chain
            return chain if here is None else min(here, chain)
    return Hybrid(guessed, lookup, device, lookahead=jacobi, chain_at=chain_at)


def _sampled(mode: str, size: DynamicTree | None, heads, device: torch.device,
             dtype: torch.dtype) -> DynamicTree | None:
    """Mode hybrid's size for EAGLE heads' sampled requests (``size``, else mode eagle's calibrated
    one); other modes draft them at their own size, Medusa and block heads at their drawn depths."""
    if mode != "hybrid" or not hasattr(heads, "dynamic"):
        return None
    return size or DynamicTree.for_device(heads.dynamic, device, dtype)


def make_proposer(
    mode: str,
    device: torch.device,
    config: ProposerConfig,
    heads: MedusaHeads | None = None,
    paths: list[tuple[int, ...]] | None = None,
    draft: PreTrainedModel | None = None,
    dtype: torch.dtype = torch.float32,
    size=None,
    max_rows: int | None = None,
    lookahead: LookaheadSize | None = None,
    sampled_size: DynamicTree | None = None,
    by_temperature: tuple = (),
    costs=None,
) -> Proposer:
    """The proposer for a mode name; ``paths`` is the heads' tree (modes medusa and hybrid);
    ``dtype`` the target's (eagle heads take the dynamic tree calibrated for it, or ``size``,
    a :class:`~medusa.decoding.proposers.eagle.DynamicTree`, with mode hybrid's lookup chain; block heads
    take one too, their chain and siblings, :mod:`medusa.decoding.proposers.block`; mode
    lookahead a :class:`~medusa.decoding.proposers.lookahead.LookaheadSize`, else its default for the
    device within ``max_rows``, the rows a pass may verify; ``lookahead``: the W, N, G mode hybrid's
    lookahead part takes when ``config.hybrid_lookahead`` asks for it, sized like mode lookahead's;
    ``sampled_size``: mode hybrid's EAGLE heads draft sampled requests at this size, mode eagle's
    (None: the size calibrated for mode eagle), :meth:`~medusa.decoding.proposers.eagle.EagleProposer.sample_with`); ``by_temperature``:
    the heads' drawn chains sized per calibrated temperature (medusa/autotune/drawn.py), which
    come first for sampled requests in the heads' own mode and in hybrid; ``costs``: the plan's pass
    costs (a :class:`~medusa.decoding.payoff.Curves`), which lookup chains are sized with per match
    (``config.match_chains``; None: not timed, chains of a fixed length)."""
    if mode == "baseline":
        return Autoregressive(device)
    if mode == "lookahead":
        return _lookahead(device, config, size, max_rows)
    if mode in REGISTRY or mode == "hybrid":  # a kind registered after import too
        if heads is None:
            raise MedusaError(f"mode {mode!r} needs heads: load with heads=FOLDER (or heads='init' for untrained ones)")
        loaded = heads.config.kind
        if mode not in kind(loaded).modes:
            raise MedusaError(f"mode {mode!r} needs {mode} heads, but the loaded heads are {loaded} heads: "
                              f"use mode={loaded!r} (or 'hybrid'), or load {mode} heads")
        guessed, chain = _heads_proposer(heads, device, config, paths, size, dtype, hybrid=mode == "hybrid")
        if config.draw != 0 and hasattr(guessed, "sample_with"):  # sampled requests' drawn chains
            guessed.sample_with(_sampled(mode, sampled_size, heads, device, dtype), by_temperature)
        if mode != "hybrid" or chain == 0:
            return guessed  # chain 0: sized without a lookup chain, its rows cost more than it adds here
        return _hybrid(guessed, chain, heads, device, config, lookahead, max_rows, costs)
    if mode == "draft":
        if draft is None:
            raise MedusaError("mode 'draft' needs a draft model: load with draft=FOLDER_OR_HUB_ID (or draft='default')")
        return DraftModel(draft, device, num_tokens=config.draft_tokens, adaptive=config.adaptive_draft,
                          max_tokens=max(16, config.draft_tokens), confidence=config.draft_confidence)
    if mode == "lookup":
        return _lookup(device, config, config.chain(), costs)
    known = dict.fromkeys((*MODES, *REGISTRY))
    raise MedusaError(f"unknown mode {mode!r}: use one of {', '.join(known)}")
