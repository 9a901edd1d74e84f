"""Block draft heads (``kind: block``): ``k`` tokens proposed in one drafter pass (DFlash-style).

An EAGLE-3 head (:mod:`medusa.models.eagle3_heads`) drafts token by token; a block head
drafts a whole block at once, reading the target's features as keys and values:

* **context**: the residual stream entering ``L`` target layers (``feature_layers``, as
  EAGLE-3's) at every *verified* position, ``[..., L*H]``, fused by ``fc`` (``L*H -> H``)
  and ``hidden_norm``: :meth:`BlockHeads.fuse`;
* **block**: with ``t`` the last verified position and ``x_{t+1}`` the token the target
  chose after it (the tree root), block position 0 holds the target's embedding of
  ``x_{t+1}`` at absolute position ``t+1``; positions ``1..k-1`` hold one learned
  ``mask_embedding`` at ``t+2..t+k``;
* ``num_layers`` Llama decoder layers (1 or 2). In each, queries come from the block rows;
  keys and values are ``[k_proj/v_proj(fused context) ; k_proj/v_proj(block rows)]``, rotary
  on absolute positions; block rows see every context position they are given and each
  other (no causal mask inside the block);
* ``lm_head(norm(h_i))`` at block position ``i`` scores ``x_{t+2+i}`` over the head's own
  **draft vocabulary** of ``S`` tokens (``d2t``: draft id ``j`` is target token ``j + d2t[j]``).

So one pass drafts ``x_{t+2} .. x_{t+k+1}`` (``k = config.num_heads = block_size``).

The contract the decoder codes against (shapes; ``Tc`` a context buffer's capacity):

* ``BlockHeads(config, target)`` / :func:`init_block_for` (as ``Eagle3Heads`` /
  ``init_eagle3_for``); folders load through :func:`medusa.models.loader.load_heads`;
* ``config.feature_layers``, :attr:`~BlockHeads.block_size`, :attr:`~BlockHeads.draft_vocab`
  (``[S]`` target ids, or None), ``d2t``;
* :meth:`~BlockHeads.fuse`: ``[..., L*H] -> [..., H]``;
* :meth:`~BlockHeads.context_kv`: ``fused [B, T, H]``, ``positions [B, T]`` -> per drafter
  layer ``(k, v)``, each ``[B, kv_heads, T, head_dim]``, rotary applied to ``k``. They depend
  on the context alone: the decoder computes them once per verified position;
* :meth:`~BlockHeads.draft`: ``root [B]``, ``root_position [B]`` (``t+1``), ``ctx`` (per layer
  ``[B, kv_heads, Tc, head_dim]``), ``ctx_valid [B, Tc]`` bool or None (all valid) ->
  ``[B, k, S]`` draft-vocabulary logits. Fixed shapes, no host sync, no branch on tensor
  values: capturable in a CUDA graph;
* :meth:`~BlockHeads.to_target`: draft ids -> target ids (no host sync);
* :meth:`~BlockHeads.train_logits`: ``fused [B, T, H]``, ``input_ids [B, T]``, ``anchors
  [B, A]`` (``t`` per block) -> ``[B, A, k, S]``; block ``a`` sees context ``<= t`` and its
  own rows only, all blocks in one attention call per layer.

The decoder layers, norms and rotary embedding are transformers' Llama classes on the
config EAGLE-3 heads are cut from (:func:`~medusa.models.eagle3_heads.drafter_config`); only
the attention's wiring (context keys next to the block's) is this module's. The target's
token embedding is held by reference (frozen, not saved), so Gemma's embedding scale applies
as the target applies it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    repeat_kv,
    rotate_half,
)

from medusa.errors import MedusaError
from medusa.models.eagle3_heads import FusedDrafter, fused_config
from medusa.models.heads_config import HeadsConfig
from medusa.runtime.kernels import gemv_copy

KV = list[tuple[torch.Tensor, torch.Tensor]]


class BlockHeads(FusedDrafter):
    """A block drafter over a target (see the module docstring); the fused features, the draft
    vocabulary and its wiring are EAGLE-3 heads' (:class:`~medusa.models.eagle3_heads.FusedDrafter`)."""

    kind = "block"

    def __init__(self, config: HeadsConfig, target: PreTrainedModel) -> None:
        super().__init__()
        self._fused_init(config, target)
        h = config.hidden_size
        self.layer_config.num_hidden_layers = config.num_layers
        self.hidden_norm = LlamaRMSNorm(h, eps=self.layer_config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))  # the input of block positions 1..k-1
        self.layers = nn.ModuleList([LlamaDecoderLayer(self.layer_config, layer_idx=i) for i in range(config.num_layers)])
        self.bind(target)

    def describe(self) -> str:
        """What these heads are, in a few words (the chat's banner)."""
        c = self.config
        return (f"block of {c.num_heads} tokens per drafter pass (layers {', '.join(map(str, c.feature_layers))}, "
                f"{c.draft_vocab_size:,}-token draft vocabulary)")

    @property
    def block_size(self) -> int:
        """``k``: the tokens one pass drafts (``x_{t+2} .. x_{t+k+1}``)."""
        return self.config.num_heads

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> target token ids, on the device (no sync)."""
        return draft_ids + self.d2t[draft_ids]

    # -- compute ------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., L*H]`` target features -> ``[..., H]`` context features."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> KV:
        """Per drafter layer, the keys (rotary at ``positions`` ``[B, T]``) and values of the
        fused context ``[B, T, H]``: ``([B, kv_heads, T, head_dim], same)``."""
        fused = fused.to(self.fc.weight.dtype)
        cos, sin = self.rotary(fused, positions)  # [B, T, head_dim]
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            shape = (*fused.shape[:2], -1, attn.head_dim)
            k = attn.k_proj(fused).view(shape).transpose(1, 2)  # [B, kv, T, d]
            v = attn.v_proj(fused).view(shape).transpose(1, 2)
            out.append((k * cos[:, None] + rotate_half(k) * sin[:, None], v))
        return out

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's own input embedding (Gemma's scale included), in the heads' dtype."""
        return self.target.get_input_embeddings()(tokens).to(self.fc.weight.dtype)

    def _attend(self, layer: LlamaDecoderLayer, h: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor] | list,
                cos_sin: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor | list) -> torch.Tensor:
        """One decoder layer over block rows ``h`` ``[B, n, H]``; keys/values are the context's
        ``[B, kv, Tc, d]`` then the rows' own; ``visible`` ``[B, 1, n or 1, Tc + n]`` bool. Or, for
        several sequences' own buffers (:meth:`draft_many`), ``ctx`` a list of ``B`` such pairs and
        ``visible`` of their masks, each ``[1, ...]``: the products over all rows, the attention
        per sequence, as it runs alone."""
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (*x.shape[:2], -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)  # [B, heads, n, d]
        k = attn.k_proj(x).view(shape).transpose(1, 2)  # [B, kv, n, d]
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        groups = attn.num_key_value_groups
        parts = [(ctx, visible, slice(None))] if isinstance(ctx[0], torch.Tensor) else [
            (c, m, slice(b, b + 1)) for b, (c, m) in enumerate(zip(ctx, visible))]
        out = torch.cat([F.scaled_dot_product_attention(
            q[at], repeat_kv(torch.cat([c[0], k[at]], dim=2), groups),  # [B, heads, Tc + n, d]
            repeat_kv(torch.cat([c[1], v[at]], dim=2), groups), attn_mask=m, scale=attn.scaling)
            for c, m, at in parts])  # [B, heads, n, d]
        h = h + attn.o_proj(out.transpose(1, 2).reshape(*h.shape[:2], -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _run(self, h: torch.Tensor, positions: torch.Tensor, ctx: KV | list, visible: torch.Tensor | list) -> torch.Tensor:
        """Block rows ``[B, n, H]`` at ``positions`` ``[B, n]`` through every layer -> ``[B, n, S]``."""
        if len(ctx) != len(self.layers):
            raise MedusaError(f"block heads have {len(self.layers)} layers but got context keys for {len(ctx)}: "
                              "pass context_kv's output")
        cos_sin = self.rotary(h, positions)
        for layer, kv in zip(self.layers, ctx):
            h = self._attend(layer, h, kv, cos_sin, visible)
        return self.lm_head(self.norm(h))

    def _block_inputs(self, root: torch.Tensor) -> torch.Tensor:
        """``root`` ``[...]`` token ids -> the block's inputs ``[..., k, H]``."""
        first = self._embed(root)[..., None, :]  # [..., 1, H]
        rest = self.mask_embedding.to(first.dtype).expand(*first.shape[:-2], self.block_size - 1, first.shape[-1])
        return torch.cat([first, rest], dim=-2)

    def draft(self, root: torch.Tensor, root_position: torch.Tensor, ctx: KV,
              ctx_valid: torch.Tensor | None = None) -> torch.Tensor:
        """One drafter pass: ``root`` ``[B]`` (``x_{t+1}``) at ``root_position`` ``[B]`` (``t+1``)
        over the context keys ``ctx`` (``ctx_valid`` ``[B, Tc]``: the slots that hold verified
        positions; None: all) -> ``[B, k, S]`` logits of ``x_{t+2} .. x_{t+k+1}``."""
        k = self.block_size
        h = self._block_inputs(root)  # [B, k, H]
        positions = root_position[:, None] + torch.arange(k, device=root.device)  # [B, k]
        b, tc = root.shape[0], ctx[0][0].shape[2]
        if ctx_valid is None:
            ctx_valid = torch.ones((b, tc), dtype=torch.bool, device=root.device)
        visible = torch.cat([ctx_valid.to(torch.bool), torch.ones((b, k), dtype=torch.bool, device=root.device)], dim=1)
        return self._run(h, positions, ctx, visible[:, None, None, :])

    def draft_many(self, roots: torch.Tensor, positions: torch.Tensor, ctxs: list[KV],
                   valid: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`draft` for several sequences with context buffers of their own: ``roots``,
        ``positions`` ``[B]``, ``ctxs[b]`` sequence ``b``'s per-layer buffers ``[1, kv_heads, Tc_b,
        head_dim]``, ``valid[b]`` ``[1, Tc_b]`` -> ``[B, k, S]``. The products run on every
        sequence's rows at once, the attention per sequence as :meth:`draft` runs it: where the
        products compute each row on its own (:meth:`shares_rows`) a sequence gets its bits alone."""
        k = self.block_size
        h = self._block_inputs(roots)  # [B, k, H]
        at = positions[:, None] + torch.arange(k, device=roots.device)  # [B, k]
        ones = torch.ones((1, k), dtype=torch.bool, device=roots.device)
        masks = [torch.cat([m.to(torch.bool), ones], dim=1)[:, None, None, :] for m in valid]
        return self._run(h, at, [[c[i] for c in ctxs] for i in range(len(self.layers))], masks)

    def shares_rows(self) -> bool:
        """Whether :meth:`draft_many` gives each sequence the bits :meth:`draft` gives it alone:
        where the engine's kernel scope runs the products on the gemv kernels (a float32 target on
        a CPU), which compute each row on its own whatever else is in the product."""
        return gemv_copy(self.target.get_output_embeddings(), 1) is not None

    def train_logits(self, fused: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Every block of a batch in one pass: ``fused`` ``[B, T, H]``, ``input_ids`` ``[B, T]``,
        ``anchors`` ``[B, A]`` (block ``a``'s ``t``, with ``t + 1 < T``) -> ``[B, A, k, S]``.
        Block ``a``'s rows see the context at positions ``<= t`` and their own block only."""
        b, t_len = input_ids.shape
        a, k = anchors.shape[1], self.block_size
        device = input_ids.device
        ctx = self.context_kv(fused, torch.arange(t_len, device=device).expand(b, t_len))
        root = input_ids.gather(1, (anchors + 1).clamp(max=t_len - 1))  # [B, A]
        h = self._block_inputs(root).reshape(b, a * k, -1)  # [B, A*k, H]
        positions = (anchors[..., None] + 1 + torch.arange(k, device=device)).reshape(b, a * k)
        sees_ctx = torch.arange(t_len, device=device) <= anchors[..., None]  # [B, A, T]
        sees_ctx = sees_ctx[:, :, None].expand(b, a, k, t_len).reshape(b, a * k, t_len)
        block = torch.arange(a, device=device).repeat_interleave(k)  # [A*k]: each row's block
        sees_block = (block[:, None] == block[None, :]).expand(b, a * k, a * k)
        visible = torch.cat([sees_ctx, sees_block], dim=2)[:, None]  # [B, 1, A*k, T + A*k]
        return self._run(h, positions, ctx, visible).reshape(b, a, k, -1)


def init_block_for(target: PreTrainedModel, block_size: int = 8, vocab: torch.Tensor | None = None,
                   feature_layers: list[int] | None = None, base_model: str | None = None,
                   num_layers: int = 1) -> BlockHeads:
    """Fresh block heads for ``target``: layers at their default initialisation, ``fc`` small
    random, ``mask_embedding`` at the scale of the target's embedded tokens, ``lm_head`` the
    target's rows of ``vocab`` (sorted target ids; None: all)."""
    emb = target.get_output_embeddings().weight
    config, ids = fused_config(target, "block", block_size, num_layers, vocab, feature_layers, base_model)
    heads = BlockHeads(config, target)
    with torch.no_grad():
        heads.fc.weight.normal_(std=0.02)
        scale = heads._embed(ids[:4096].to(emb.device)).float().std()
        heads.mask_embedding.normal_(std=float(scale))
    heads = heads.to(device=emb.device, dtype=emb.dtype)
    heads.set_vocab(ids)
    return heads
