"""Proposers: what drafts the candidate tree the target verifies.

Every decoding mode is one proposer behind the same engine loop:

* ``Autoregressive`` - no candidates, the root alone (plain decoding, the baseline);
* ``MedusaProposer`` - the heads' top-k laid out by a static tree;
* ``DraftModel`` - a small causal LM drafting a chain token by token;
* ``PromptLookup`` - a chain copied from where the latest n-gram occurred before;
* ``EagleProposer`` / ``BlockProposer`` - EAGLE heads' dynamic tree, block heads' one-pass
  chain (:mod:`medusa.decoding.proposers.eagle`, :mod:`medusa.decoding.proposers.block`);
* ``Hybrid`` - the heads' tree and the lookup chain side by side in one tree
  (:mod:`medusa.decoding.proposers.hybrid`);
* ``LookaheadProposer`` - n-grams from the target's own Jacobi iterations
  (:mod:`medusa.decoding.proposers.lookahead`).

One file each; :mod:`~medusa.decoding.proposers.factory` builds the one a mode names.
A proposer answers ``propose(state) -> Proposal`` and hears the outcome through
``update(state, outcome)``; it keeps whatever state it needs (a draft model's cache, an
n-gram index) to itself.
"""
