"""The documentation's links hold: every relative link in README.md and docs/ resolves (files and
#anchors, by GitHub's anchor rules), every ``docs/PAGE.md#anchor`` cited in the code exists, and
the README stays a front door. Fast: reads text files only, no model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE_DIRS = ("medusa", "infer", "train", "scripts")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CITATION = re.compile(r"docs/([\w./-]+\.md)(?:#([\w-]+))?")
MAX_README_LINES = 250


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (letters, digits, ``_``, ``-``
    and spaces kept), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """Every anchor a page defines; a repeated heading gets -1, -2 ... as on GitHub."""
    seen: dict[str, int] = {}
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.+?)\s*#*$", line)
        if m:
            a = anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            if n:
                seen[f"{a}-{n}"] = 1
    return set(seen)


def broken_links(page: Path) -> list[str]:
    bad = []
    for m in LINK.finditer(prose(page.read_text())):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, frag = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif frag and (dest.suffix != ".md" or frag not in anchors(dest)):
            bad.append(f"{target} (no such anchor)")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_code_cites_existing_docs_anchors():
    bad = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".sh"):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for page, frag in CITATION.findall(line):
                    dest = ROOT / "docs" / page
                    if not dest.is_file() or (frag and frag not in anchors(dest)):
                        bad.append(f"{path.relative_to(ROOT)}:{n}: docs/{page}{'#' + frag if frag else ''}")
    assert bad == []


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_checks_see_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title, with: punctuation\n\n## Same\n\n## Same\n\n```\n# not a heading\n```\n")
    (tmp_path / "b.md").write_text("[ok](a.md#title-with-punctuation) [dup](a.md#same-1) [code](a.md#not-a-heading) "
                                   "[gone](c.md) [no](a.md#nope) [web](https://example.org/x#y) `[skip](z.md)`\n")
    assert anchors(tmp_path / "a.md") == {"title-with-punctuation", "same", "same-1"}
    assert broken_links(tmp_path / "b.md") == ["a.md#not-a-heading (no such anchor)", "c.md (no such file)",
                                               "a.md#nope (no such anchor)"]


SOURCE_PATH = re.compile(r"\b((?:medusa|infer|train|scripts|tests)/[\w/]+\.(?:py|sh))\b")


def missing_sources(page: Path) -> list[str]:
    """The repository files (``medusa/...py`` and the like) a page names that do not exist."""
    return sorted({p for p in SOURCE_PATH.findall(page.read_text()) if not (ROOT / p).is_file()})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_source_files_exist(page):
    """A page that names a module names one that is there (modules move; the docs follow)."""
    assert not missing_sources(page), f"{page.relative_to(ROOT)} names files that do not exist: {missing_sources(page)}"


def test_the_module_map_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"`(medusa/[\w/]+\.py)`", text))
    for row in re.findall(r"^\| `(medusa/[\w/]+)/[\w]+\.py`, (.+?) \|", text, flags=re.M):  # `a/b.py`, `c.py` rows
        listed |= {f"{row[0]}/{name}" for name in re.findall(r"`(\w+\.py)`", row[1])}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "medusa").rglob("*.py") if p.name != "__init__.py"}
    assert not modules - listed, f"docs/architecture.md's module map lacks {sorted(modules - listed)}"


def test_the_source_check_sees_a_moved_module(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("The loop is `medusa/decoding/engine.py`; the mask was in `medusa/decoding/hf.py`.")
    assert missing_sources(page) == ["medusa/decoding/hf.py"]


# Machine names in code comments and docstrings: a comment states the rule and why, and cites the
# docs page holding the run that showed it (CONTRIBUTING.md); the machine and its numbers go there.
MACHINE = re.compile(r"\b(?:xeons?|epycs?|zen ?\d|emerald rapids|sapphire rapids|h200s?|2-core)\b", re.I)
FILE_PATH = re.compile(r"[\w.-]*/[\w./-]*\.(?:md|json|yaml|py|sh)(?:#[\w-]+)?")  # a cited page's name is no anecdote
ANECDOTE_DIRS = ("medusa", "train", "scripts", "infer")
# Lines in files whose owners are editing them now: (path, a piece of the line). Tolerated, and
# named in a warning until they go; remove an entry once its line is rewritten.
PENDING: tuple[tuple[str, str], ...] = ()  # (file, piece of a line) tolerated while its owner rewrites it


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` for every comment (``tokenize``) and every line of every module, class and
    function docstring (``ast``) of a Python source."""
    import ast
    import io
    import tokenize

    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return sorted(found)


def machine_anecdotes(path: Path, root: Path = ROOT) -> list[str]:
    """``FILE:LINE: text`` for each comment or docstring line of ``path`` that names a machine."""
    name = path.relative_to(root).as_posix()
    return [f"{name}:{n}: {text.strip()}" for n, text in comments_and_docstrings(path.read_text())
            if MACHINE.search(FILE_PATH.sub("", text))]


def test_code_comments_carry_no_machine_anecdotes():
    """Comments and docstrings state rules, not runs: no machine names (Xeon, EPYC, Zen N, H200,
    "2-core", ...) outside cited docs paths; the measurements live in docs/."""
    import warnings

    found = [hit for folder in ANECDOTE_DIRS for path in sorted((ROOT / folder).rglob("*.py"))
             for hit in machine_anecdotes(path)]
    pending = [hit for hit in found if any(hit.startswith(f"{p}:") and piece in hit for p, piece in PENDING)]
    if pending:
        warnings.warn("machine anecdotes left for their files' owners: " + "; ".join(pending), stacklevel=1)
    assert [hit for hit in found if hit not in pending] == [], "state the rule and cite docs/PAGE.md#anchor instead"


def test_the_anecdote_scan_finds_one(tmp_path):
    (tmp_path / "m.py").write_text('"""A module (docs/benchmarks/2026-11-26-h200.md#eager-passes)."""\n\n'
                                   "X = 1  # 32 rows: the probe's cap\n"
                                   "Y = 2  # on one AMX Xeon this took 13 ms\n\n\n"
                                   "def f():\n    \"\"\"Rows.\n\n    Measured on a 2-core CPU.\"\"\"\n"
                                   "    return 'an EPYC string literal is no comment'\n")
    assert machine_anecdotes(tmp_path / "m.py", tmp_path) == ["m.py:4: # on one AMX Xeon this took 13 ms",
                                                              "m.py:10: Measured on a 2-core CPU."]


def test_the_long_context_prompts_cover_every_task_and_length_in_order():
    """docs/benchmarks/prompts/long-context.jsonl (scripts/long_prompts.py) reads as bench prompts:
    code, summarization and rag at 1k, 2k, 4k and 8k, the shorter first (``--limit`` keeps them)."""
    from medusa.bench.prompts import read_prompts

    prompts = read_prompts(ROOT / "docs" / "benchmarks" / "prompts" / "long-context.jsonl")
    lengths = ["1k", "2k", "4k", "8k"]
    assert [p.category for p in prompts] == [f"{task}-{n}" for n in lengths for task in ("code", "summarization", "rag")]
    sizes = [len(p.text) for p in prompts]
    assert all(max(sizes[i:i + 3]) < min(sizes[i + 3:i + 6]) for i in range(0, 9, 3))  # longer at each length
