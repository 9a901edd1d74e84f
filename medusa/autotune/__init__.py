"""Autotune: what this machine measures, above decoding because it times the engine's own
passes: the target's pass cost (timing), the dtype and linear kernels (device), tree sizes
(sizing) and offline tree calibration (trees)."""
