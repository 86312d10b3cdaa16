"""``check_rendered``: tool history a chat template drops is a 400; history it renders in
its own way (trimmed, escaped, JSON-encoded) is not. Templates here are jinja, as Hugging
Face chat templates are."""

from __future__ import annotations

import jinja2
import pytest

from vlmd.errors import BadRequestError
from vlmd.processing.chat import check_rendered

_ENV = jinja2.Environment()
_ENV.filters["tojson"] = __import__("json").dumps

TOOL_AS_JSON = _ENV.from_string(
    "{% for m in messages %}{% if m.role == 'tool' %}<tool>{{ m.content | tojson }}</tool>"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name | upper }}</call>{% endfor %}"
    "{% else %}<{{ m.role }}>{{ m.content | trim }}{% endif %}{% endfor %}"
)
TOOL_DROPPED = _ENV.from_string(
    "{% for m in messages %}{% if m.tool_calls %}<call>{{ m.tool_calls[0].function.name }}</call>"
    "{% elif m.role != 'tool' %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
)
CALLS_DROPPED = _ENV.from_string(
    "{% for m in messages %}<{{ m.role }}>{{ m.content if m.content is string else '' }}{% endfor %}"
)


def _renderer(template):
    return lambda conversation: template.render(messages=conversation)


def _history(result):
    return [
        {"role": "user", "content": "what is the weather"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": result},
    ]


def test_a_template_that_escapes_or_rewrites_what_it_renders_passes():
    # The text has quotes and a newline, which tojson escapes, and the name is upper-cased:
    # neither is found verbatim in the prompt, yet both are rendered.
    conversation = _history('{"temp": "21 C",\n "sky": "clear"}')
    rendered = TOOL_AS_JSON.render(messages=conversation)
    assert '{"temp": "21 C",\n "sky": "clear"}' not in rendered and "get_weather" not in rendered
    check_rendered(conversation, _renderer(TOOL_AS_JSON))


def test_a_template_that_drops_tool_results_is_a_400_naming_the_message():
    with pytest.raises(BadRequestError, match=r"messages\[2\]: .* does not render tool messages"):
        check_rendered(_history("sunny"), _renderer(TOOL_DROPPED))


def test_a_template_that_drops_tool_calls_is_a_400():
    with pytest.raises(BadRequestError, match=r"messages\[1\].tool_calls: .* does not render tool calls"):
        check_rendered(_history("sunny"), _renderer(CALLS_DROPPED))


def test_text_parts_of_a_tool_result_are_each_checked_and_the_conversation_is_not_changed():
    conversation = _history([{"type": "image"}, {"type": "text", "text": "a chart"}])
    before = repr(conversation)
    seen = []
    check_rendered(conversation, lambda conv: seen.append(conv) or TOOL_AS_JSON.render(messages=conv))
    assert repr(conversation) == before  # the probes went into a copy
    assert len(seen) == 1 and "vlmdprobe2t1x" in repr(seen[0])


def test_a_conversation_without_tool_history_is_not_rendered_again():
    check_rendered([{"role": "user", "content": "hi"}], lambda conv: pytest.fail("rendered without need"))
