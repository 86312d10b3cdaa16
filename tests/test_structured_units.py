"""Structured outputs without a server: parsing the request fields, compiling and caching
grammars (llguidance), the bitmask in the sampler, completion, replay after preemption, and
the whitespace bound, on the tiny LLaVA tokenizer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from vlmd.errors import BadRequestError
from vlmd.runner.grammar_mask import GrammarState, advance_grammars, apply_bitmask, apply_grammar_masks
from vlmd.structured.compiler import GrammarCompiler
from vlmd.structured.spec import ANY_JSON_OBJECT, StructuredOutputSpec, parse_structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


# ---- request fields ---------------------------------------------------------------------


def test_every_shape_parses_to_one_spec():
    schema_text = json.dumps(SCHEMA)
    assert parse_structured_output({}) is None
    assert parse_structured_output({"response_format": {"type": "text"}}) is None
    assert parse_structured_output({"response_format": {"type": "json_object"}}) == StructuredOutputSpec(
        "json", ANY_JSON_OBJECT)
    from_openai = parse_structured_output(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}})
    # The same schema from every field is one cache key (the field is only kept for errors).
    for body in ({"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": schema_text}},
                 {"guided_json": SCHEMA}, {"guided_json": schema_text}):
        assert parse_structured_output(body) == from_openai
    assert parse_structured_output({"guided_json": SCHEMA}).param == "guided_json"
    assert parse_structured_output({"guided_regex": "a+"}) == StructuredOutputSpec("regex", "a+")
    assert parse_structured_output({"structured_outputs": {"choice": ["a", "b"]}}).choices == ["a", "b"]
    assert parse_structured_output({"guided_grammar": "start: \"a\""}).kind == "grammar"
    assert parse_structured_output({"structured_outputs": {"json_object": True}}).source == ANY_JSON_OBJECT


@pytest.mark.parametrize("body", [
    {"response_format": "json"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
    {"response_format": {"type": "json_object", "schema": {}}},
    {"structured_outputs": {"regex": "a", "json": {}}},
    {"structured_outputs": {"whitespace_pattern": " "}},
    {"structured_outputs": []},
    {"guided_choice": ["a", 1]},
    {"guided_choice": ["a", ""]},
    {"guided_regex": ""},
    {"guided_json": "[1,"},
    {"guided_json": 3},
    {"guided_json": {}, "guided_regex": "a"},
])
def test_bad_fields_are_400s(body):
    with pytest.raises(BadRequestError):
        parse_structured_output(body)


# ---- compiling ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_llava_dir):
    return AutoTokenizer.from_pretrained(tiny_llava_dir)


@pytest.fixture()
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_entries=2)


def test_invalid_constraints_carry_the_library_reason(compiler):
    cases = [(StructuredOutputSpec("json", '{"type": "strin"}', "guided_json"), "strin"),
             (StructuredOutputSpec("regex", "(a", "guided_regex"), "regex"),
             (StructuredOutputSpec("grammar", "start: nowhere", "guided_grammar"), "nowhere")]
    for spec, reason in cases:
        with pytest.raises(BadRequestError) as caught:
            compiler.compile(spec)
        assert reason in caught.value.message
        assert caught.value.param == spec.param


def test_the_cache_is_a_bounded_lru(compiler):
    specs = [StructuredOutputSpec("regex", f"{letter}+") for letter in "abc"]
    first = compiler.compile(specs[0])
    assert compiler.compile(specs[0]) is first and compiler.num_compiles == 1
    compiler.compile(specs[1])
    compiler.compile(specs[0])  # touch: b is now the least recently used
    compiler.compile(specs[2])
    assert compiler.cached(specs[1]) is None
    assert compiler.cached(specs[0]) is first
    assert compiler.num_compiles == 3


# ---- masks, completion, replay -------------------------------------------------------------


def _row(compiled, generated=()):
    return SimpleNamespace(request_id="r", grammar=GrammarState(compiled, list(generated)))


def _allowed(row, vocab):
    logits = torch.zeros(1, vocab)
    apply_grammar_masks(logits, [row])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_apply_bitmask_matches_bit_arithmetic():
    words = torch.tensor([[0b101, -1, 0], [-(1 << 31), 0, 7]], dtype=torch.int32)
    logits = torch.randn(3, 100)
    before = logits.clone()
    apply_bitmask(logits, [2, 0], words)
    for index, row in enumerate([2, 0]):
        allowed = [(int(w) >> b) & 1 == 1 for w in words[index].tolist() for b in range(32)] + [False] * 4
        expected = torch.where(torch.tensor(allowed), before[row], float("-inf"))
        assert torch.equal(logits[row], expected)
    assert torch.equal(logits[1], before[1])  # a row without a mask is untouched


def test_mask_allows_exactly_the_grammar_and_completes(compiler, tokenizer):
    vocab = len(tokenizer)
    compiled = compiler.compile(StructuredOutputSpec("choice", json.dumps(["cat", "dog"])))
    row = _row(compiled)
    allowed = _allowed(row, vocab)
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("cat".startswith(t) or "dog".startswith(t) for t in texts), texts
    # Walk "cat" token by token: incomplete until the last token, then complete at once.
    tokens = tokenizer.encode("cat", add_special_tokens=False)
    unconstrained = SimpleNamespace(request_id="u", grammar=None)
    for index, token in enumerate(tokens):
        assert token in _allowed(row, vocab)
        done, refused = advance_grammars([row, unconstrained], [token, 5])
        assert done == ({"r"} if index == len(tokens) - 1 else set()) and refused == {}


def test_unconstrained_rows_are_untouched(compiler):
    compiled = compiler.compile(StructuredOutputSpec("regex", "[0-9]+"))
    logits = torch.randn(3, compiler.vocab_size)
    before = logits.clone()
    rows = [SimpleNamespace(request_id="a", grammar=None), _row(compiled), SimpleNamespace(request_id="c", grammar=None)]
    apply_grammar_masks(logits, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isinf(logits[1]).sum() > compiler.vocab_size // 2


def test_a_refused_token_fails_its_row_alone(compiler, tokenizer):
    """The mask and the matcher disagreeing (here: a token outside the mask reaches the matcher)
    ends that request with a reason naming its constraint; the other rows advance as usual."""
    digits = _row(compiler.compile(StructuredOutputSpec("regex", "[0-9]+")))
    letters = SimpleNamespace(request_id="ok", grammar=GrammarState(
        compiler.compile(StructuredOutputSpec("choice", json.dumps(["cat", "dog"]))), []))
    (letter,) = tokenizer.encode("x", add_special_tokens=False)[-1:]
    (first,) = tokenizer.encode("cat", add_special_tokens=False)[:1]
    done, refused = advance_grammars([digits, letters], [letter, first])
    assert set(refused) == {"r"} and "structured-output constraint" in refused["r"] and str(letter) in refused["r"]
    assert done == set() and letters.grammar.next_mask is not None  # the good row's next mask is ready


def test_a_replayed_matcher_equals_the_one_that_walked(compiler, tokenizer):
    # After preemption the runner rebuilds the matcher from the request's tokens.
    compiled = compiler.compile(StructuredOutputSpec("json", json.dumps(SCHEMA)))
    tokens = tokenizer.encode('{"a": 7, "b": "', add_special_tokens=False)
    walked = _row(compiled)
    for token in tokens:
        assert advance_grammars([walked], [token])[1] == {}
    replayed = _row(compiled, tokens)
    assert _allowed(replayed, compiler.vocab_size) == _allowed(walked, compiler.vocab_size)
    with pytest.raises(RuntimeError, match="rejects"):
        _row(compiled, tokenizer.encode('{"c"', add_special_tokens=False))


def test_json_never_allows_free_whitespace(compiler, tokenizer):
    """Outside strings, the only whitespace is the one space after "," and ":" (json.dumps'
    separators); no token made of blanks, newlines or carriage returns is ever allowed there."""
    vocab = len(tokenizer)
    blank = {t for t in range(vocab) if tokenizer.decode([t]) and not tokenizer.decode([t]).strip()}
    assert blank  # the tiny vocabulary has " ", "\n", "\t" tokens
    compiled = compiler.compile(StructuredOutputSpec("json", ANY_JSON_OBJECT))
    row = _row(compiled)
    for prefix in ("", "{", '{"k"', '{"k":', '{"k": 1', '{"k": 1,', '{"k": [1,', '{"k": [1]'):
        row = _row(compiled, tokenizer.encode(prefix, add_special_tokens=False))
        allowed_blank = {tokenizer.decode([t]) for t in _allowed(row, vocab) & blank}
        assert allowed_blank <= ({" "} if prefix.endswith((",", ":")) else set()), (prefix, allowed_blank)


@pytest.mark.parametrize("schema,cycle", [
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
     ["#/$defs/b", "#/$defs/a", "#/$defs/b"]),
    ({"$ref": "#"}, ["#", "#"]),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/a", "description": "d"}},
      "$defs": {"a": {"$ref": "#/$defs/a"}}}, ["#/$defs/a", "#/$defs/a"]),
    # Recursion through a constraint is a tree, not a cycle; an unused definition is never judged.
    ({"type": "object", "properties": {"child": {"$ref": "#"}}}, None),
    ({"type": "array", "items": {"$ref": "#/definitions/n"}, "definitions": {"n": {"type": "object",
      "properties": {"kids": {"type": "array", "items": {"$ref": "#/definitions/n"}}}}}}, None),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "type": "string"}, None),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}}, None),
])
def test_reference_cycles_are_found(schema, cycle):
    from vlmd.structured.spec import reference_cycle

    assert reference_cycle(schema) == cycle


def test_constraints_past_the_bounds_are_400s_naming_the_flag():
    from vlmd.server.structured_output import check_bounds

    choices = StructuredOutputSpec("choice", json.dumps(["a", "b", "c"]), "guided_choice")
    check_bounds(choices, max_choices=3, max_bytes=100)
    with pytest.raises(BadRequestError, match="--max-structured-output-choices"):
        check_bounds(choices, max_choices=2, max_bytes=100)
    with pytest.raises(BadRequestError, match="--max-structured-output-bytes"):
        check_bounds(StructuredOutputSpec("regex", "a" * 101, "guided_regex"), max_choices=3, max_bytes=100)
