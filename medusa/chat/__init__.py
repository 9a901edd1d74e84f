"""The interactive chat's library (``python -m infer.chat``): its session, what it prepares
before the first message, and its banner."""
