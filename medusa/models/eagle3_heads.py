"""EAGLE-3 draft heads: a low, a middle and a high layer of the target fused, its own vocabulary.

Where an EAGLE-1 head (:mod:`medusa.models.eagle_heads`) reads the target's *last* feature,
an EAGLE-3 head reads the residual stream entering ``L`` of the target's layers
(``feature_layers``, by default vLLM's choice for Llama: 2, the middle and the third from
last), concatenated ``[L*H]`` and fused by ``fc`` (``L*H -> H``). It drafts token by token:

* a *pair* at position ``p`` is a feature ``g_p`` (``fc`` of the target's layers there, or,
  drafting deeper, the head's own output at the position before) and the token ``x_{p+1}``;
* its one decoder layer normalises both (``input_layernorm`` on the token's embedding,
  ``hidden_norm`` on ``g_p``), attends over their concatenation ``[2H]`` (q, k and v read
  ``2H``), adds the attention to ``g_p``, then an MLP block: the output ``h_p`` (pre-norm)
  is the next draft step's feature, and ``lm_head(norm(h_p))`` scores ``x_{p+2}`` over the
  head's **own draft vocabulary** of ``S`` tokens (``d2t``: draft id ``i`` is target token
  ``i + d2t[i]``).

Training unrolls the head on its own outputs over ``num_heads`` steps (training-time test,
:mod:`medusa.training.eagle3_ttt`) with a token loss only. The parameter names and the
layer's arithmetic are vLLM's ``Eagle3LlamaForCausalLM`` (``vllm/model_executor/models/
llama_eagle3.py``), so ``scripts/export_heads.py --to vllm`` writes the weights as they are.
The attention, MLP, norms and rotary embedding are transformers' Llama classes on a one-layer
Llama config cut from the target's shapes: no modeling code is forked. The target's token
embedding is held by reference (frozen, not saved), as vLLM shares it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from medusa.errors import MedusaError
from medusa.models.eagle_heads import OnTarget
from medusa.models.heads_config import HeadsConfig
from medusa.runtime import hf as kv
from medusa.runtime.ngrams import NgramTable


def default_feature_layers(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 layers for a target of ``num_layers`` layers: 2, the middle, the third from last."""
    if num_layers < 4:
        return list(range(num_layers))[-2:] if num_layers >= 2 else [0, 0]
    return sorted({2, num_layers // 2, num_layers - 3})


def drafter_config(target: PreTrainedModel, draft_vocab_size: int, overrides: dict | None = None) -> LlamaConfig:
    """A one-layer Llama config with the target's widths (hidden, heads, head size, MLP, norm
    epsilon, rotary base): the drafter vLLM builds from the exported ``config.json``. ``overrides``
    (``HeadsConfig.draft_layer``: published heads whose layer is not the target's shape) replace
    those settings key by key."""
    t = target.config.get_text_config()
    heads = t.num_attention_heads
    rope = getattr(t, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "full_attention" in rope:  # Gemma 3: one per layer type
        rope = rope["full_attention"]
    theta = float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))) if isinstance(rope, dict) else 10000.0
    config = LlamaConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(t, "max_position_embeddings", 2048), vocab_size=t.vocab_size,
        rope_parameters={"rope_type": "default", "rope_theta": theta}, attention_bias=False, mlp_bias=False,
        hidden_act="silu", tie_word_embeddings=False, attn_implementation="sdpa")
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


class Eagle3Layer(nn.Module):
    """vLLM's EAGLE-3 decoder layer (its first and only layer): attention over ``[embed ; feature]``."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.norm_before_residual = norm_before_residual  # see HeadsConfig.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        a = self.self_attn
        for name, out in (("q_proj", a.q_proj.out_features), ("k_proj", a.k_proj.out_features),
                          ("v_proj", a.v_proj.out_features)):
            setattr(a, name, nn.Linear(2 * h, out, bias=config.attention_bias))
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, cos_sin, mask: torch.Tensor,
                cache: Cache | None) -> torch.Tensor:
        normed = self.hidden_norm(feature)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        attn, _ = self.self_attn(x, position_embeddings=cos_sin, attention_mask=mask,
                                 **kv.cache_kwarg(self.self_attn.forward, cache))
        residual = (normed if self.norm_before_residual else feature) + attn
        return residual + self.mlp(self.post_attention_layernorm(residual))  # the pre-norm output


class FusedDrafter(OnTarget, nn.Module):
    """What heads over the target's fused layers share (EAGLE-3's, and the block drafter's in
    :mod:`medusa.models.block_heads`): the ``feature_layers`` checked against the target, ``fc``
    (``L*H -> H``), the final norm, ``lm_head`` over the heads' own draft vocabulary with its
    ``d2t`` id map, the rotary embedding, the target held by reference, and the calibration
    fields the loader fills. Subclasses add their layers in ``__init__`` and then ``bind``."""

    kind = ""

    def _fused_init(self, config: HeadsConfig, target: PreTrainedModel) -> None:
        if config.kind != self.kind:
            raise MedusaError(f"{type(self).__name__} need a config of kind {self.kind!r}, got {config.kind!r}")
        self.config = config
        layers = target.config.get_text_config().num_hidden_layers
        bad = [i for i in config.feature_layers if not 0 <= i < layers]
        if bad:
            raise MedusaError(f"{self.kind} feature_layers {bad} are not layers of this {layers}-layer target: "
                              f"use heads trained for this model (layers 0..{layers - 1})")
        h, s = config.hidden_size, config.draft_vocab_size
        self.layer_config = drafter_config(target, s, config.draft_layer)
        self.fc = nn.Linear(len(config.feature_layers) * h, h, bias=False)
        self.norm = LlamaRMSNorm(h, eps=self.layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(h, s, bias=False)
        self.register_buffer("d2t", torch.zeros(s, dtype=torch.long))  # draft id i -> target id i + d2t[i]
        self.rotary = LlamaRotaryEmbedding(self.layer_config)
        self._target: tuple[PreTrainedModel, ...] = ()
        self._ids: tuple[torch.Tensor | None] | None = None  # draft_vocab, once read from d2t (None: not yet)
        self.register_load_state_dict_post_hook(lambda module, keys: module._forget_ids())
        self.dynamic: dict[str, dict[str, int]] = {}  # calibrated sizes (calibration.json), as EagleHeads
        self.measured: dict[str, dict] = {}
        self.ngrams: NgramTable | None = None  # the loader sets a folder's n-gram table here
        self.int8 = False

    # -- wiring -------------------------------------------------------------------------
    def bind(self, target: PreTrainedModel) -> FusedDrafter:
        weight = target.get_input_embeddings().weight
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise MedusaError(
                f"{self.kind} heads expect a target with vocab {self.config.vocab_size} x hidden {self.config.hidden_size}, "
                f"but its embedding is {tuple(weight.shape)[0]} x {tuple(weight.shape)[1]}: use heads trained for this model")
        self._target = (target,)
        return self

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    def set_vocab(self, ids: torch.Tensor) -> None:
        """Make ``ids`` (``[S]`` target token ids, sorted) the draft vocabulary: ``d2t`` and
        ``lm_head`` rows (copied from the target's output embedding, a good start)."""
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.d2t.device)
        if ids.numel() != self.config.draft_vocab_size:
            raise MedusaError(f"a draft vocabulary of {ids.numel()} ids for heads of draft_vocab_size "
                              f"{self.config.draft_vocab_size}: pass as many ids as the heads' lm_head has rows")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
            w = self.target.get_output_embeddings().weight
            self.lm_head.weight.copy_(w[ids.to(w.device)].to(self.lm_head.weight))
        self._forget_ids()

    def set_draft_vocab(self, ids) -> None:
        """A calibration's draft vocabulary does not apply: the head's vocabulary is its own ``lm_head``."""

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """``[S]`` the target ids of the draft vocabulary, on ``d2t``'s device (None: the whole
        vocabulary in order). Read from ``d2t`` once (one device sync), again after it changes."""
        if self._ids is None:
            identity = self.config.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any())
            self._ids = (None if identity else torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t,)
        return self._ids[0]

    def _forget_ids(self) -> None:
        self._ids = None

    def _apply(self, fn, *args, **kwargs):  # .to()/.cuda(): the id map follows, the rotary stays float32
        out = super()._apply(fn, *args, **kwargs)
        rotary = self.rotary
        rotary.inv_freq = rotary.original_inv_freq.to(device=rotary.inv_freq.device, dtype=torch.float32)
        self._forget_ids()
        return out



class Eagle3Heads(FusedDrafter):
    """An EAGLE-3 draft head over a target (see the module docstring).

    ``config.num_heads`` is how many steps training unrolled; ``config.feature_layers`` the
    target layers whose inputs are fused; ``config.draft_vocab_size`` the rows of ``lm_head``."""

    kind = "eagle3"
    one_call = "wide"  # medusa/runtime/drafter.py's C call: the layer reads [embedding ; feature]

    def __init__(self, config: HeadsConfig, target: PreTrainedModel) -> None:
        super().__init__()
        self._fused_init(config, target)
        self.layers = nn.ModuleList([Eagle3Layer(self.layer_config, config.norm_before_residual)])
        self.bind(target)

    def describe(self) -> str:
        """What these heads are, in a few words (the chat's banner)."""
        c = self.config
        return (f"eagle3 (layers {', '.join(map(str, c.feature_layers))}, {c.draft_vocab_size:,}-token draft "
                f"vocabulary), {c.num_heads} draft steps trained")

    # -- compute ------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., L*H]`` target features -> ``[..., H]``; the head's own outputs (``[..., H]``) pass."""
        if features.shape[-1] == self.config.hidden_size:
            return features.to(self.fc.weight.dtype)
        return self.fc(features.to(self.fc.weight.dtype))

    def step(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: Cache | None,
             mask: torch.Tensor) -> torch.Tensor:
        """Batched: ``features`` ``[B, T, L*H or H]``, ``tokens`` ``[B, T]`` (``x_{p+1}``),
        ``positions`` ``[B, T]``, ``mask`` additive ``[B or 1, 1, T, past + T]``. Returns the
        pre-norm outputs ``[B, T, H]`` (the next step's features)."""
        g = self.fuse(features)
        emb = self.target.get_input_embeddings()(tokens).to(g.dtype)
        cos_sin = self.rotary(g, positions)
        return self.layers[0](emb, g, cos_sin, mask.to(g.dtype), cache)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: Cache,
                mask: torch.Tensor) -> torch.Tensor:
        """EagleHeads' interface (one sequence): ``[T, L*H or H]``, ``[T]``, ``[T]`` -> ``[T, H]``."""
        return self.step(features[None], tokens[None], positions[None], cache, mask)[0]

    def logits(self, features: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., H] -> [..., S]``: the draft vocabulary's scores (``vocab`` is ignored: it is
        always the head's own, :attr:`draft_vocab` maps them to target ids)."""
        return self.lm_head(self.norm(features.to(self.lm_head.weight.dtype)))

    def to_int8(self) -> Eagle3Heads:
        raise MedusaError("eagle3 heads draft in float32 or bfloat16: use draft_dtype='bfloat16' (int8 is for eagle heads)")


def fused_config(target: PreTrainedModel, kind: str, num_heads: int, num_layers: int, vocab: torch.Tensor | None,
                 feature_layers: list[int] | None, base_model: str | None) -> tuple[HeadsConfig, torch.Tensor]:
    """The config of fresh heads of ``kind`` over ``target``'s fused layers (default: vLLM's
    picks), and their draft vocabulary as sorted target ids (``vocab``; None: all)."""
    v, h = target.get_output_embeddings().weight.shape
    layers = feature_layers or default_feature_layers(target.config.get_text_config().num_hidden_layers)
    if len(layers) < 2:
        raise MedusaError(f"{kind} heads fuse at least two target layers, got feature_layers {layers}")
    ids = torch.arange(v) if vocab is None else torch.as_tensor(vocab, dtype=torch.long).unique()
    config = HeadsConfig(hidden_size=h, vocab_size=v, num_heads=num_heads, num_layers=num_layers, kind=kind,
                         base_model=base_model, feature_layers=list(layers), draft_vocab_size=int(ids.numel()))
    return config, ids


def init_eagle3_for(target: PreTrainedModel, num_steps: int = 7, vocab: torch.Tensor | None = None,
                    feature_layers: list[int] | None = None, base_model: str | None = None) -> Eagle3Heads:
    """Fresh EAGLE-3 heads for ``target``: the layer at its default initialisation, ``fc``
    small random, ``lm_head`` the target's rows of ``vocab`` (sorted target ids; None: all)."""
    emb = target.get_output_embeddings().weight
    config, ids = fused_config(target, "eagle3", num_steps, 1, vocab, feature_layers, base_model)
    heads = Eagle3Heads(config, target)
    with torch.no_grad():
        heads.fc.weight.normal_(std=0.02)
    heads = heads.to(device=emb.device, dtype=emb.dtype)
    heads.set_vocab(ids)
    return heads
