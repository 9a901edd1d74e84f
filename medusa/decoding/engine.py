"""The decode loop: prefill, then propose -> verify in one target pass -> accept -> update.

Every mode (plain decoding, Medusa heads, ...) is a proposer plugged into this one loop,
so they share the cache handling, stopping rules, streaming and statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Generator, Iterator, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from medusa.decoding import payoff
from medusa.decoding.batch import Batch
from medusa.decoding.generation import Event, Generation, GenerationResult, GenerationStats
from medusa.decoding.passes.build import PassBuild, start_build
from medusa.decoding.passes.strategies import (
    AUTO,
    PassStrategy,
    kernel_scope,
    make_passes,
    pass_bucket,
)
from medusa.decoding.payoff import Curves, DraftCheck
from medusa.decoding.plan import Plan, check_plan, default_mode
from medusa.decoding.proposers.factory import ProposerConfig, make_proposer
from medusa.decoding.request import Request, make_request
from medusa.decoding.run import Decoding, accept, prefill_chunks
from medusa.decoding.sampling import SamplingConfig
from medusa.decoding.state import DecodeState, Proposal, Proposer, StepOutcome, as_proposer
from medusa.decoding.tree import load_tree, tree_key
from medusa.errors import MedusaError
from medusa.models.heads import MedusaHeads
from medusa.models.kinds import kind, kinds_where
from medusa.models.target import context_window, eos_token_ids
from medusa.runtime import hf as kv
from medusa.runtime import screen
from medusa.runtime.exact import pass_rows, use_exact

PREFILL_CHUNK = 256


def no_tree_for_eagle(tree, heads: MedusaHeads | None, mode: str = "eagle"):
    """``tree`` if it shapes something: a tree passed for eagle or block heads' modes, whose tree
    is drafted per step (sized for the device), would be silently ignored, so it is an error."""
    facts = None if heads is None else kind(heads.config.kind)
    if tree is not None and facts is not None and facts.drafts_per_step and mode in (*kinds_where("drafts_per_step"), "hybrid"):
        grows = "grows" if facts.dynamic_tree else "is drafted"
        raise MedusaError(f"a tree (--tree) shapes the static tree of Medusa heads, but these are {heads.config.kind} "
                          f"heads, whose tree {grows} per step (sized for the device): drop the tree, or use Medusa "
                          "heads (mode medusa)")
    return tree


def feature_layers(heads) -> tuple[int, ...] | None:
    """The target layers whose inputs ``heads`` read (EAGLE-3 and block heads), None: the final
    hidden state."""
    layers = getattr(heads, "feature_layers", None) or getattr(getattr(heads, "config", None), "feature_layers", None)
    return None if not layers else tuple(layers)


class Engine:
    """A target model plus whatever proposes for it (heads, ...), decoding one sequence.

    How its target passes run is :attr:`passes`, a :class:`~medusa.decoding.passes.strategies.PassStrategy`
    built from ``compile`` and ``static_cache`` (medusa/decoding/passes/strategies.py):

    - ``compile=False``: eager passes, on a dynamic cache (on a static one with ``static_cache``);
    - ``compile=True``: compiled passes on a static cache: on a CPU each pass size compiled once
      and saved for later processes (``"saved-graphs"``), on CUDA CUDA graphs (``"cuda-graphs"``,
      torch.compile's "reduce-overhead", traced in each process); exact in half precision on the
      CPU only;
    - ``compile="auto"``: on a CPU the generations whose pass sizes this machine has saved run
      the saved graphs, the others eagerly on a dynamic cache, and nothing compiles in the
      process (:meth:`build_passes` builds the missing sizes in a background process);
      elsewhere eager (``passes.reason`` says why);
    - a torch.compile backend's name (e.g. ``"aot_eager"``, to debug tracing): ``True``'s
      passes, compiled by that backend.

    Compiled passes are padded to a few pass sizes (``PASS_BUCKETS``), so proposals of any
    size reuse a handful of graphs; the prefill stays eager.
    """

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
        plan: Plan | None = None,
    ) -> None:
        kv.check_target(model)  # refuses models a tree cannot verify, or whose logits we cannot reproduce
        # what the machine measured (medusa.load), else the defaults: nothing is patched on later
        self.plan = plan = plan if plan is not None else Plan.default(model)
        check_plan(model, plan)
        self.exact = exact = use_exact(model, plan.exact, compile != AUTO and compile)
        self.max_rows = pass_rows(exact, plan.max_rows)
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
        # "onednn" / "gemv": the engine's own passes (target, draft model, heads) run packed
        # linears (medusa/runtime/kernels.py), compiled ones too; model.generate and training
        # never do.
        self._kernels = kernel_scope(model, plan.kernels, draft, heads)
        self.kernels = plan.kernels
        self.passes: PassStrategy = make_passes(model, compile, static_cache, plan.kernels, exact)
        # greedy rows' argmax without reading the whole float32 lm_head (medusa/runtime/screen.py)
        self.passes.screen = screen.for_model(model, plan.kernels)
        # EAGLE-3 and block heads read several of the target's layers: every pass returns those
        self.passes.use_features(feature_layers(heads))
        # Steps of generations in several threads (and the scheduler's batched steps) take turns
        # on the model, its kernel patches and the caches: one step at a time.
        self._lock = threading.RLock()
        # prompt tokens a prefill pass runs at most: long prompts are cut into passes of this size,
        # the same alone and in a scheduler (which runs other streams' steps between them)
        self.prefill_chunk: int | None = PREFILL_CHUNK

    @property
    def default_mode(self) -> str:
        """The mode used when none is named (:func:`~medusa.decoding.plan.default_mode`)."""
        return default_mode(self.heads, self.draft)

    def describe(self) -> list[str]:
        """What this engine runs with and why: one line per decision of its plan (what was
        picked, why, and what measuring it cost here), its passes, its default mode and whether a
        lone sequence checks that its drafting pays."""
        drafting = ("a greedy sequence alone decodes plainly while its drafts keep less than they cost, "
                    "and in mode hybrid drafts its lookup chain alone while the heads do "
                    "(medusa/decoding/payoff.py)" if self.proposer_config.check_drafting
                    else "every step drafts (check_drafting=False)")
        return [*self.plan.describe(), f"passes      {self.passes.name}: {self.passes.reason}; {self.passes.runs}",
                f"mode        {self.default_mode} when none is named", f"drafting    {drafting}"]

    def kernel_scope(self):
        """A context in which the target (and draft, heads) run the engine's linear kernels:
        to time passes as the engine runs them (tree calibration). Re-entrant."""
        return self._kernels

    # -- public API -----------------------------------------------------------------
    def generate(self, input_ids: Sequence[int] | torch.Tensor | Request, *args, **kwargs) -> GenerationResult:
        """Decode to the end; see :meth:`stream` for the arguments."""
        return self.stream(input_ids, *args, **kwargs).run()

    def stream(self, input_ids: Sequence[int] | torch.Tensor | Request, *args, **kwargs) -> Generation:
        """Start decoding ``input_ids``; iterate the result for lists of new token ids.

        The arguments are :func:`~medusa.decoding.request.make_request`'s (a
        :class:`~medusa.decoding.request.Request` may be passed instead): ``max_new_tokens``,
        ``mode``, ``temperature``, ``tree``, ``state``, ``top_p``, ``top_k``, ``seed``,
        ``acceptance``, ``sampling``, ``max_draft``, ``logprobs``, ``penalties``, ``ignore_eos``.

        ``state`` is the final state of an earlier generation (``result.state``): the
        cache is reused for the longest common prefix, so a chat re-prefills only the turn
        it adds. Sampled output follows the target's distribution exactly with any heads; the
        same seed gives the same tokens.
        """
        run = self.decoding(make_request(input_ids, *args, **kwargs))
        return Generation(self._run(run), run.stop)

    def decoding(self, request: Request) -> Decoding:
        """The sequence for ``request``, checked against this engine and not yet started: what
        :meth:`stream` runs alone and a scheduler runs beside others."""
        ids = list(request.prompt)
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise MedusaError(f"input_ids holds token id {bad}, outside the model's vocabulary of {vocab}: encode the "
                              "prompt with this model's tokenizer")
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise MedusaError(
                f"the prompt has {len(ids)} tokens but the model's context window is {self.max_positions}: shorten the prompt"
            )
        mode = request.mode
        proposer = self.proposer(mode, request.tree)
        if proposer.greedy_only and not request.sampling.greedy:
            name = mode if isinstance(mode, str) else type(mode).__name__
            raise MedusaError(f"mode {name!r} is greedy-only: use temperature=0, or a sampling mode such as 'lookup'")
        # compile="auto" picks the passes per generation (PassStrategy.for_generation)
        passes = self.passes.for_generation(lambda: self.pass_sizes(proposer))
        run = Decoding(request, proposer, passes, self.eos, self.max_rows, self.prefill_chunk)
        if self.proposer_config.check_drafting and request.sampling.greedy and (proposer.max_rows or 1) > 1:
            plan = self.plan
            run.check = DraftCheck(Curves(plan.pass_ms, plan.pass_ms_by_length) if plan.pass_ms else None)
        return run

    def stream_text(self, input_ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True,
                    **kwargs) -> Generator[str, None, GenerationResult]:
        """:meth:`stream` as text: an iterator of the pieces the accepted tokens make printable
        (:class:`~medusa.decoding.text.TextStream`: leading spaces and characters split over
        tokens come out right), joined equal to ``tokenizer.decode(result.tokens)``; the
        generator's return value is the :class:`GenerationResult`. The arguments are checked
        here, before the first piece; closing the iterator stops decoding."""
        from medusa.decoding.text import TextStream

        if self.tokenizer is None:
            raise MedusaError("stream_text needs the engine's tokenizer: build the Engine with tokenizer=")
        generation = self.stream(input_ids, **kwargs)
        text = TextStream(self.tokenizer, skip_special_tokens=skip_special_tokens)

        def pieces() -> Generator[str, None, GenerationResult]:
            try:
                for chunk in generation:
                    if piece := text.push(chunk):
                        yield piece
            finally:
                generation.stop()  # a consumer that stops early (close(), a break) ends the decoding
            if rest := text.flush():
                yield rest
            assert generation.result is not None
            return generation.result

        return pieces()

    def proposer(self, mode: str | Proposer, tree: str | Sequence[Sequence[int]] | None = None) -> Proposer:
        """The proposer for a mode name (None: :attr:`default_mode`); a Proposer object passed as
        ``mode`` is used as is."""
        mode = self.default_mode if mode is None else mode
        if not isinstance(mode, str):
            return as_proposer(mode)
        no_tree_for_eagle(tree, self.heads, mode)
        facts = None if self.heads is None else kind(self.heads.config.kind)
        static = facts is not None and not facts.drafts_per_step and mode in facts.modes  # Medusa's tree
        paths = self.tree_paths(tree) if static else None
        plan = self.plan  # sizes measured here (None: calibrated for the device type)
        size = (plan.eagle if mode in kinds_where("sized")  # the kinds that draft per step, sized alike
                else {"hybrid": plan.hybrid, "lookahead": plan.lookahead}.get(mode))
        return make_proposer(mode, self.device, self.proposer_config, heads=self.heads, paths=paths, draft=self.draft,
                             dtype=self.model.dtype, size=size, max_rows=self.max_rows, lookahead=plan.lookahead,
                             sampled_size=plan.eagle if mode == "hybrid" else None,
                             by_temperature=self._drawn_sizes(mode),
                             costs=Curves(plan.pass_ms, plan.pass_ms_by_length) if plan.pass_ms else None)

    def _drawn_sizes(self, mode: str) -> tuple:
        """The plan's drawn levels per temperature for ``mode`` (hybrid's with its lookup chain),
        siblings a depth as sized; with ``ProposerConfig.draw`` set, that many at each calibrated depth."""
        width = self.proposer_config.draw
        sizes = [(t, hybrid if mode == "hybrid" else eagle) for t, eagle, hybrid in self.plan.drawn]
        if width is None:
            return tuple(sizes)
        width = max(width, 1)
        return tuple((t, dataclasses.replace(size, nodes=size.nodes // max(size.topk, 1) * width, topk=width))
                     for t, size in sizes)

    def precompile(self, mode: str | Proposer | None = None, tree: str | Sequence[Sequence[int]] | None = None,
                   rows: int | None = None, progress: Callable[[int, float], None] | None = None) -> list[int]:
        """Compile the verification pass for every size ``mode``'s proposals can take, now,
        instead of inside the first answers (compiled passes only; otherwise a no-op). ``rows``:
        the largest proposal, root included (default: the proposer's ``max_rows``; given with a
        mode's name, every size from 1 up compiles). Sizes from the proposer's ``min_rows`` up
        compile: a smaller pass (a tree the answer's budget cut short) pads up to it. Each pass
        bucket compiles once, on a throwaway cache whose capacity is symbolic, so no prompt
        length recompiles later. On the CPU a size an earlier process saved is loaded instead
        (with ``compile="auto"`` only those are, the others run eagerly). ``progress(bucket,
        seconds)`` is called after each. Returns the buckets compiled (or already compiled)."""
        if not self.passes.compiled:
            return []
        return self.compile_sizes(self.pass_sizes(mode, tree, rows), progress)

    def pass_sizes(self, mode: str | Proposer | None = None, tree: str | Sequence[Sequence[int]] | None = None,
                   rows: int | None = None) -> list[int]:
        """The compiled pass buckets ``mode``'s proposals use (see :meth:`precompile`)."""
        # rows given with a mode's name: every size up to it (the mode may need what is absent)
        proposer = None if rows is not None and isinstance(mode, str) else self.proposer(mode, tree)
        if rows is None:
            rows = proposer.max_rows
            if rows is None:
                raise MedusaError(f"{type(mode).__name__} does not say how large its proposals get (no max_rows): "
                                  "pass precompile(rows=N)")
        if self.max_rows is not None:
            rows = min(rows, self.max_rows)
        least = min(1 if proposer is None else proposer.min_rows, max(rows, 1))  # smaller passes pad up to it (step)
        return sorted({pass_bucket(n) for n in range(least, max(rows, 1) + 1)})

    def compile_sizes(self, buckets: Sequence[int], progress: Callable[[int, float], None] | None = None) -> list[int]:
        """Compile (or load, where saved) the verification pass for each of ``buckets``."""
        with self._kernels:
            return self.passes.warm(buckets, progress)

    def unsaved_passes(self, mode: str | Proposer | None = None, tree: str | Sequence[Sequence[int]] | None = None) -> list[int]:
        """The pass buckets ``mode`` uses that this machine has not saved yet: with
        ``compile="auto"`` they run eagerly until saved (:meth:`build_passes`), with
        ``compile=True`` on a CPU they compile at first use. Empty for passes that save nothing."""
        if self.passes.saved is None:
            return []
        return self.passes.missing(self.pass_sizes(mode, tree))

    def build_passes(self, mode: str | Proposer | None = None, tree: str | Sequence[Sequence[int]] | None = None,
                     source: str | None = None, trust_remote_code: bool = False) -> PassBuild:
        """Load the compiled pass sizes ``mode`` uses that this machine has saved, and start
        building the others in a background process at low priority (the chat does this with
        ``compile="auto"``; a generation runs compiled once all its sizes are saved). ``source``:
        where that process loads the target from (default: the folder or Hub id it was loaded
        from). Returns a :class:`~medusa.decoding.passes.build.PassBuild`; nothing is built for
        passes that save nothing (eager, CUDA graphs)."""
        sizes = self.pass_sizes(mode, tree) if self.passes.saved is not None else []
        return start_build(self.passes, sizes, self._kernels, source, trust_remote_code)

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
    def _prefill(self, ids: list[int], state: DecodeState | None, stats: GenerationStats,
                 sampling: SamplingConfig, max_new_tokens: int) -> DecodeState:
        """A whole prompt's prefill on the engine's passes (tests and calibration)."""
        steps = prefill_chunks(self.passes, self.prefill_chunk, ids, state, stats, sampling, max_new_tokens)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def step(self, state: DecodeState, proposal: Proposal, min_rows: int = 1) -> StepOutcome:
        """Verify ``proposal`` in one target pass and advance ``state`` past what is accepted.
        ``min_rows``: a compiled pass of fewer rows runs padded to that size's bucket (the
        proposer's usual size: a tree cut short by the budget reuses the usual graph)."""
        return accept(state, proposal, *self.passes.verify(state.cache, state.length, proposal, min_rows))

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        """Hold the model for one step: the engine's lock (generations in several threads, and a
        scheduler's thread, take turns on the model and its caches) and its kernel scope."""
        with self._lock, self._kernels:
            yield

    def _run(self, run: Decoding) -> Iterator[Event]:
        """A generation alone: a :class:`~medusa.decoding.batch.Batch` of one, each prefill chunk
        and each step holding the engine (:meth:`owned`), never across a yield: generations in
        several threads interleave their steps (the caller may also use the model between them)."""
        batch = Batch(self.passes, self.max_rows)
        batch.add(run)
        while batch:
            if batch.prefilling:
                with self.owned():
                    _, events = batch.prefill()
                yield from (event for _, event in events)
            with self.owned():
                report = batch.step(payoff.caps)
                payoff.observe(report)
            yield from (event for _, event in report.events)
