"""Decoding: the engine loop, proposers, tree buffers and acceptance rules (the target pass
itself is medusa.runtime.hf)."""

# The one default answer length: the engine, the bench and the chat take it from here.
MAX_NEW_TOKENS = 256
