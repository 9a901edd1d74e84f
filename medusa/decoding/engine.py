"""The decode loop: prefill, then propose -> verify in one target pass -> accept -> update.

Every mode (plain decoding, Medusa heads, ...) is a proposer plugged into this one loop,
so they share the cache handling, stopping rules, streaming and statistics.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from medusa.decoding import MAX_NEW_TOKENS
from medusa.decoding.compiled import SavedPasses, example_pass
from medusa.decoding.proposers import Autoregressive, ProposerConfig, make_proposer
from medusa.decoding.sampling import SamplingConfig, next_token
from medusa.decoding.state import CacheShare, DecodeState, Proposal, Proposer, StepOutcome
from medusa.decoding.tree import compile_tree, load_tree, tree_key
from medusa.decoding.verify import Accepted, verify
from medusa.errors import MedusaError
from medusa.models.heads import MedusaHeads
from medusa.models.target import context_window, eos_token_ids
from medusa.runtime import hf as kv
from medusa.runtime.exact import EXACT_MAX_ROWS, is_exact, set_exact
from medusa.runtime.files import cache_root
from medusa.runtime.kernels import KERNELS, PackedLinears, onednn_available
from medusa.runtime.opaque import opaque_ops


@dataclass
class GenerationStats:
    steps: int = 0  # target passes after the prefill
    new_tokens: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per target pass
    prefill_tokens: int = 0  # prompt tokens run at prefill: only the new ones when a state's cache is reused
    prefill_seconds: float = 0.0
    seconds: float = 0.0  # prefill + decode, wall clock
    # Where the decode steps' time went (wall clock, summed over steps): the proposer drafting,
    # the target's verification pass with acceptance and cache bookkeeping (it ends in the step's
    # host sync, so on a GPU it also holds whatever queued work had not finished), the proposer's
    # update. The rest of ``seconds`` is the prefill and the loop itself (and the caller's time
    # between streamed chunks).
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    update_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass (the mean accepted length, bonus token included)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "new_tokens": self.new_tokens, "tau": self.tau,
                "tokens_per_second": self.tokens_per_second, "prefill_tokens": self.prefill_tokens,
                "prefill_seconds": self.prefill_seconds, "draft_seconds": self.draft_seconds,
                "verify_seconds": self.verify_seconds, "update_seconds": self.update_seconds,
                "seconds": self.seconds, "accepted": list(self.accepted)}


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str  # "eos", "length", "context" or "stopped"
    state: DecodeState | None = None


class Generation:
    """An iterator over lists of new token ids as they are accepted; ``result`` when done.

    After each list, ``proposed`` says how many of its leading tokens the proposer drafted
    (heads, draft model, lookup); the rest is the target's own token. ``stop()`` (safe from
    a signal handler or another thread) ends decoding at the next step boundary, with a
    ``result.state`` that holds every token yielded so far and can seed the next turn.
    """

    def __init__(self, steps: Generator[tuple[list[int], int], None, GenerationResult],
                 stop: threading.Event) -> None:
        self._steps = steps
        self._stop = stop
        self.result: GenerationResult | None = None
        self.proposed = 0

    def stop(self) -> None:
        self._stop.set()

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> list[int]:
        try:
            chunk, self.proposed = next(self._steps)
            return chunk
        except StopIteration as stop:
            self.result = stop.value
            raise

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result


def as_token_list(input_ids: Sequence[int] | torch.Tensor | Mapping) -> list[int]:
    """Token ids from a list, a ``[T]``/``[1, T]`` tensor or a tokenizer's output (what
    ``apply_chat_template`` returns in transformers 5: a mapping with ``input_ids``)."""
    if isinstance(input_ids, (str, bytes)):
        raise MedusaError("generate and stream take token ids, not text: encode it first, e.g. "
                          "engine.tokenizer.apply_chat_template([{'role': 'user', 'content': text}], "
                          "add_generation_prompt=True)")
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise MedusaError("input_ids is a mapping without an 'input_ids' entry: pass token ids or a tokenizer's output")
        input_ids = input_ids["input_ids"]
        if not isinstance(input_ids, torch.Tensor) and input_ids and isinstance(input_ids[0], (list, tuple)):
            if len(input_ids) != 1:
                raise MedusaError(f"input_ids has batch size {len(input_ids)}: medusa decodes one sequence at a time")
            input_ids = input_ids[0]
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise MedusaError(f"input_ids has batch size {input_ids.shape[0]}: medusa decodes one sequence at a time")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise MedusaError(f"input_ids must be a 1-D list or a [1, T] tensor, got shape {tuple(input_ids.shape)}")
        return [int(t) for t in input_ids.tolist()]
    try:
        return [int(t) for t in input_ids]
    except (TypeError, ValueError):
        raise MedusaError("input_ids must be token ids (ints), a [1, T] tensor or a tokenizer's output; "
                          f"got {type(input_ids).__name__} holding {type(next(iter(input_ids), None)).__name__}") from None


# Compiled pass sizes: a proposal of n nodes runs padded to the smallest bucket >= n (at most
# 1.5x the rows), so one process compiles a handful of graphs whatever the proposals are.
PASS_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PACKED_ROWS = 64  # half precision: passes of more rows (a prefill) use torch's linear kernels


SLOT_STEP = 64  # static cache growth of a CPU-compiled engine (Engine._slot_step)


def pass_bucket(n: int) -> int:
    """The compiled pass size for ``n`` rows (``n`` itself past the largest bucket)."""
    return next((b for b in PASS_BUCKETS if b >= n), n)


def pad_pass(tokens: torch.Tensor, depth: torch.Tensor, ancestor: torch.Tensor, size: int,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a pass of ``n`` rows to ``size``: padding rows hold token 0 at the root's position and
    see the prefix and themselves only, so no real row sees them; their logits are dropped and
    their cache entries cut with the rejected nodes."""
    n = tokens.shape[0]
    if size == n:
        return tokens, depth, ancestor
    grown = torch.eye(size, dtype=torch.bool, device=ancestor.device)
    grown[:n, :n] = ancestor
    return (torch.cat([tokens, tokens.new_zeros(size - n)]), torch.cat([depth, depth.new_zeros(size - n)]), grown)


def pass_rows(exact: bool, max_rows: int | None) -> int | None:
    """Rows per verification pass (None: any). Exact attention makes attention row-invariant,
    but a device's matmul kernels may block differently past some row count (one AMX Xeon's
    bf16 linears: invariant up to 32 rows, not above), so exact passes verify at most the rows
    the device's probe found invariant (medusa.load passes the dtype pick's ``invariant_rows``)
    and never more than exact attention supports; larger proposals keep their first nodes."""
    if max_rows is not None and max_rows < 1:
        raise MedusaError(f"max_rows must be at least 1, got {max_rows}")
    return min(max_rows or EXACT_MAX_ROWS, EXACT_MAX_ROWS) if exact else max_rows


def use_exact(model: PreTrainedModel, exact: bool | None, compile: bool | str) -> bool:
    """Set ``model``'s attention batch-invariant or not and return which (medusa/runtime/exact.py:
    a tree row equals its one-token pass bit for bit). None: on in half precision, where
    kernels' row-count-dependent rounding flips near-ties; off in float32, whose linear kernels
    vary with the row count anyway (docs/exactness.md#exactness-in-bfloat16)."""
    if exact is None:
        exact = model.dtype in (torch.bfloat16, torch.float16)
    device = model.get_output_embeddings().weight.device
    if compile and exact:
        # A compiled exact pass is bit-identical to the eager one on the CPU only: attention and
        # the norms' reduction run as opaque ops (medusa/runtime/exact.py), the rest with inductor's emulated
        # precision casts (kv.compile_options). CUDA graphs cannot capture attention's per-pass plan.
        if device.type != "cpu":
            raise MedusaError(f"compile=True with exact attention (a bfloat16/float16 target) runs on the CPU only, "
                              f"not {device.type}: load the target in float32 (dtype='float32') or drop compile")
    if exact != is_exact(model):
        set_exact(model, exact)
    return exact


def truncate(proposal: Proposal, rows: int) -> Proposal:
    """``proposal``'s first ``rows`` nodes: nodes are laid out by depth (compile_tree), so every
    kept node's ancestors are kept and node indices stay those of the proposer."""
    tree = compile_tree(proposal.tree.paths[: rows - 1]).to(proposal.tokens.device)
    q = None if proposal.q is None else proposal.q[:rows]
    return Proposal(tree=tree, tokens=proposal.tokens[:rows], q=q, is_chain=proposal.is_chain)


def compiled_pass(model: PreTrainedModel, device: torch.device, compile: bool | str, kernels: str, folder,
                  build: bool = True):
    """The compiled verification pass: on the CPU one graph per size, saved to ``folder`` so a
    second process loads it (compiled.py; ``build=False``: only loaded, never compiled here);
    elsewhere ``torch.compile`` traced per process."""
    if device.type == "cpu":
        return SavedPasses(model, folder, compile if isinstance(compile, str) else "inductor", kernels, build)
    return kv.compiled_forward(device, compile)


AUTO = "auto"


def auto_compile(device: torch.device, model: PreTrainedModel, exact: bool = False) -> tuple[bool, str]:
    """``compile="auto"``: whether to compile, and why. On a CPU the passes run compiled where
    this machine has them saved and eagerly otherwise, never compiling in the process (compiled
    passes measured 3-16% faster end to end on both AMD EPYC CPUs in float32 and 12-15% faster
    per pass on the AMX Xeon in bfloat16, exact ones bit-identical to eager: docs/compile.md#compiled
    and docs/compile.md#compiled-exact-passes; compiling takes minutes, so ``python -m infer.precompile`` does
    it beside the process, as the chat starts it). Elsewhere eager: on CUDA, where CUDA graphs
    made plain decoding 5x faster end to end on an H200 (docs/benchmarks/2026-11-26-h200.md#compiled-passes-cuda-graphs), they compile in
    the process (about 45 s per pass size), which ``compile=True`` asks for and auto does not do
    behind a user's back."""
    if device.type != "cpu":
        why = ("CUDA graphs ran 5x faster on an H200 but compile for ~45 s per pass size in the process: "
               "pass compile=True (--compile)") if device.type == "cuda" else "compiled passes are measured on CPUs and CUDA only"
        return False, f"compile=auto: eager on {device.type} ({why})"
    if exact:
        try:
            opaque_ops(model)
        except MedusaError as e:
            return False, f"compile=auto: eager ({e})"
    return True, "compile=auto: pass sizes saved for this machine run compiled, the others eagerly until saved"


def no_tree_for_eagle(tree, heads: MedusaHeads | None, mode: str = "eagle"):
    """``tree`` if it shapes something: a tree passed for eagle heads' modes, whose tree grows
    per step (sized for the device), would be silently ignored, so it is an error."""
    if tree is not None and heads is not None and heads.config.kind == "eagle" and mode in ("eagle", "hybrid"):
        raise MedusaError("a tree shapes the static tree of Medusa heads, but these are eagle heads, whose tree grows "
                          "per step (sized for the device): drop the tree, or load Medusa heads")
    return tree


class Engine:
    """A target model plus whatever proposes for it (heads, ...), decoding one sequence."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        heads: MedusaHeads | None = None,
        tree: str | Sequence[Sequence[int]] | None = None,
        draft: PreTrainedModel | None = None,
        static_cache: bool = False,
        compile: bool | str = False,
        proposer_config: ProposerConfig | None = None,
        exact: bool | None = None,
        kernels: str = "default",
        max_rows: int | None = None,
    ) -> None:
        kv.check_target(model)  # refuses models a tree cannot verify, or whose logits we cannot reproduce
        self.exact = exact = use_exact(model, exact, compile != AUTO and compile)
        self.max_rows = pass_rows(exact, max_rows)
        self.model = model
        self.tokenizer = tokenizer
        self.heads = heads
        self.device = model.get_output_embeddings().weight.device
        self.eos = set(eos_token_ids(model, tokenizer))
        self.max_positions = context_window(model)
        self.tree = no_tree_for_eagle(tree, heads)
        # mode "draft": a draft model sharing the target's vocabulary (medusa.models.draft.load_draft)
        self.draft = draft
        self.proposer_config = proposer_config or ProposerConfig()
        self._cache_arg = kv.cache_argument(model)  # resolved here, not inside a compiled pass
        self._set_pass(compile, static_cache, kernels)
        # "onednn": the engine's own passes (target, draft model, heads) run packed oneDNN
        # linears (medusa/runtime/kernels.py), compiled ones too; model.generate and training
        # never do.
        self.kernels = kernels
        self.kernel_choice = None  # medusa.load sets it: the KernelChoice (which kernels, and why)
        self.draft_dtype_choice = None  # medusa.load sets it: the heads' DraftDtypeChoice
        # medusa.load sets it: eagle trees sized for this machine (medusa/autotune/sizing.py);
        # None: the sizes calibrated for the device type (calibration.json)
        self.tree_sizes = None
        self._kernels = self._kernel_context(kernels, heads)

    def _set_pass(self, compile: bool | str, static_cache: bool, kernels: str) -> None:
        """A static cache (fixed shapes and addresses) and, with compile, the verification pass
        compiled: CUDA graphs on CUDA ("reduce-overhead"), inductor kernels elsewhere. A
        string names another torch.compile backend (e.g. "aot_eager" to debug tracing), or is
        ``"auto"`` (:func:`auto_compile`). Each pass size compiles once: compiled passes are
        padded to a few bucket sizes (PASS_BUCKETS), so proposals of any size (hybrid, lookup,
        draft, eagle, budget-cut trees) reuse a handful of graphs; the prefill stays eager."""
        auto = compile == AUTO
        if auto:
            compile, self.compile_reason = auto_compile(self.device, self.model, self.exact)
        else:
            self.compile_reason = f"compile={compile!r}"
        self.compile_mode = ("auto" if auto else "on") if compile else "off"
        # compile="auto": static only for generations whose passes are all saved (_static_for)
        self.static_cache = bool(static_cache or (compile and not auto))
        self._pass = kv.forward
        self._clone_outputs = False
        self._compiled = bool(compile)
        self._marks_capacity = False  # whether step marks the cache's capacity dynamic (SavedPasses mark their own)
        # Static cache growth: powers of two, except for a pass compiled for the CPU (the
        # capacity is symbolic there, so any size reuses the graph): SLOT_STEP slots at a
        # time, keeping the slots attention reads close to the length. CUDA graphs record
        # one graph per capacity: powers of two there, as for an uncompiled static cache.
        self._slot_step = SLOT_STEP if compile and self.device.type == "cpu" else None
        if compile:
            if self.exact:
                opaque_ops(self.model)
            kv.persist_compiled(cache_root() / "inductor")
            self._pass = compiled_pass(self.model, self.device, compile, kernels, cache_root() / "compiled", build=not auto)
            # traced in each process (CUDA): step marks the capacity dynamic, and outputs are
            # cloned (CUDA graphs reuse their output memory at the next replay)
            self._marks_capacity = self._clone_outputs = not isinstance(self._pass, SavedPasses)

    def _kernel_context(self, kernels: str, heads: MedusaHeads | None):
        if kernels not in KERNELS:
            raise MedusaError(f"unknown kernels {kernels!r}: use one of {', '.join(KERNELS)}")
        if kernels == "default":
            return contextlib.nullcontext()
        if not onednn_available(self.device, self.model.dtype):
            raise MedusaError(f"kernels='onednn' needs a CPU and torch build with oneDNN {self.model.dtype} linears, "
                              f"not {self.device.type} here: use kernels='default'")
        # Half precision: packed kernels only for decoding passes (at most PACKED_ROWS rows),
        # where they were measured bit-identical to torch's; a long prefill runs torch's own, so
        # the engine's prompt cache is stock transformers' (kernels.PackedLinears).
        half = self.model.dtype in (torch.bfloat16, torch.float16)
        packed_heads = None if getattr(heads, "int8", False) else heads  # int8 heads run their own kernel
        return PackedLinears(self.model, self.draft, packed_heads, stock_above=PACKED_ROWS if half else None)

    @property
    def compiled(self) -> bool:
        """Whether the verification pass is compiled (``compile``)."""
        return self._compiled

    @property
    def saved_passes(self) -> SavedPasses | None:
        """The CPU's saved compiled passes (:mod:`medusa.decoding.compiled`), None elsewhere."""
        return self._pass if isinstance(self._pass, SavedPasses) else None

    def kernel_scope(self):
        """A context in which the target (and draft, heads) run the engine's linear kernels:
        to time passes as the engine runs them (tree calibration). Re-entrant."""
        return self._kernels

    # -- public API -----------------------------------------------------------------
    def generate(self, input_ids: Sequence[int] | torch.Tensor, **kwargs) -> GenerationResult:
        """Decode to the end; see :meth:`stream` for the arguments."""
        return self.stream(input_ids, **kwargs).run()

    def stream(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = MAX_NEW_TOKENS,
        mode: str | Proposer = "medusa",
        temperature: float | None = None,
        tree: str | Sequence[Sequence[int]] | None = None,
        state: DecodeState | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        acceptance: str | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Generation:
        """Start decoding ``input_ids``; iterate the result for lists of new token ids.

        ``state`` is the final state of an earlier generation (``result.state``): the
        cache is reused for the longest common prefix, so a chat re-prefills only the turn
        it adds.

        ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``seed`` and ``acceptance``
        (``"lossless"`` or the lossy ``"typical"``) override ``sampling`` (default:
        :class:`~medusa.sampling.SamplingConfig`, which documents them). Sampled output
        follows the target's distribution exactly with any heads; the same seed gives the
        same tokens.
        """
        ids = as_token_list(input_ids)
        if not ids:
            raise MedusaError("input_ids is empty: give at least one prompt token")
        if max_new_tokens < 1:
            raise MedusaError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        # Defaults come from SamplingConfig alone; the keyword arguments override them.
        sampling = (sampling or SamplingConfig()).override(temperature=temperature, top_p=top_p, top_k=top_k,
                                                           seed=seed, acceptance=acceptance)
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise MedusaError(
                f"the prompt has {len(ids)} tokens but the model's context window is {self.max_positions}: shorten the prompt"
            )
        proposer = self.proposer(mode, tree)
        if getattr(proposer, "greedy_only", False) and not sampling.greedy:
            name = mode if isinstance(mode, str) else type(mode).__name__
            raise MedusaError(f"mode {name!r} is greedy-only: use temperature=0, or a sampling mode such as 'lookup'")
        stop = threading.Event()
        return Generation(self._run(ids, proposer, max_new_tokens, state, stop, sampling), stop)

    def proposer(self, mode: str | Proposer, tree: str | Sequence[Sequence[int]] | None = None) -> Proposer:
        """The proposer for a mode name; a Proposer object passed as ``mode`` is used as is."""
        if not isinstance(mode, str):
            return mode
        no_tree_for_eagle(tree, self.heads, mode)
        static = self.heads is not None and self.heads.config.kind == "medusa" and mode in ("medusa", "hybrid")
        paths = self.tree_paths(tree) if static else None
        sized = self.tree_sizes
        size = None if sized is None else {"eagle": sized.eagle, "hybrid": sized.hybrid,
                                           "lookahead": sized.lookahead}.get(mode)
        return make_proposer(mode, self.device, self.proposer_config, heads=self.heads, paths=paths, draft=self.draft,
                             dtype=self.model.dtype, size=size, max_rows=self.max_rows)

    def precompile(self, mode: str | Proposer = "medusa", tree: str | Sequence[Sequence[int]] | None = None,
                   rows: int | None = None, progress: Callable[[int, float], None] | None = None) -> list[int]:
        """Compile the verification pass for every size ``mode``'s proposals can take, now,
        instead of inside the first answers (an engine built with ``compile``; otherwise a
        no-op). ``rows``: the largest proposal, root included (default: the proposer's
        ``max_rows``; given with a mode's name, every size from 1 up compiles). Sizes from the
        proposer's ``min_rows`` up compile: a smaller pass (a tree the answer's budget cut
        short) pads up to it. Each pass bucket compiles once, on a throwaway cache; the
        capacity is symbolic (:func:`medusa.runtime.hf.mark_capacity_dynamic`), so no
        prompt length recompiles later. On the CPU a size an earlier process saved is loaded
        instead (:mod:`medusa.decoding.compiled`; with ``compile="auto"`` only those are, the
        others run eagerly). ``progress(bucket, seconds)`` is called after each.
        Returns the buckets compiled (or already compiled: then each takes milliseconds)."""
        if not self._compiled:
            return []
        return self.compile_sizes(self.pass_sizes(mode, tree, rows), progress)

    def pass_sizes(self, mode: str | Proposer = "medusa", tree: str | Sequence[Sequence[int]] | None = None,
                   rows: int | None = None) -> list[int]:
        """The compiled pass buckets ``mode``'s proposals use (see :meth:`precompile`)."""
        # rows given with a mode's name: every size up to it (the mode may need what is absent)
        proposer = None if rows is not None and isinstance(mode, str) else self.proposer(mode, tree)
        if rows is None:
            rows = getattr(proposer, "max_rows", None)
            if rows is None:
                raise MedusaError(f"{type(mode).__name__} does not say how large its proposals get (no max_rows): "
                                  "pass precompile(rows=N)")
        if self.max_rows is not None:
            rows = min(rows, self.max_rows)
        least = min(getattr(proposer, "min_rows", 1), max(rows, 1))  # smaller passes pad up to it (step)
        return sorted({pass_bucket(n) for n in range(least, max(rows, 1) + 1)})

    def compile_sizes(self, buckets: Sequence[int], progress: Callable[[int, float], None] | None = None) -> list[int]:
        """Compile (or load, where saved) the verification pass for each of ``buckets``."""
        if not self._compiled:
            return []
        saved = isinstance(self._pass, SavedPasses)
        with torch.inference_mode(), self._kernels:
            for b in buckets:
                t0 = time.perf_counter()
                # a saved size is loaded (or compiled and saved); otherwise one traced pass compiles it
                if not saved or (self._pass.graph(self.model, b, self._cache_arg) is None and self._pass.build):
                    self._pass(*example_pass(self.model, b, self._cache_arg), cache_arg=self._cache_arg)
                if progress is not None:
                    progress(b, time.perf_counter() - t0)
        return list(buckets)

    def _static_for(self, proposer: Proposer) -> bool:
        """Whether a generation by ``proposer`` runs on a static cache. With ``compile="auto"``
        only once this machine has saved every pass size it uses: until then it is the eager
        engine, dynamic cache and all (a static cache's eager passes read its spare slots)."""
        if self.compile_mode != "auto":
            return self.static_cache
        try:
            return not self._pass.missing(self.pass_sizes(proposer))
        except MedusaError:  # a proposer that does not say its sizes
            return False

    def unsaved_passes(self, mode: str | Proposer = "medusa", tree: str | Sequence[Sequence[int]] | None = None) -> list[int]:
        """With ``compile="auto"`` on the CPU: the pass buckets ``mode`` uses that this machine
        has not saved yet (they run eagerly until ``python -m infer.precompile`` saves them).
        Empty otherwise."""
        if self.compile_mode != "auto" or not isinstance(self._pass, SavedPasses):
            return []
        return self._pass.missing(self.pass_sizes(mode, tree))

    def tree_paths(self, tree: str | Sequence[Sequence[int]] | None = None) -> list[tuple[int, ...]]:
        """The tree to use: the argument, else the engine's, else the default for the device.
        Paths deeper than the heads are dropped, so any tree works with any heads."""
        spec = tree if tree is not None else self.tree
        if spec is None and self.heads is not None:
            # calibrated for these heads on this device and dtype, else on this device type
            trees = self.heads.trees
            spec = trees.get(tree_key(self.device.type, self.model.dtype)) or trees.get(self.device.type)
        if spec is None:
            spec = "gpu" if self.device.type == "cuda" else "cpu"
        paths = load_tree(spec)
        depth = self.heads.num_heads if self.heads is not None else 0
        return [p for p in paths if len(p) <= depth]

    # -- the loop -------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self, ids: list[int], state: DecodeState | None, stats: GenerationStats,
                 sampling: SamplingConfig, max_new_tokens: int, static: bool | None = None) -> DecodeState:
        static = self.static_cache if static is None else static  # compile="auto" decides per generation
        cache, start, share = None, 0, CacheShare()
        if state is not None and kv.is_static(state.cache) == static:
            cached = state.tokens[: min(state.valid, state.length)]  # what the cache still holds for it
            start = next((i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids)))
            start = min(start, len(ids) - 1)  # the last prompt token must be run for its logits
            if state.share is not None and state.share.owned_by(state):
                cache, share = state.cache, state.share  # continue in place (a chat's next turn): no copy
                kv.crop(cache, start)
            else:  # its cache was taken by another generation since: branch off a copy
                cache = kv.copy_prefix(state.cache, start, self.model)
        if cache is None:
            cache = kv.new_static_cache(self.model, 256) if static else kv.new_cache()
        stats.prefill_tokens = len(ids) - start
        new = torch.tensor([ids[start:]], device=self.device)
        pos = torch.arange(start, len(ids), device=self.device)[None]
        mask = None
        if static:
            # room for the answer and a large tree, so that decoding rarely regrows the cache;
            # a compiled CPU pass takes any capacity, so there the cache grows as it fills
            room = len(ids) + (SLOT_STEP if self._slot_step else max_new_tokens + 64)
            kv.reserve(cache, min(room, self.max_positions) if self.max_positions else room, self._slot_step)
            mask = kv.causal_mask(self.model, start, len(ids) - start, self.model.dtype, self.device, kv.capacity(cache))
        logits, hidden = kv.forward(self.model, new, pos, cache, mask, logits_rows=slice(-1, None))
        generator = sampling.generator(self.device)
        root = next_token(logits[-1], sampling, generator)
        new_state = DecodeState(cache=cache, tokens=list(ids), length=len(ids), root=root, hidden=hidden[-1],
                                logits=logits[-1], sampling=sampling, generator=generator, prefill_hidden=hidden,
                                share=share, carry={} if state is None else dict(state.carry))
        share.take(new_state, start)
        return new_state

    @torch.inference_mode()
    def step(self, state: DecodeState, proposal: Proposal, min_rows: int = 1) -> StepOutcome:
        """Verify ``proposal`` in one target pass and advance ``state`` past what is accepted.
        ``min_rows``: a compiled pass of fewer rows runs padded to that size's bucket (the
        proposer's usual size: a tree cut short by the budget reuses the usual graph)."""
        tree, start = proposal.tree, state.length
        n = proposal.tokens.shape[0]
        tokens, depth, ancestor = proposal.tokens, tree.depth, tree.ancestor
        if proposal.side is not None:  # rows after the candidates that none of them sees
            tokens, depth, ancestor = proposal.side.joined(tokens, depth, ancestor)
        static = kv.is_static(state.cache)  # compile="auto" decodes eagerly on a dynamic cache until saved
        compiled = self._compiled and static
        if compiled:
            tokens, depth, ancestor = pad_pass(tokens, depth, ancestor, pass_bucket(max(tokens.shape[0], min_rows)))
            if not tokens.is_inference():  # a proposer's own tensor: guards tell the two kinds apart
                tokens = tokens.clone()
        positions = (start + depth)[None]
        if static:
            kv.reserve(state.cache, start + tokens.shape[0], self._slot_step)
            mask = kv.tree_attention_mask(self.model, start, ancestor, depth, self.model.dtype, kv.capacity(state.cache))
            if self._marks_capacity:
                kv.mark_capacity_dynamic(state.cache, mask)  # one graph per bucket, whatever the capacity
        else:
            chain = proposal.is_chain and proposal.side is None
            mask = None if chain else kv.tree_attention_mask(self.model, start, ancestor, depth, self.model.dtype)
        forward = kv.forward if self._compiled and not static else self._pass  # auto, nothing saved yet: eager
        logits, hidden = forward(self.model, tokens[None], positions, state.cache, mask, cache_arg=self._cache_arg)
        side = None if proposal.side is None else logits[n:n + proposal.side.tokens.shape[0]]
        logits, hidden = logits[:n], hidden[:n]  # padding rows are never verified, side rows are handed back
        if compiled and self._clone_outputs:
            logits, hidden = logits.clone(), hidden.clone()
            side = None if side is None else side.clone()
        acc: Accepted = verify(tree, proposal.tokens, logits, state.sampling, state.generator, proposal.q)
        # The step's single host sync: path, accepted length, next token and node tokens.
        d = tree.leaves.shape[1]
        flat = torch.cat([acc.length.view(1), acc.next_token.view(1), acc.path, proposal.tokens[acc.path.clamp(min=0)]]).tolist()
        m, nxt, path, path_tokens = flat[0], flat[1], flat[2:2 + d], flat[2 + d:]
        nodes = path[: m + 1]
        kv.keep_nodes(state.cache, start, acc.path[: m + 1], contiguous=nodes == list(range(m + 1)))
        new_tokens = path_tokens[1: m + 1] + [nxt]
        last = nodes[-1]
        state.length = start + m + 1
        state.tokens.extend(new_tokens)
        state.root = acc.next_token
        state.hidden = hidden[last]
        state.logits = logits[last]
        return StepOutcome(nodes=nodes, tokens=new_tokens, hidden=hidden, start=start, side_logits=side)

    def _run(self, ids: list[int], proposer: Proposer, max_new_tokens: int,
             prior: DecodeState | None, stop: threading.Event, sampling: SamplingConfig,
             ) -> Generator[tuple[list[int], int], None, GenerationResult]:
        """The one decode loop: prefill, then propose -> verify -> emit until a stop reason."""
        stats = GenerationStats()
        t0 = time.perf_counter()
        with self._kernels:  # entered per step, never across a yield: the caller may use the model
            state = self._prefill(ids, prior, stats, sampling, max_new_tokens, self._static_for(proposer))
        stats.prefill_seconds = time.perf_counter() - t0
        emitted: list[int] = []
        chunk, reason = cut_chunk([int(state.root)], self.eos, max_new_tokens)
        state.tokens.append(int(state.root))
        emitted += chunk
        stats.new_tokens = len(emitted)
        yield chunk, 0
        with self._kernels:
            proposer.begin(state)
        least = min(getattr(proposer, "min_rows", 1), self.max_rows or PASS_BUCKETS[-1])
        while reason is None:
            reason = self._stop_reason(state, stop)
            if reason is not None:
                break
            with self._kernels:
                t1 = time.perf_counter()
                proposal = self._propose(proposer, state, max_new_tokens - len(emitted))
                t2 = time.perf_counter()
                outcome = self.step(state, proposal, least)
                t3 = time.perf_counter()
                proposer.update(state, outcome)
                stats.draft_seconds += t2 - t1
                stats.verify_seconds += t3 - t2
                stats.update_seconds += time.perf_counter() - t3
            chunk, reason = cut_chunk(outcome.tokens, self.eos, max_new_tokens - len(emitted))
            emitted += chunk
            stats.steps += 1
            stats.accepted.append(len(chunk))  # emitted only: what EOS or the length limit cut is not counted
            stats.new_tokens = len(emitted)
            if chunk:
                # All but the step's last token were drafted (fewer if the chunk was cut).
                yield chunk, min(len(chunk), len(outcome.tokens) - 1)
        self._trim(state, len(ids) + len(emitted))
        stats.seconds = time.perf_counter() - t0
        return GenerationResult(tokens=emitted, stats=stats, finish_reason=reason, state=state)

    def _stop_reason(self, state: DecodeState, stop: threading.Event) -> str | None:
        """Why the loop must stop before the next step (None: go on)."""
        if stop.is_set():
            return "stopped"
        if self.max_positions is not None and state.length + 1 > self.max_positions:
            return "context"  # the root's KV entry has no slot left
        return None

    def _propose(self, proposer: Proposer, state: DecodeState, room: int) -> Proposal:
        """The proposer's tree for this step, within the token budget and the context."""
        state.budget = room  # (compiled passes pad a cut tree to its bucket)
        if self.max_positions is not None:
            state.budget = min(state.budget, self.max_positions - state.length)
        proposal = proposer.propose(state)
        n = proposal.tokens.shape[0]
        rows = n if proposal.side is None else n + proposal.side.tokens.shape[0]
        if self.max_rows is not None and rows > self.max_rows:
            proposal = truncate(proposal, min(n, self.max_rows))  # side rows go first
        reach = proposal.tree.max_depth if proposal.side is None else max(proposal.tree.max_depth, proposal.side.reach)
        if self.max_positions is not None and state.length + reach + 1 > self.max_positions:
            proposal = Autoregressive(self.device).propose(state)  # a proposer that ignored the budget
        return proposal

    @staticmethod
    def _trim(state: DecodeState, keep: int) -> None:
        """Drop tokens cut off by EOS or the length limit from the state, keeping the cache and
        token list consistent for a later turn that reuses them."""
        del state.tokens[keep:]
        if state.length > len(state.tokens) - 1:
            state.length = len(state.tokens) - 1
            kv.crop(state.cache, state.length)
        state.valid, state.budget = state.length, None


def cut_chunk(chunk: list[int], eos: Collection[int], room: int) -> tuple[list[int], str | None]:
    """A step's tokens cut at the first EOS and at ``room`` tokens left, with the finish
    reason that cut implies (None: neither applies and decoding goes on)."""
    reason = None
    for i, t in enumerate(chunk):
        if t in eos:
            chunk, reason = chunk[: i + 1], "eos"
            break
    if len(chunk) > room or (len(chunk) == room and reason is None):
        chunk, reason = chunk[:room], "length"
    return chunk, reason
