"""Classic speculative decoding: a small causal LM drafts a chain token by token."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from medusa.decoding.sampling import probabilities, sample
from medusa.decoding.state import DecodeState, Proposal, Proposer, StepOutcome
from medusa.decoding.tree import TreeBuffers, chain_tree
from medusa.errors import MedusaError
from medusa.models.target import context_window
from medusa.runtime import hf as kv


class DraftModel(Proposer):
    """Classic speculative decoding: a small causal LM drafts ``k`` tokens one by one.

    The draft keeps its own KV cache of ``cached`` tokens, always a prefix of the
    sequence. Each step it runs whatever the target emitted since (the root, plus the
    last draft token when the whole chain was accepted), then drafts ``k`` tokens; the
    ``k``-th is never fed, so after the target accepts ``m`` of them the draft cache is
    cropped to the sequence's common prefix and stays exact. When the state samples
    (``state.sampling`` not greedy) each token is drawn from ``q``, the draft's
    distribution processed like the target's (temperature, top-k, top-p), with the
    state's generator, and the ``q`` rows go to the verifier for lossless rejection
    sampling; at temperature 0 the draft is greedy. ``adaptive`` grows ``k`` by 2
    after a fully accepted chain and shrinks it by 1 after a rejection, within
    ``[1, max_tokens]``. ``confidence`` > 0 ends a chain early after a token the draft
    itself gave less than that probability (a likely rejection: drafting past it is
    mostly wasted work); it costs one host sync per draft token.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        num_tokens: int = 4,
        adaptive: bool = False,
        max_tokens: int = 16,
        confidence: float = 0.0,
    ) -> None:
        if num_tokens < 1 or max_tokens < num_tokens:
            raise MedusaError(f"draft tokens need 1 <= num_tokens <= max_tokens, got {num_tokens} and {max_tokens}")
        self.model = model
        self.device = device
        self.k = num_tokens
        self.adaptive = adaptive
        self.max_tokens = max_tokens
        self.confidence = confidence
        self.window = context_window(model)
        self.trees: dict[int, TreeBuffers] = {}
        self.cache = kv.new_cache()
        self.cached: list[int] = []  # the tokens whose KV entries are in ``cache``
        self.pending: torch.Tensor | None = None  # [k - 1] draft tokens fed in the last propose
        self.drafted = 0  # chain length of the last proposal

    @property
    def max_rows(self) -> int:
        return 1 + (self.max_tokens if self.adaptive else self.k)

    @property
    def min_rows(self) -> int:
        return 1 if self.adaptive else 1 + self.k

    def describe(self) -> str:
        how = f"up to {self.max_tokens}, fewer when unsure" if self.adaptive else f"{self.k}"
        return f"draft model chain ({how} tokens)"

    def begin(self, state: DecodeState) -> None:
        self.cache = kv.new_cache()
        self.cached = []
        self.pending = None

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Proposal:
        n, total = len(self.cached), len(state.tokens)
        # The draft writes positions n .. total + k - 2; stay inside its context window, and
        # draft no more than the token budget can still emit.
        k = state.max_depth(self.k if self.window is None else min(self.k, self.window - total + 1))
        if k < 1:
            self.drafted = 0
            self.pending = None
            return Proposal(tree=chain_tree(self.trees, 0, self.device), tokens=state.root.view(1), is_chain=True)
        ids = torch.tensor([state.tokens[n:]], device=self.device)  # [1, total - n]
        pos = torch.arange(n, total, device=self.device)[None]
        drafted: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            logits, _ = kv.forward(self.model, ids, pos, self.cache, None, logits_rows=slice(-1, None))  # [1, V]
            if state.sampling.greedy:
                token = logits[0].argmax()
                q = torch.softmax(logits[0], dim=-1) if self.confidence > 0 else None  # [V]
            else:
                q = probabilities(logits[0], state.sampling)  # [V] the draft's processed distribution
                token = sample(q, state.generator)
                rows.append(q)
            drafted.append(token)
            if i + 1 == k or (self.confidence > 0 and float(q[token]) < self.confidence):
                break
            ids, pos = token.view(1, 1), pos[:, -1:] + 1
        chain_tokens = torch.stack(drafted)  # [k'], k' <= k
        k = self.drafted = len(drafted)
        self.pending = chain_tokens[:-1]
        self.cached.extend(state.tokens[n:])
        q_rows = None
        if rows:
            q_rows = torch.cat([torch.zeros_like(rows[0])[None], torch.stack(rows)])  # [k + 1, V], row 0 unused
        tokens = torch.cat([state.root.view(1), chain_tokens])  # [k + 1]
        return Proposal(tree=chain_tree(self.trees, k, self.device), tokens=tokens, q=q_rows, is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        # What the draft cache holds beyond the old prefix: the fed draft tokens. Keep the
        # part the target agreed with, drop the rest.
        n = len(self.cached)
        if self.pending is not None:
            self.cached.extend(self.pending.tolist())
            self.pending = None
        keep = n
        while keep < len(self.cached) and keep < len(state.tokens) and self.cached[keep] == state.tokens[keep]:
            keep += 1
        del self.cached[keep:]
        kv.crop(self.cache, keep)
        if self.adaptive and self.drafted:
            accepted = len(outcome.tokens) - 1
            self.k = min(self.k + 2, self.max_tokens) if accepted >= self.drafted else max(self.k - 1, 1)
