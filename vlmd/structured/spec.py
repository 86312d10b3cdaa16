"""What a request asks its output to be: the structured-output fields, validated.

Torch-free and library-free: the HTTP layer parses these fields; the grammar library sees
them only in ``vlmd.structured.compiler``, on the preprocessing pool.

Accepted shapes (OpenAI's and vLLM's):

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
* ``structured_outputs`` (vLLM's newer shape): exactly one of ``json`` (a schema, object or
  string), ``regex``, ``choice`` (list of strings), ``grammar`` (EBNF), ``json_object``: true;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

A request may use one of them only: two constraints on one answer are a 400, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from vlmd.errors import BadRequestError

# The fields this module reads from a chat / completions body (for a strict-fields check).
STRUCTURED_OUTPUT_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
ANY_JSON_OBJECT = '{"type":"object"}'


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One constraint on a request's output, in canonical text (the grammar-cache key).

    ``kind`` is ``json`` (``source`` a JSON schema, serialised compactly; keys keep the
    client's order, which is the order properties are generated in), ``regex``, ``choice``
    (``source`` a JSON list of strings) or ``grammar`` (Lark, or GBNF/EBNF text).
    """

    kind: str
    source: str
    # The request field it came from, for error messages; not part of the cache key.
    param: str = field(default="response_format", compare=False)

    @property
    def choices(self) -> list[str]:
        return orjson.loads(self.source)


def parse_structured_output(body: dict) -> StructuredOutputSpec | None:
    """The single structured-output constraint of a request body, or None."""
    found: list[tuple[str, StructuredOutputSpec]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.append(("structured_outputs", _structured_outputs(structured)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if body.get(name) is not None:
            found.append((name, constraint(kind, body[name], name)))
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _ in found)
        raise BadRequestError(f"a request may carry one output constraint; got {names}", param=found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> StructuredOutputSpec | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequestError("'response_format' must be an object with a 'type'", param="response_format")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise BadRequestError(f"'response_format' has unknown field '{sorted(extra)[0]}'", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json", ANY_JSON_OBJECT, "response_format")
    if kind == "json_schema":
        json_schema = value.get("json_schema")
        if not isinstance(json_schema, dict):
            raise BadRequestError(
                "'response_format' of type 'json_schema' needs a 'json_schema' object", param="response_format"
            )
        unknown = set(json_schema) - _JSON_SCHEMA_KEYS
        if unknown:
            raise BadRequestError(
                f"'response_format.json_schema' has unknown field '{sorted(unknown)[0]}'", param="response_format"
            )
        if "name" in json_schema and not isinstance(json_schema["name"], str):
            raise BadRequestError("'response_format.json_schema.name' must be a string", param="response_format")
        if not isinstance(json_schema.get("strict", False), (bool, type(None))):
            raise BadRequestError("'response_format.json_schema.strict' must be a boolean", param="response_format")
        if "schema" not in json_schema:
            raise BadRequestError("'response_format.json_schema' needs a 'schema'", param="response_format")
        return constraint("json", json_schema["schema"], "response_format")
    raise BadRequestError(
        f"'response_format' type {kind!r} is not supported (use 'text', 'json_object' or 'json_schema')",
        param="response_format",
    )


def _structured_outputs(value: Any) -> StructuredOutputSpec:
    if not isinstance(value, dict):
        raise BadRequestError("'structured_outputs' must be an object", param="structured_outputs")
    unknown = set(value) - set(_STRUCTURED_KEYS)
    if unknown:
        raise BadRequestError(
            f"'structured_outputs.{sorted(unknown)[0]}' is not supported (supported: {', '.join(_STRUCTURED_KEYS)})",
            param="structured_outputs",
        )
    given = [key for key in _STRUCTURED_KEYS if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise BadRequestError(
            f"'structured_outputs' needs exactly one of {', '.join(_STRUCTURED_KEYS)}", param="structured_outputs"
        )
    key = given[0]
    if key == "json_object":
        if value[key] is not True:
            raise BadRequestError("'structured_outputs.json_object' must be true", param="structured_outputs")
        return StructuredOutputSpec("json", ANY_JSON_OBJECT, "structured_outputs")
    return constraint(key, value[key], "structured_outputs")


# Keys that only annotate a schema: a node with "$ref" and nothing else but these is a
# pure reference, whose meaning is wholly its target's.
_ANNOTATIONS = {"$ref", "title", "description", "$comment", "examples", "default", "deprecated", "$id", "$anchor"}


def reference_cycle(schema: Any) -> list[str] | None:
    """The ``$ref`` chain of a schema whose references lead back to themselves without
    reaching any constraint (``#/$defs/a`` -> ``#/$defs/b`` -> ``#/$defs/a``): no value can
    ever match it, and the grammar library compiles it only to fail inside the engine
    (issue 36). None where there is no such cycle. Local references (``#/...``) only."""

    def resolve(pointer: str) -> Any:
        node = schema
        for part in pointer[2:].split("/") if pointer != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def pure_reference(node: Any) -> str | None:
        if isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") \
                and set(node) <= _ANNOTATIONS:
            return node["$ref"]
        return None

    # The nodes a value is checked against: from the root through sub-schemas and local
    # references (definitions nothing refers to are never used, so never judged).
    stack, followed = [schema], set()
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(value for key, value in node.items() if key not in ("$defs", "definitions"))
            target = node.get("$ref")
            if isinstance(target, str) and target.startswith("#") and target not in followed:
                followed.add(target)
                stack.append(resolve(target))
        elif isinstance(node, list):
            stack.extend(node)
        chain, pointer = [], pure_reference(node)
        while pointer is not None:
            if pointer in chain:
                return chain[chain.index(pointer):] + [pointer]
            chain.append(pointer)
            pointer = pure_reference(resolve(pointer))
    return None


def constraint(kind: str, value: Any, param: str) -> StructuredOutputSpec:
    """One constraint of ``kind`` from a field's value; ``param`` names the field in errors
    (also used by ``/v1/responses``, whose schema sits in ``text.format``)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise BadRequestError(f"the JSON schema in '{param}' is not valid JSON: {exc}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise BadRequestError(f"the JSON schema in '{param}' must be an object", param=param)
        cycle = reference_cycle(value)
        if cycle is not None:
            raise BadRequestError(f"the JSON schema in '{param}' can match nothing: its references "
                                  f"{' -> '.join(cycle)} lead back to themselves", param=param)
        return StructuredOutputSpec("json", orjson.dumps(value).decode(), param)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise BadRequestError(f"the {kind} in '{param}' must be a non-empty string", param=param)
        return StructuredOutputSpec(kind, value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise BadRequestError(f"'{param}' choices must be a non-empty list of non-empty strings", param=param)
        return StructuredOutputSpec("choice", orjson.dumps(value).decode(), param)
    raise BadRequestError(f"unknown constraint kind {kind!r}", param=param)
