"""A heads kind that lives in the tests alone: its heads, proposer and training hooks, and its one
registry entry (:data:`KIND`). tests/test_kinds.py registers it and runs it through the loader,
the engine's modes, sizing and a training step, so a new kind stays one entry plus its own files.

The heads draft a chain: a linear map of the root's hidden state, scored by the target's lm_head,
repeated ``num_heads`` times. Their guesses are poor; verification keeps the output exact.
"""

from __future__ import annotations

import torch
from torch import nn

from medusa.decoding.proposers.eagle import DynamicTree
from medusa.decoding.state import DecodeState, HeadsProposer, Proposal, StepOutcome
from medusa.decoding.tree import chain, compile_tree
from medusa.errors import MedusaError
from medusa.models.heads_config import HeadsConfig
from medusa.models.kinds import Kind


class MockHeads(nn.Module):
    kind = "mock"

    def __init__(self, config: HeadsConfig, target: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.hidden_size, config.hidden_size)
        self._target = (target,)
        self.dynamic: dict = {}
        self.measured: dict = {}
        self.trees: dict = {}
        self.ngrams = None
        self.int8 = False
        self.draft_vocab = None

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def describe(self) -> str:
        return f"mock chain of {self.config.num_heads} tokens"

    def forget_calibration(self) -> None:
        self.dynamic, self.measured = {}, {}

    def chain(self, hidden: torch.Tensor, depth: int) -> list[int]:
        """``depth`` drafted tokens from ``hidden`` ``[H]``."""
        head = self._target[0].get_output_embeddings()
        tokens, x = [], hidden.to(self.fc.weight.dtype)
        for _ in range(depth):
            x = self.fc(x)
            tokens.append(int(head(x.to(head.weight.dtype)).argmax()))
        return tokens


class MockProposer(HeadsProposer):
    def __init__(self, heads: MockHeads, device: torch.device, size: DynamicTree) -> None:
        self.heads, self.device, self.size = heads, device, size
        self.max_rows = 1 + size.nodes

    @classmethod
    def for_heads(cls, heads, device, *, size=None, paths=None, dtype=torch.float32, hybrid=False,
                  draw=1, window=None) -> MockProposer:
        k = heads.config.num_heads
        return cls(heads, device, size or DynamicTree(nodes=k, depth=k, topk=1))

    @staticmethod
    def shape(depth: int, topk: int) -> DynamicTree:
        return DynamicTree(nodes=depth, depth=depth, topk=1)

    @staticmethod
    def deepest(heads) -> int:
        return heads.config.num_heads

    def propose(self, state: DecodeState) -> Proposal:
        n = self.size.at(state.length).depth
        if state.budget is not None:
            n = min(n, state.budget - 1)  # the root's token is verified too
        drafted = self.heads.chain(state.hidden, n) if n > 0 else []
        tokens = torch.tensor([int(state.root), *drafted], device=self.device)
        return Proposal(tree=compile_tree(chain(len(drafted))).to(self.device), tokens=tokens, is_chain=True)

    def update(self, state: DecodeState, outcome: StepOutcome) -> None:
        return None

    def describe(self) -> str:
        return f"mock chain of {self.size.depth}"


# training hooks (medusa.models.kinds.TRAINING_HOOKS)
def fresh_heads(target, cfg, vocab) -> MockHeads:
    hidden = target.get_output_embeddings().weight.shape[1]
    config = HeadsConfig(hidden_size=hidden, vocab_size=target.get_output_embeddings().weight.shape[0],
                         num_heads=cfg.num_heads, kind="mock")
    return MockHeads(config, target)


def loss(heads, target, batch, cfg, weights, vocab):
    """Next-token cross-entropy of the first drafted token from the target's hidden states."""
    hidden, labels = batch
    logits = target.get_output_embeddings()(heads.fc(hidden))
    value = nn.functional.cross_entropy(logits, labels)
    return value, {"tokens": labels.numel()}


def cached_batches(cache, cfg, device):
    raise MedusaError("mock heads train from sequences, not from a feature cache")


KIND = Kind("mock", "a test-only kind: a chain drafted by a linear map", heads="mock_kind:MockHeads",
            proposer="mock_kind:MockProposer", fresh_heads="mock_kind:fresh_heads", loss="mock_kind:loss",
            cached_batches="mock_kind:cached_batches", own_modules=("mock_kind",), drafts_per_step=True,
            on_target=True)
