"""The heads kinds registry (medusa/models/kinds.py): every kind's facts agree with its code,
and no other module compares a kind's name (counted here)."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

from medusa.errors import MedusaError
from medusa.models import kinds
from medusa.models.heads_config import EAGLE_KINDS, FUSED_KINDS, KIND_FIELDS, HeadsConfig
from medusa.models.kinds import KINDS, REGISTRY, TRAINING_HOOKS, kind, kinds_where, named

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("medusa", "infer", "train", "scripts")
_LITERAL = r"""["'](?:""" + "|".join(map(re.escape, KINDS)) + r""")["']"""
# kind == "eagle", kind in ("eagle", "eagle3"), "block" != kind, kind in EAGLE_KINDS, (*EAGLE_KINDS, "block")
# (a loop over kinds, ``for kind in ...``, compares nothing)
COMPARISON = re.compile(rf"(?<!for )\bkind\b\s*(?:==|!=|not\s+in\b|in\b)[^\n#]*?{_LITERAL}"
                        rf"|{_LITERAL}\s*(?:==|!=)\s*[\w.]*\bkind\b"
                        rf"|(?<!for )\bkind\b\s*(?:not\s+)?in\s+\(?\*?[A-Z]+_KINDS\b|\(\*[A-Z]+_KINDS\b")
# Modules that still compare kind names, with at most how many and why: lower a number (or drop the
# entry) as their comparisons move to the registry.
ALLOWED = {
    "medusa/config.py": (3, "TrainConfig's per-kind checks: medusa.config sits below medusa.models "
                            "(tests/test_layout.py), so it cannot ask the registry"),
}


def comparisons(path: Path) -> list[int]:
    """The line numbers in ``path`` that compare a heads kind with a kind's name (comments skipped)."""
    return [n for n, line in enumerate(path.read_text().splitlines(), 1)
            if not line.lstrip().startswith("#") and COMPARISON.search(line)]


def exempt() -> set[str]:
    """The registry and the kinds' own modules, which may compare their own names."""
    names = {"medusa.models.kinds", *(m for k in REGISTRY.values() for m in k.own_modules)}
    return {name.replace(".", "/") + ".py" for name in names}


def kind_comparisons() -> dict[str, list[int]]:
    """``path: [line, ...]`` for every library and entry-point module outside :func:`exempt`."""
    skip = exempt()
    found = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel not in skip and (lines := comparisons(path)):
                found[rel] = lines
    return found


def test_no_kind_name_is_compared_outside_the_registry():
    found = kind_comparisons()
    over = {rel: lines for rel, lines in found.items() if len(lines) > ALLOWED.get(rel, (0, ""))[0]}
    assert not over, f"kind names compared outside medusa/models/kinds.py (ask kinds.kind(name) instead): {over}"


def test_the_counter_sees_a_planted_comparison(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text('def f(cfg, kind):\n'
                       '    a = cfg.kind == "eagle"\n'
                       '    b = kind in ("medusa", "hybrid")\n'
                       '    c = "block" != cfg.kind\n'
                       '    d = cfg.kind in (*EAGLE_KINDS, "x")\n'
                       '    # cfg.kind == "eagle" in a comment\n'
                       '    kinds = (*SIZED_KINDS, "x")\n'
                       '    for kind in ("weight", "bias", *FUSED_KINDS):\n'
                       '        e = kind == "tokens"\n'
                       '    return kinds.kind(cfg.kind).fused\n')
    assert comparisons(planted) == [2, 3, 4, 5, 7]


def test_every_kind_names_code_that_exists():
    for k in REGISTRY.values():
        assert k.heads_class().__name__ == k.heads.partition(":")[2]
        assert callable(named(k.proposer)) and callable(named(k.loss))
        assert k.heads.partition(":")[0] in k.own_modules or k.name == "medusa"
        for module in k.own_modules:
            assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module
        assert set(k.own_fields) <= set(KIND_FIELDS)
        assert k.modes == (k.name, "hybrid")


def test_every_kinds_training_hooks_resolve_to_callables_of_one_signature():
    """training/heads_task.py calls each kind's hooks with the same arguments: every one
    resolves, is callable and takes exactly the parameters TRAINING_HOOKS names."""
    for k in REGISTRY.values():
        for hook, params in TRAINING_HOOKS.items():
            fn = named(getattr(k, hook))
            assert callable(fn), (k.name, hook)
            assert tuple(inspect.signature(fn).parameters) == params, (k.name, hook)
            assert getattr(k, hook).partition(":")[0].startswith("medusa.training."), (k.name, hook)


def test_every_kinds_config_validates_and_keeps_its_own_fields():
    for k in REGISTRY.values():
        fused = {"feature_layers": [0, 1, 2], "draft_vocab_size": 32} if k.fused else {}
        config = HeadsConfig(hidden_size=8, vocab_size=64, num_layers=(k.layers or (1,))[0], kind=k.name,
                             fc_bias=True, draft_layer={"intermediate_size": 16}, **fused)
        written = config.to_dict()
        assert {f for f in KIND_FIELDS if f in written} == set(k.own_fields)
        assert HeadsConfig.from_dict(written).kind == k.name


def test_fused_kinds_need_their_layers_and_vocabulary():
    for name in kinds_where("fused"):
        with pytest.raises(MedusaError, match="feature_layers"):
            HeadsConfig(hidden_size=8, vocab_size=64, kind=name)


def test_a_kind_with_layer_counts_refuses_others():
    for k in REGISTRY.values():
        if k.layers is not None:
            with pytest.raises(MedusaError, match="decoder layers"):
                HeadsConfig(hidden_size=8, vocab_size=64, num_layers=max(k.layers) + 1, kind=k.name,
                            feature_layers=[0, 1], draft_vocab_size=8)


def test_the_old_constants_come_from_the_registry():
    assert FUSED_KINDS == ("eagle3", "block") and EAGLE_KINDS == ("eagle", "eagle3")
    assert kinds_where("sized") == kinds_where("drafts_per_step") == ("eagle", "eagle3", "block")
    from medusa.decoding.proposers.factory import HEADS_MODES, MODES

    assert HEADS_MODES == KINDS and set(KINDS) <= set(MODES)


def test_an_unknown_kind_is_one_line_naming_the_known_ones():
    for call in (lambda: kind("dspark"), lambda: HeadsConfig(hidden_size=8, vocab_size=64, kind="dspark")):
        with pytest.raises(MedusaError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message and "'dspark'" in message and all(name in message for name in KINDS)


def test_exports_name_known_layouts():
    from medusa.hub.export import LAYOUTS

    for k in REGISTRY.values():
        assert set(k.exports) <= set(LAYOUTS)
    assert kinds.kind("block").exports == ()


def test_the_chat_loads_the_shipped_heads_of_the_kind_its_mode_names():
    """--mode KIND on the embedded model picks that kind's shipped heads, for every kind that ships
    (on CUDA --mode eagle3 used to load the Medusa heads, then stop on the mode mismatch)."""
    from medusa.api import SHIPPED
    from medusa.chat.prepare import heads_for

    assert set(SHIPPED) <= set(KINDS) and "eagle3" in SHIPPED
    for name in SHIPPED:
        assert heads_for(argparse.Namespace(heads=None, model=None, mode=name)) == name
        assert heads_for(argparse.Namespace(heads="FOLDER", model=None, mode=name)) == "FOLDER"
        assert heads_for(argparse.Namespace(heads=None, model="other/model", mode=name)) is None
    for mode in ("hybrid", "lookup", None):
        assert heads_for(argparse.Namespace(heads=None, model=None, mode=mode)) is None


def test_the_kind_fields_are_the_registrys_own_fields():
    assert KIND_FIELDS == tuple(dict.fromkeys(f for k in REGISTRY.values() for f in k.own_fields))
    assert set(KIND_FIELDS) == {"eagle_layout", "fc_bias", "feature_layers", "draft_vocab_size",
                                "norm_before_residual", "draft_layer"}


def test_every_kinds_proposer_is_built_by_one_constructor():
    from medusa.decoding.state import HeadsProposer

    for k in REGISTRY.values():
        cls = k.proposer_class()
        assert issubclass(cls, HeadsProposer), k.name
        params = list(inspect.signature(cls.for_heads).parameters)
        assert params == ["heads", "device", "size", "paths", "dtype", "hybrid", "draw", "window"], (k.name, params)


def test_a_new_kind_is_one_registry_entry_plus_its_own_files(monkeypatch, tmp_path):
    """tests/mock_kind.py is a whole kind (heads, proposer, training hooks): registered, it loads
    from a folder, decodes in its own mode and in hybrid exactly, is timed by sizing, describes
    itself in the chat's banner line and trains through its hooks - with no other file touched."""
    import mock_kind
    import torch
    from tiny import tiny_model

    from medusa.autotune.sizing import drafter
    from medusa.decoding.engine import Engine
    from medusa.models.heads_config import save_heads
    from medusa.models.loader import load_heads

    monkeypatch.setitem(REGISTRY, "mock", mock_kind.KIND)
    model = tiny_model("llama")
    cfg = argparse.Namespace(num_heads=3)
    heads = named(mock_kind.KIND.fresh_heads)(model, cfg, None)
    loaded = load_heads(save_heads(heads, tmp_path / "mock"), model)
    assert isinstance(loaded, mock_kind.MockHeads) and torch.equal(loaded.fc.weight, heads.fc.weight)
    eng = Engine(model, heads=loaded)
    prompt = [5, 17, 33, 9, 41, 12, 5, 17]
    plain = eng.generate(prompt, max_new_tokens=20, mode="baseline").tokens
    for mode in ("mock", "hybrid", None):
        result = eng.generate(prompt, max_new_tokens=20, mode=mode)
        assert result.tokens == plain, mode
    assert isinstance(eng.proposer("mock"), mock_kind.MockProposer)
    hybrid = eng.proposer("hybrid")
    assert isinstance(getattr(hybrid, "heads", hybrid), mock_kind.MockProposer)  # beside a lookup chain, if sized one
    assert "mock chain of 3" in eng.proposer("mock").describe() and loaded.describe() == "mock chain of 3 tokens"
    with pytest.raises(MedusaError, match="a tree .* shapes the static tree of Medusa heads"):
        eng.proposer("mock", tree=[(0,)])
    assert drafter(loaded, torch.device("cpu"), 2, 4).size.depth == 2  # sizing times the kind's own draft shapes
    hidden, labels = torch.randn(4, model.config.hidden_size), torch.tensor([1, 2, 3, 4])
    value, counts = named(mock_kind.KIND.loss)(loaded, model, (hidden, labels), cfg, None, None)
    value.backward()
    assert counts["tokens"] == 4 and loaded.fc.weight.grad is not None


def test_a_static_tree_has_no_draft_shape_to_size():
    from medusa.decoding.proposers.medusa import MedusaProposer

    with pytest.raises(MedusaError, match="static tree, which has no draft shape"):
        MedusaProposer.shape(3, 2)
