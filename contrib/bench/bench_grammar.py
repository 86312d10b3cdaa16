"""xgrammar vs llguidance on this machine: grammar compile time and per-token mask time.

    python contrib/bench/bench_grammar.py TOKENIZER_DIR [TOKENIZER_DIR ...] [--steps 60]

Each directory holds a Hugging Face tokenizer (e.g. a tiny checkpoint built by
``python -m vlmd.tiny``, or a large-vocabulary one from
``vlmd.tiny.tokenizer_builder.build_bpe_tokenizer``). For each library and tokenizer:

* ``tokenizer setup``: building the library's view of the vocabulary (once per server);
* ``compile``: one realistic JSON schema (a document-extraction schema with nested objects,
  arrays, enums, numbers and required fields), compact separators, no free whitespace,
  median of 5 compiles with every cache off;
* ``mask bN``: the time per decode step to compute the next-token bitmask for N requests
  walking a valid answer (~390 tokens), the matchers advanced by each token (median, mean
  and worst step).

Both libraries are asked for the same thing vlmd needs: a bounded-whitespace JSON grammar.
The ``apply`` line is vlmd's own step after either library: the bitmask applied to the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "document_type": {"type": "string", "enum": ["invoice", "receipt", "purchase_order"]},
        "number": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4,8}$"},
        "issued": {"type": "string", "format": "date"},
        "vendor": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 80},
                "vat_id": {"type": ["string", "null"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "country": {"type": "string", "enum": ["DE", "FR", "US", "GB", "JP"]},
                    },
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"},
                    "tax_rate": {"type": "number", "enum": [0, 0.07, 0.19]},
                },
                "required": ["description", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
        "paid": {"type": "boolean"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["document_type", "number", "vendor", "lines", "total", "currency"],
    "additionalProperties": False,
}

INSTANCE = {
    "document_type": "invoice",
    "number": "RE-20240117",
    "issued": "2024-01-17",
    "vendor": {"name": "Bakery Miller", "vat_id": None,
               "address": {"street": "Main street 4", "city": "Berlin", "country": "DE"}},
    "lines": [
        {"description": "Bread rolls", "quantity": 12, "unit_price": 0.45, "tax_rate": 0.07},
        {"description": "Coffee beans 1kg", "quantity": 2, "unit_price": 17.9, "tax_rate": 0.19},
        {"description": "Delivery", "quantity": 1, "unit_price": 5},
    ],
    "total": 46.2,
    "currency": "EUR",
    "paid": True,
    "notes": ["thank you", "pay within 14 days"],
}
TEXT = json.dumps(INSTANCE, separators=(", ", ": "))


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class XGrammarBench:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        started = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
        )
        self.setup_seconds = time.perf_counter() - started
        self.vocab_size = vocab_size

    def compile(self):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        grammar = self.xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        return compiler.compile_grammar(grammar)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers, bitmask) -> None:
        for index, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidanceBench:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.setup_seconds = time.perf_counter() - started
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.vocab_size = vocab_size

    def compile(self):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        # The lexer is built lazily: the first mask is part of what a new grammar costs.
        bitmask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        return matcher

    def matchers(self, compiled, n: int):
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.llg.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llg.torch.fill_next_token_bitmask_par(
                self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
            )

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def bench(library, tokenizer, batch_sizes, steps: int) -> dict:
    compile_seconds = _median_seconds(library.compile, 5)
    compiled = library.compile()
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    row = {"setup_s": library.setup_seconds, "compile_ms": compile_seconds * 1e3, "answer_tokens": len(tokens)}
    for n in batch_sizes:
        matchers = library.matchers(compiled, n)
        bitmask = torch.zeros((n, (library.vocab_size + 31) // 32), dtype=torch.int32)
        times = []
        for step, token in enumerate(tokens[:steps]):
            started = time.perf_counter()
            library.fill(matchers, bitmask)
            times.append(time.perf_counter() - started)
            allowed = bool((bitmask[0, token // 32] >> (token % 32)) & 1)
            if not allowed:
                raise RuntimeError(f"{library.name}: token {step} ({tokenizer.decode([token])!r}) masked out")
            for matcher in matchers:
                if not library.accept(matcher, token):
                    raise RuntimeError(f"{library.name}: token {step} rejected")
        row[f"mask_b{n}_med_us"] = statistics.median(times) * 1e6
        row[f"mask_b{n}_mean_us"] = statistics.fmean(times) * 1e6
        row[f"mask_b{n}_max_us"] = max(times) * 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tokenizers", nargs="+")
    parser.add_argument("--steps", type=int, default=None, help="answer tokens to walk (default: all)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for path in args.tokenizers:
        tokenizer = AutoTokenizer.from_pretrained(path)
        vocab_size = len(tokenizer)
        for cls in (XGrammarBench, LLGuidanceBench):
            library = cls(tokenizer, vocab_size)
            row = bench(library, tokenizer, args.batch, args.steps)
            figures = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            print(f"vocab={vocab_size:>6}  {library.name:<10}  {figures}", flush=True)
        print(f"vocab={vocab_size:>6}  {'apply':<10}  {_apply_figures(vocab_size, args.batch)}", flush=True)


def _apply_figures(vocab_size: int, batch_sizes) -> str:
    """vlmd's own step after either library: the bitmask applied to float32 logits."""
    from vlmd.runner.grammar_mask import apply_bitmask

    figures = []
    for n in batch_sizes:
        bitmask = torch.randint(-(2**31), 2**31 - 1, (n, (vocab_size + 31) // 32), dtype=torch.int32)
        logits = torch.randn(n, vocab_size)
        seconds = _median_seconds(lambda: apply_bitmask(logits, list(range(n)), bitmask), 50)
        figures.append(f"apply_b{n}_us={seconds * 1e6:.3g}")
    return "  ".join(figures)


if __name__ == "__main__":
    main()
