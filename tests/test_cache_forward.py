"""Tree attention on stock transformers models equals sequential decoding, per architecture."""

import pytest
import torch
from tiny import ARCHS, WINDOWED, tiny_model
from transformers import DynamicCache

from medusa.decoding.tree import compile_tree
from medusa.runtime import hf as kv

PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]


def full_forward(model, ids):
    """Logits and final hidden states of a plain forward over the whole sequence."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0]


# Every architecture, and the sliding-window ones with a window shorter than the context.
CASES = [(a, None) for a in ARCHS] + [(a, 8) for a in WINDOWED]


@pytest.mark.parametrize("arch, window", CASES)
def test_tree_logits_equal_sequential_logits(arch, window):
    model = tiny_model(arch, sliding_window=window)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 96, (12,), generator=g).tolist()  # longer than the window
    tree = compile_tree(PATHS)
    tokens = torch.randint(3, 96, (tree.num_nodes,), generator=g)
    cache = kv.new_cache()
    with torch.no_grad():
        kv.forward(model, torch.tensor([prefix]), torch.arange(len(prefix))[None], cache, None)
        mask = kv.tree_attention_mask(model, len(prefix), tree.ancestor, tree.depth, model.dtype)
        logits, hidden = kv.forward(model, tokens[None], (len(prefix) + tree.depth)[None], cache, mask)
    for node in range(tree.num_nodes):
        path_nodes = [n for n in range(tree.num_nodes) if tree.ancestor[node, n]]
        seq = prefix + tokens[path_nodes].tolist()
        ref_logits, ref_hidden = full_forward(model, seq)
        torch.testing.assert_close(logits[node], ref_logits[-1], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[node], ref_hidden[-1], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_after_keeping_a_path_equals_sequential_cache(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 96, (7,), generator=g).tolist()
    tree = compile_tree(PATHS)
    tokens = torch.randint(3, 96, (tree.num_nodes,), generator=g)
    keep = torch.tensor([0, 1, 5, 8])  # root, (0,), (0,1), (0,1,0): not a contiguous prefix
    assert tree.paths[0] == (0,) and tree.paths[4] == (0, 1) and tree.paths[7] == (0, 1, 0)
    cache = kv.new_cache()
    with torch.no_grad():
        kv.forward(model, torch.tensor([prefix]), torch.arange(len(prefix))[None], cache, None)
        mask = kv.tree_attention_mask(model, len(prefix), tree.ancestor, tree.depth, model.dtype)
        kv.forward(model, tokens[None], (len(prefix) + tree.depth)[None], cache, mask)
        kv.keep_nodes(cache, len(prefix), keep, contiguous=False)
        ref = kv.new_cache()
        seq = prefix + tokens[keep].tolist()
        kv.forward(model, torch.tensor([seq]), torch.arange(len(seq))[None], ref, None)
    assert kv.cache_length(cache) == len(seq)
    for layer, ref_layer in zip(cache.layers, ref.layers):
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-5, rtol=1e-5)


def test_buffered_cache_grows_crops_and_rewrites_like_a_fresh_pass():
    """The reusable buffer crosses its first capacity (256), is cropped back, and is
    overwritten by new tokens: its contents always equal a cache built in one pass."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(3, 96, (300,), generator=g).tolist()
    other = torch.randint(3, 96, (40,), generator=g).tolist()
    cache = kv.new_cache()
    with torch.no_grad():
        for start, end in [(0, 200), (200, 250), (250, 300)]:  # 250 -> 300 forces a reallocation
            kv.forward(model, torch.tensor([seq[start:end]]), torch.arange(start, end)[None], cache, None)
        assert all(layer._kbuf.shape[-2] >= 300 for layer in cache.layers)
        kv.crop(cache, 270)
        kv.forward(model, torch.tensor([other]), torch.arange(270, 310)[None], cache, None)
        ref = DynamicCache()  # transformers' own concatenating cache
        full = seq[:270] + other
        kv.forward(model, torch.tensor([full]), torch.arange(len(full))[None], ref, None)
    assert kv.cache_length(cache) == len(full)
    for layer, ref_layer in zip(cache.layers, ref.layers):
        assert isinstance(layer, kv.BufferedLayer)
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-5, rtol=1e-5)


def test_a_held_buffered_layer_makes_its_views_when_read_and_crops_without_them():
    """After a one-call pass writes a layer's buffers in place (``hold``), its keys and values are
    the buffers' first positions when read; a crop of a held layer only shortens what is held, and
    setting the views while held first makes them (nothing written is lost)."""
    cache = kv.new_cache()
    cache.update(torch.arange(2 * 4 * 8.0).view(1, 2, 4, 8), -torch.arange(2 * 4 * 8.0).view(1, 2, 4, 8), 0)
    layer = cache.layers[0]
    layer._kbuf[..., 4:7, :] = 100.0  # a pass writes three more positions in place
    layer._vbuf[..., 4:7, :] = -100.0
    layer.hold(7)
    assert "held" in layer.__dict__ and layer.__dict__["_keys"].shape[-2] == 4  # no view made yet
    assert cache.get_seq_length() == 7 and torch.equal(layer.keys, layer._kbuf[..., :7, :])
    layer.hold(7)
    kv.crop(cache, 5)  # held: only the length changes
    assert layer.__dict__["held"] == 5 and torch.equal(layer.values, layer._vbuf[..., :5, :])
    layer.hold(6)
    layer.keys = layer.keys[..., :6, :]  # a setter while held: both views made first
    assert layer.values.shape[-2] == 6 and layer.__dict__["held"] is None
    kv.crop(cache, 3)  # an ordinary crop of made views
    assert cache.get_seq_length() == 3 and torch.equal(layer.keys, torch.arange(2 * 4 * 8.0).view(1, 2, 4, 8)[..., :3, :])
