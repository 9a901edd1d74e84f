"""EAGLE-style autoregressive draft heads: one decoder layer that reads its own drafts.

Medusa heads guess token ``t + k`` from one hidden state, each without knowing what the
heads before it guessed. An EAGLE head drafts sequentially on the target's features: a
*pair* at position ``p`` is the target's final (normed) hidden state ``f_p`` together with
the token ``x_{p+1}`` that followed it; the head fuses the two (``fc``: ``[2H] -> [H]``),
runs **one decoder layer** over them with its own KV cache, and predicts ``f_{p+1}``
(through the target's frozen final norm), whose projection by the target's frozen
``lm_head`` scores the token ``x_{p+2}``. To draft deeper it feeds its own predicted
feature together with the token it drafted.

The decoder layer is transformers' own class for the target's architecture, built from a
copy of the target's config with one (full-attention) layer: no modeling code is forked.
The target's embeddings, final norm, rotary embedding and ``lm_head`` are held by
reference, outside the module's parameters: they are neither trained, saved nor moved.

Two layouts (``HeadsConfig.eagle_layout``):

* ``norms`` (folders written before layouts existed): the layer keeps its input norm, and
  its output goes through the target's final norm, so predicted features land in the
  target's (normed) feature space whatever the layer's scale.
* ``eagle1``: vLLM's EAGLE-1 Llama drafter (``vllm/model_executor/models/llama_eagle.py``):
  the layer's input norm is dropped (the fused pair enters attention as it is) and there is
  no final norm: the layer's output, the residual stream, is both what ``lm_head`` scores
  and the next draft step's feature. ``scripts/export_heads.py --to vllm`` writes these for
  vLLM's ``"method": "eagle"``; the fusion's input order differs there (token first), which
  the export permutes.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from medusa.errors import MedusaError
from medusa.models.heads_config import HeadsConfig, checked_draft_vocab
from medusa.runtime import gemv
from medusa.runtime import hf as kv
from medusa.runtime.int8 import Int8Rows, int8_available, int8_linears
from medusa.runtime.kernels import gemv_copy
from medusa.runtime.ngrams import NgramTable


def _layer_config(target: PreTrainedModel):
    """The target's text config, cut to one full-attention layer."""
    cfg = copy.deepcopy(target.config.get_text_config())
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"]
    cfg.use_cache = True
    return cfg


class OnTarget:
    """What every autoregressive head has: the target it drafts for, held by reference
    (``_target``, outside the module's parameters), and its number of trained draft steps."""

    _target: tuple[PreTrainedModel, ...]
    config: HeadsConfig

    @property
    def target(self) -> PreTrainedModel:
        return self._target[0]

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def describe(self) -> str:
        """What these heads are, in a few words (the chat's banner)."""
        return f"eagle ({self.config.eagle_layout}), {self.config.num_heads} draft steps trained"

    def forget_calibration(self) -> None:
        """Drop the sizes calibrated for other weights (after training: recalibrate)."""
        self.dynamic, self.measured = {}, {}


class EagleHeads(OnTarget, nn.Module):
    """An autoregressive draft head over a target's features (see the module docstring).

    ``config.num_heads`` is how many draft steps the head was trained to unroll.
    """

    kind = "eagle"
    one_call = "fused"  # medusa/runtime/drafter.py's C call: fc fuses the pair, then a stock layer

    def __init__(self, config: HeadsConfig, target: PreTrainedModel) -> None:
        super().__init__()
        if config.kind != "eagle":
            raise MedusaError(f"EagleHeads need a config of kind 'eagle', got {config.kind!r}")
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)  # [f_p ; embed(x_{p+1})] -> H
        decoder = target.get_decoder()
        self.layer = type(decoder.layers[0])(_layer_config(target), layer_idx=0)
        if self.eagle1:
            if not isinstance(getattr(self.layer, "input_layernorm", None), nn.Module):
                raise MedusaError(f"{type(self.layer).__name__} has no input_layernorm to drop: "
                                  "eagle_layout eagle1 needs a Llama-style decoder layer; use eagle_layout norms")
            self.layer.input_layernorm = nn.Identity()  # the fused pair enters attention un-normed
        self._target: tuple[PreTrainedModel, ...] = ()
        self.draft_vocab: torch.Tensor | None = None
        self._draft_weight: torch.Tensor | None = None
        self.int8 = False  # drafting on int8 copies of the weights (:meth:`to_int8`)
        self._draft_int8: tuple[torch.Tensor, Int8Rows] | None = None  # the draft vocabulary's rows, as int8
        self._draft_gemv: tuple[torch.Tensor, torch.Tensor] | None = None  # and packed for the gemv kernels
        # Calibrated dynamic-tree sizes by device type: {"cpu": {"nodes": N, "depth": D, "topk": k}}.
        self.dynamic: dict[str, dict[str, int]] = {}
        # What calibration measured per device and dtype (calibration.json's "measured"): the
        # teacher-forced acceptance curves medusa/autotune/sizing.py sizes trees from on any machine.
        self.measured: dict[str, dict] = {}
        # The folder's n-gram table of the target's answers (mode hybrid's chain where the text has no match).
        self.ngrams: NgramTable | None = None
        self.bind(target)

    # -- wiring -------------------------------------------------------------------------
    def bind(self, target: PreTrainedModel) -> EagleHeads:
        weight = target.get_output_embeddings().weight
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise MedusaError(
                f"eagle heads expect a target with vocab {self.config.vocab_size} x hidden {self.config.hidden_size}, "
                f"but its lm_head is {tuple(weight.shape)[0]} x {tuple(weight.shape)[1]}: use heads trained for this model"
            )
        self._target = (target,)
        decoder = target.get_decoder()
        rope = decoder.rotary_emb
        self._rope_by_type = "layer_type" in inspect.signature(rope.forward).parameters  # Gemma 3: one per layer type
        return self

    @property
    def eagle1(self) -> bool:
        """vLLM's EAGLE-1 layout: no input norm on the layer, no final norm."""
        return self.config.eagle_layout == "eagle1"

    def init_random(self, std: float = 0.02) -> EagleHeads:
        """Start the draft layer at its class's own default initialisation (what constructing
        it gives) and the fusion ``fc`` small and random (normal, ``std``)."""
        with torch.no_grad():
            self.fc.weight.normal_(std=std)
        return self

    def init_from_target(self) -> EagleHeads:
        """Start the draft layer as a copy of the target's last decoder layer (same shapes),
        and the fusion as "take the feature". It first predicts ``x_{p+1}`` again (held-out KL
        ~23 at step 0) but still trains faster than :meth:`init_random` on the embedded model
        (docs/experiments.md#initialisation: after 50 steps held-out depth-1 top-1 0.072 against 0.033).

        ``eagle1`` (no input norm, no final norm) adapts the copy to the missing norms: the
        input norm's weights are folded into the attention's q/k/v projections, divided by
        the RMS a normed feature has (that of the final norm's weights), so attention first
        sees about what the last layer saw; and the attention and MLP output projections start
        at zero, so the output (the residual stream, scored as it is) starts as exactly the
        fused input, i.e. the feature. A plain copy would add the last layer's raw outputs,
        which on SmolLM2 are ~17x the normed feature (that layer cancels a residual stream
        of RMS ~36 down to ~2), to the feature with no final norm to scale them back."""
        decoder = self.target.get_decoder()
        last = decoder.layers[-1]
        state = last.state_dict()
        if self.eagle1:
            del state["input_layernorm.weight"]
            self.layer.load_state_dict(state)
            attn, mlp = self.layer.self_attn, self.layer.mlp
            w = attn.q_proj.weight
            with torch.no_grad():
                # the target's norms run on its device; the head may still be elsewhere (built on
                # the CPU beside a CUDA target), so the scale moves to the head's weights after
                ones = torch.ones(1, self.config.hidden_size, dtype=w.dtype, device=decoder.norm.weight.device)
                feature_rms = decoder.norm(ones).float().pow(2).mean().sqrt()  # a normed feature's RMS
                scale = (last.input_layernorm(ones)[0].float() / feature_rms).to(w.device, w.dtype)  # [H]
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.weight.mul_(scale[None, :])  # W diag(input norm weight) / RMS
                attn.o_proj.weight.zero_()
                mlp.down_proj.weight.zero_()
        else:
            self.layer.load_state_dict(state)
        h = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :h].copy_(torch.eye(h))
            self.fc.weight[:, h:].normal_(std=0.02)
        return self

    def init_from_target_with_token(self) -> EagleHeads:
        """As :meth:`init_from_target`, but ``fc`` adds the token's embedding scaled to the
        feature's size (the final norm's output for a unit-RMS input over the mean embedding
        row's norm) instead of a small random share: the normed feature is ~14x the embedding
        on SmolLM2, which otherwise hides the token ``x_{p+1}`` (what the head knows beyond a
        Medusa head). Measured on 50 steps only (docs/experiments.md#initialisation)."""
        self.init_from_target()
        h = self.config.hidden_size
        norm = self.target.get_decoder().norm
        emb = self.target.get_input_embeddings().weight
        with torch.no_grad():
            feature = norm(torch.ones(1, h, dtype=emb.dtype, device=emb.device)).float().norm()
            scale = (feature / emb.float().norm(dim=-1).mean()).item()
            self.fc.weight[:, h:].copy_(torch.eye(h) * scale)
        return self

    def set_draft_vocab(self, ids: torch.Tensor | list[int] | None) -> None:
        """Score drafts over these token ids only (see ``MedusaHeads.set_draft_vocab``)."""
        device = self.target.get_output_embeddings().weight.device
        self.draft_vocab, self._draft_weight = checked_draft_vocab(ids, self.config.vocab_size, device), None

    def to_int8(self) -> EagleHeads:
        """Draft on int8 weights (``medusa.load(draft_dtype="int8")``, CPU only): the head runs
        in bfloat16 and its linears and the draft vocabulary's rows multiply through int8 copies
        with one scale per row (:func:`medusa.runtime.int8.int8_linears`). Drafts only
        propose, so the target's output is unchanged; the float weights stay for saving."""
        device = self.fc.weight.device
        if not int8_available(device):
            raise MedusaError(f"int8 drafting needs a CPU torch build with torch._weight_int8pack_mm, not "
                              f"{device.type} here: use draft_dtype='bfloat16'")
        self.to(torch.bfloat16)
        try:
            int8_linears(self)
        except ValueError as err:
            raise MedusaError(f"these eagle heads cannot draft on int8 weights: {err}; use draft_dtype='bfloat16'") from None
        self.int8, self._draft_int8 = True, None
        return self

    # -- compute ------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: Cache,
                mask: torch.Tensor) -> torch.Tensor:
        """One pass over ``T`` pairs: ``features`` ``[T, H]`` (``f_p``), ``tokens`` ``[T]``
        (``x_{p+1}``), ``positions`` ``[T]`` (``p``), appended to ``cache``; ``mask`` is the
        additive ``[1, 1, T, past + T]`` attention mask. Returns predicted ``f_{p+1}`` ``[T, H]``."""
        target = self.target
        emb = target.get_input_embeddings()(tokens).to(self.fc.weight.dtype)  # [T, H]
        x = self.fc(torch.cat([features.to(emb.dtype), emb], dim=-1))[None]  # [1, T, H]
        pos = positions[None]
        rope = target.get_decoder().rotary_emb
        cos_sin = rope(x, pos, "full_attention") if self._rope_by_type else rope(x, pos)
        out = self.layer(x, attention_mask=mask.to(x.dtype), position_ids=pos, use_cache=True,
                         position_embeddings=cos_sin, **kv.cache_kwarg(self.layer.forward, cache))
        out = out[0] if isinstance(out, tuple) else out
        if self.eagle1:
            return out[0]  # [T, H]: the residual stream, scored and fed back as it is
        return target.get_decoder().norm(out)[0]  # [T, H]: in the target's feature space

    def logits(self, features: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., H] -> [..., V]`` (``[..., S]`` over the ids ``vocab``; the draft vocabulary's
        rows are cached in the head's own dtype, so bfloat16 heads beside a float32 target score
        in bfloat16; where the target's product runs the gemv kernels, those rows do too, packed
        once, with float32 sums) through the target's frozen ``lm_head``."""
        lm_head = self.target.get_output_embeddings()
        if vocab is None:
            return lm_head(features.to(lm_head.weight.dtype))
        if vocab is self.draft_vocab:
            w, dtype = self._draft_weight, self.fc.weight.dtype  # the rows in the head's own dtype
            if w is None or w.device != lm_head.weight.device or w.dtype != dtype:
                self.draft_vocab = vocab = vocab.to(lm_head.weight.device)
                w = self._draft_weight = lm_head.weight[vocab].to(dtype).contiguous()  # [S, H]
            if self.int8:
                if self._draft_int8 is None or self._draft_int8[0] is not w:
                    self._draft_int8 = (w, Int8Rows.of(w))
                return self._draft_int8[1].matmul(features)
            # the target's product runs gemv now (and nothing trains through it: the kernels have no backward)
            if w.device.type == "cpu" and not torch.is_grad_enabled() and gemv_copy(lm_head, 1) is not None:
                if self._draft_gemv is None or self._draft_gemv[0] is not w:
                    self._draft_gemv = (w, gemv.pack(w))  # the rows' product on the same kernels
                return gemv.product(features, self._draft_gemv[1], w.shape[0])
        else:
            w = lm_head.weight[vocab]
        return features.to(w.dtype) @ w.T


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T, K]`` bool (True: attend) -> ``[1, 1, T, K]`` additive mask (0 or dtype-min)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


EAGLE_INITS = ("random", "last_layer", "last_layer_token")


def init_eagle_for(target: PreTrainedModel, num_steps: int = 4, base_model: str | None = None,
                   init: str = "last_layer", layout: str = "norms") -> EagleHeads:
    """Fresh eagle heads sized for ``target``: ``init="random"`` (the layer's default
    initialisation, ``fc`` small random) or ``"last_layer"`` (a copy of the target's last
    decoder layer, ``fc`` = take the feature; see :meth:`EagleHeads.init_from_target`).
    ``layout``: ``"norms"`` or ``"eagle1"`` (vLLM's EAGLE-1; see the module docstring)."""
    if init not in EAGLE_INITS:
        raise MedusaError(f"eagle init must be one of {', '.join(EAGLE_INITS)}, got {init!r}")
    vocab, hidden = target.get_output_embeddings().weight.shape
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_steps, num_layers=1, kind="eagle",
                         base_model=base_model, eagle_layout=layout)
    heads = EagleHeads(config, target)
    heads = {"random": heads.init_random, "last_layer": heads.init_from_target,
             "last_layer_token": heads.init_from_target_with_token}[init]()
    w = target.get_output_embeddings().weight
    return heads.to(device=w.device, dtype=w.dtype)
