"""The speculators format (vLLM's ``vllm serve FOLDER`` for a draft): EAGLE-3 and Medusa heads'
configs and tensors, built from vLLM's own layouts (:mod:`medusa.hub.export`), which it extends
with a ``speculators_config`` block naming the verifier and the proposal method."""

from __future__ import annotations

from typing import Any

import torch

from medusa.models.heads_config import HeadsConfig


def block(algorithm: str, steps: int, verifier: dict[str, Any] | None) -> dict[str, Any]:
    """The ``speculators_config`` block: vLLM serves the folder as a draft of
    ``verifier.name_or_path`` proposing ``speculative_tokens`` per step."""
    verifier = verifier or {}
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier.get("name_or_path"), "architectures": list(verifier.get("architectures") or [])}}


def eagle3_config(config: HeadsConfig, layer: dict[str, Any], dtype: torch.dtype,
                  verifier: dict[str, Any] | None) -> dict[str, Any]:
    """speculators' ``Eagle3SpeculatorConfig``: the drafter's one-layer Llama config ``layer``
    (vLLM's own EAGLE-3 config) as ``transformer_layer_config`` (``vocab_size`` the target's),
    every norm flag written out."""
    keep = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias", "mlp_bias",
            "rope_parameters", "rope_theta", "rope_scaling", "num_hidden_layers", "tie_word_embeddings", "dtype")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {k: layer[k] for k in keep if k in layer},
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,  # vLLM takes true when it is missing
        "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "target_hidden_size": None,  # the draft is as wide as the target
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "embed_requires_grad": False,
        "speculators_config": block("eagle3", config.num_heads, verifier),
        "dtype": str(dtype).removeprefix("torch."),
    }


def eagle3_state(config: HeadsConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's EAGLE-3 tensors (speculators' names are theirs) with ``t2d``, the ``[V]`` mask of the
    draft vocabulary, beside ``d2t``; both left out over the full vocabulary, as speculators does.
    No ``embed_tokens``: vLLM then shares the target's, which these heads embed with."""
    out = dict(tensors)
    if "d2t" in out:
        ids = torch.arange(config.draft_vocab_size) + out["d2t"].cpu()
        out["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return out


def medusa_config(config: HeadsConfig, dtype: torch.dtype, verifier: dict[str, Any] | None) -> dict[str, Any]:
    """speculators' ``MedusaSpeculatorConfig``."""
    return {
        "architectures": ["MedusaModel"],
        "speculators_model_type": "medusa",
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "medusa_hidden_size": config.hidden_size,
        "medusa_vocab_size": config.vocab_size,
        "truncated_vocab_size": 0,
        "original_lm_head": config.projection == "shared",
        "medusa_fc_bias": True,  # our residual blocks have biases
        "speculators_config": block("medusa", config.num_heads, verifier),
        "dtype": str(dtype).removeprefix("torch."),
    }
