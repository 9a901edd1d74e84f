"""Autotune: what this machine measures, once, into the engine's plan (planner.py: the steps
``medusa.load`` runs; cache.py: the one cache file, plan.json). The probes: the target's pass
cost (timing), the dtype rule (dtype), linear kernels, exact rows and the heads' dtype (device),
tree sizes (sizing) and offline tree calibration (trees; calibration: its measurements and record)."""
