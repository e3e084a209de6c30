"""A tool conversation rendered by the default model's tokenizer: folded Hermes style for
its template (no tool support), and handed to a template that knows tools as
`transformers` hands it (`tools`, arguments as objects, `tool_call_id`)."""

from __future__ import annotations

import pytest

from text.default_model import default_model_path
from text.gguf_metadata import read_gguf_tokenizer_data
from text.tokenizer import Tokenizer
from text.tool_prompt import ChatTurn, ToolFunction, TurnToolCall, template_knows_tools

WEATHER = ToolFunction("get_weather", "Weather in a city",
                       {"type": "object", "properties": {"city": {"type": "string"}}})
TURNS = (ChatTurn("user", "Weather in Oslo?"),
         ChatTurn("assistant", "", (TurnToolCall("call_7", "get_weather", '{"city": "Oslo"}'),)),
         ChatTurn("tool", "3C and windy", (), "call_7"))
# A template in the style of those that render tools themselves.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }} city={{ c.function.arguments.city }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}"
    "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_fields(read_gguf_tokenizer_data(default_model_path()))


def test_the_default_template_gets_the_hermes_fold(tokenizer):
    assert tokenizer.chat_template is not None
    assert not template_knows_tools(tokenizer.chat_template)
    text = tokenizer.decode(tokenizer.encode_tool_chat(TURNS, (WEATHER,)),
                            skip_special_tokens=False)
    assert '<tools>\n{"type":"function","function":{"name":"get_weather"' in text
    assert '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>' in text
    assert "<tool_response>\n3C and windy\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_knows_tools_renders_them_itself(tokenizer):
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer._compiled_template = None
    text = tokenizer.decode(tokenizer.encode_tool_chat(TURNS, (WEATHER,)),
                            skip_special_tokens=False)
    assert text.startswith("TOOLS:[get_weather]\n")
    assert '<assistant>CALL get_weather {"city": "Oslo"} city=Oslo\n' in text
    assert "<tool>3C and windy for call_7\n" in text and "<tools>" not in text
