"""Compiling structured-output constraints into grammars (llguidance), cached per constraint.

Runs on the preprocessing pool, before a request reaches the engine: the engine thread only
copies a compiled matcher and computes masks. Torch-free: masks are written through a raw
pointer the runner hands in.

Why llguidance and not xgrammar (both measured here, ``contrib/bench/bench_grammar.py``, a
document-extraction JSON schema, AMD EPYC 2 vCPUs): compiling took 1.3 ms with llguidance
against 4 ms (4k vocabulary), 10 ms (32k) and 94 ms (128k) with xgrammar, so even a schema
seen for the first time adds nothing noticeable to its request; the per-token mask costs
~12 us per row with llguidance against ~2 us with xgrammar, far below one decode step's
``lm_head`` at the same vocabulary; llguidance has no dependencies (7.6 MB), while xgrammar
pulls triton (~1 GB), apache-tvm-ffi and pydantic into a CPU server. Its JSON compiler takes
the whitespace policy as an option, so the default here allows none outside strings:
random (and real) weights otherwise loop on spaces or newlines until ``max_tokens``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import orjson

from vlmd.errors import BadRequestError
from vlmd.structured.spec import StructuredOutputSpec

# JSON answers: ", " and ": " between items (as json.dumps writes them, and as models are
# trained on), and no other whitespace, so the answer can never stall on blanks.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_ENTRIES = 256


class CompiledGrammar:
    """A validated grammar and a pristine matcher; requests get copies (``new_matcher``)."""

    def __init__(self, compiler: "GrammarCompiler", spec: StructuredOutputSpec, template: llguidance.LLMatcher):
        self.compiler = compiler
        self.spec = spec
        self._template = template

    def new_matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self._template.deep_copy())

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.spec.kind}, {self.spec.source[:40]!r})"


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id) and not self.matcher.is_error()

    def is_terminated(self) -> bool:
        """A stop token was accepted, or the grammar can produce nothing more."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Turns a ``StructuredOutputSpec`` into a ``CompiledGrammar`` for one model's vocabulary.

    The library's view of the vocabulary is built here, at start-up (0.05 s for a 4k
    vocabulary, 0.6-3.6 s for 128k on 2 loaded vCPUs), rather than in the first constrained
    request. Compiled grammars are kept in an LRU of ``cache_entries`` constraints, keyed by
    their canonical text; thread-safe.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_entries: int = DEFAULT_CACHE_ENTRIES):
        if cache_entries < 1:
            raise ValueError("the grammar cache needs at least one entry")
        # The library's vocabulary covers every token the tokenizer names, also one past the
        # model's head (an input-only media token): masks are then wider than the logits, and
        # applying one reads only the logits' bits (grammar_mask.py).
        vocab_size = max(vocab_size, len(tokenizer))
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.mask_words = (vocab_size + 31) // 32
        self.cache_entries = cache_entries
        self._cache: OrderedDict[StructuredOutputSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids))
        self._executor: llguidance.LLExecutor | None = None
        # Counters for /metrics: lookups by requests (``cached``), hits, compilations.
        self.num_lookups = 0
        self.num_hits = 0
        self.num_compiles = 0
        self.observer = None  # ``observe_grammar_compile(seconds)``, set by the server

    def cached(self, spec: StructuredOutputSpec) -> CompiledGrammar | None:
        """The cached grammar for ``spec`` (counted as one request's lookup), or None."""
        with self._lock:
            self.num_lookups += 1
            compiled = self._lookup(spec)
            if compiled is not None:
                self.num_hits += 1
            return compiled

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compiled grammar for ``spec``; BadRequestError (the library's reason) if invalid."""
        with self._lock:
            compiled = self._lookup(spec)  # another thread may have compiled it meanwhile
        if compiled is not None:
            return compiled
        started = time.perf_counter()
        tokenizer = self._tokenizer
        grammar = _grammar_text(spec)
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise BadRequestError(f"invalid {_NAMES[spec.kind]}: {problem.strip()}", param=spec.param)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise BadRequestError(f"invalid {_NAMES[spec.kind]}: {template.get_error()}", param=spec.param)
        # The lexer is built lazily: build it here, off the engine thread, with the first mask.
        template.compute_bitmask()
        compiled = CompiledGrammar(self, spec, template)
        if self.observer is not None:
            self.observer.observe_grammar_compile(time.perf_counter() - started)
        with self._lock:
            self.num_compiles += 1
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return compiled

    def _lookup(self, spec: StructuredOutputSpec) -> CompiledGrammar | None:
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
        return compiled

    def fill_masks(self, matchers: Sequence[GrammarMatcher], address: int) -> None:
        """Write each matcher's next-token bitmask (``mask_words`` int32, bit set = allowed)
        into row i of the C-contiguous int32 buffer at ``address`` (engine thread)."""
        row_bytes = self.mask_words * 4
        if len(matchers) == 1:
            matchers[0].matcher.unsafe_compute_mask_ptr(address, row_bytes)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m.matcher, row) for row, m in enumerate(matchers)], address, row_bytes, len(matchers)
        )


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _grammar_text(spec: StructuredOutputSpec) -> str:
    if spec.kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise BadRequestError(f"invalid JSON schema: {exc}", param=spec.param) from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        # Lark string literals: JSON-escaped text is a valid literal for the same bytes.
        alternatives = " | ".join(orjson.dumps(choice).decode() for choice in spec.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if spec.kind == "grammar":
        try:
            # Lark (llguidance's syntax) or GBNF/EBNF as llama.cpp and vLLM users write it.
            return llguidance.grammar_from("grammar", spec.source)
        except ValueError as exc:
            raise BadRequestError(f"invalid grammar: {exc}", param=spec.param) from None
    raise BadRequestError(f"unknown constraint kind {spec.kind!r}")
