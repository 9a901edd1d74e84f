"""The bench behind ``python -m infer.bench``: decoding modes side by side, in one run, on the same
machine. It sits above ``medusa.api`` (it loads engines) and ``medusa.peers`` (vLLM, llama.cpp);
nothing else in ``medusa`` imports it.

- ``prompts``: the prompts files and their chat-formatted token ids.
- ``records``: ``Run`` (one mode on one prompt) and ``Bench`` (one run's settings and engines).
- ``runners``: the modes registered by name (``MODES``): transformers' ``generate`` as a user runs
  it and the peers (``vllm_peer``, ``llamacpp_peer``).
- ``modes``: mode names, ``BASE[@KIND][+lookahead][+compile][:KERNELS]`` for the engine's modes.
- ``engines``: the engines the modes run on, loaded once each through ``medusa.load``.
- ``timing``: warm-up and the timed runs, interleaved across modes.
- ``summary``: tokens/s, speedup, tau, identical outputs and step profiles; the printed table.
- ``report``: the results' meta, the --json file and the --output folder.
"""
