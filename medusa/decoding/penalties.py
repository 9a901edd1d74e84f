"""What a request changes in the target's distribution before each token is chosen: OpenAI's
``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and ``min_tokens`` (vLLM's meaning of
each). Verification chooses from the adjusted logits, so greedy output is the argmax of the
adjusted distribution and sampled output follows it exactly; drafting is unchanged (a draft is
only a guess).

Inside a tree a node's row is scored with the tokens of its own path: the row after node ``i``
counts the answer so far plus every drafted token on the way to ``i`` (``ancestor`` of the tree),
and sits ``depth[i]`` tokens further into the answer (for ``min_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.decoding.tree import TreeBuffers
from medusa.errors import MedusaError

PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's bounds for presence and frequency penalties
BIAS_RANGE = (-100.0, 100.0)


@dataclass(frozen=True)
class Penalties:
    """``presence``: subtracted from the logit of every token the answer holds; ``frequency``:
    subtracted once per occurrence; ``bias``: ``(token, value)`` pairs added to the logits;
    ``min_tokens``: the ``eos`` tokens cannot be chosen before that many tokens were emitted.
    Only the answer's tokens count, not the prompt's."""

    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    eos: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise MedusaError(f"{name}_penalty must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], got {value}")
        for token, value in self.bias:
            if not BIAS_RANGE[0] <= value <= BIAS_RANGE[1]:
                raise MedusaError(f"logit_bias of token {token} must be in [-100, 100], got {value}")
        if self.min_tokens < 0:
            raise MedusaError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.bias or (self.min_tokens and self.eos))

    def apply(self, logits: torch.Tensor, answer: list[int], tree: TreeBuffers | None = None,
              tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` ``[N, V]`` after each node of ``tree`` (one row and no tree: after the last
        token of ``answer``), adjusted; ``answer``: the tokens emitted so far (the root last);
        ``tokens`` ``[N]``: the nodes' tokens, root first."""
        out = logits.clone()
        n, vocab = out.shape
        device = out.device
        if self.bias:
            ids = torch.tensor([t for t, _ in self.bias], device=device)
            out[:, ids] += torch.tensor([v for _, v in self.bias], device=device, dtype=out.dtype)
        if self.presence or self.frequency:
            counts = torch.bincount(torch.tensor(answer, dtype=torch.long, device=device), minlength=vocab)
            counts = counts.to(out.dtype).expand(n, vocab)  # [N, V]
            if tree is not None and n > 1:  # each row also counts the drafted tokens on its path
                drafted = torch.zeros(n, vocab, dtype=out.dtype, device=device)
                drafted[torch.arange(1, n, device=device), tokens[1:]] = 1  # the root is in the answer already
                counts = counts + tree.ancestor[:n, :n].to(out.dtype) @ drafted
            out -= self.frequency * counts + self.presence * (counts > 0).to(out.dtype)
        if self.min_tokens and self.eos:
            depth = tree.depth[:n] if tree is not None else torch.zeros(n, dtype=torch.long, device=device)
            early = (len(answer) + depth.to(device)) < self.min_tokens  # [N] rows that choose a token too soon
            out[early.nonzero().view(-1)[:, None], torch.tensor(self.eos, device=device)[None, :]] = float("-inf")
        return out
