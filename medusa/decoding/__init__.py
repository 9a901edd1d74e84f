"""Decoding: the engine loop, proposers, tree buffers, acceptance rules and the target pass."""

# The one default answer length: the engine, the bench and the chat take it from here.
MAX_NEW_TOKENS = 256
