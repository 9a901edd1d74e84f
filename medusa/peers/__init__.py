"""The peers the bench runs beside the engine: vLLM and llama.cpp (each in a venv of its own,
behind a JSON-lines worker), llama.cpp's server, and the embedded target as an F32 GGUF file."""
