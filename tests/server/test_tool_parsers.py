"""Tool-call parsing in the runtime (dyno_ui/runtime/parsers): token ids in, content, reasoning and
calls out, one token at a time as the engine delivers them; the calls equal what mlx-lm's own
parser reads from the whole text, each sent whole once its block closes, and a block cut short or
holding no call is dropped (no markup in the content)."""

import json

import pytest
from mlx_lm.tool_parsers import json_tools as mlx_json_tools
from mlx_lm.tool_parsers import qwen3_coder as mlx_qwen3_coder

from dyno_ui.paths import BUNDLED_MODEL
from dyno_ui.runtime.outputs import TextDelta, ToolCallDelta
from dyno_ui.runtime.parsers import ToolCallStream, tool_call_format
from dyno_ui.runtime.textstream import TextAssembler
from helpers.tool_models import XML_TEMPLATE, XML_TOOLS, with_template
from speculative.loader import load_checkpoint

@pytest.fixture(scope="module")
def bundled():
    return load_checkpoint(BUNDLED_MODEL, mode="off")


@pytest.fixture(scope="module")
def xml_lm(tiny_dir, tmp_path_factory):
    return load_checkpoint(with_template(tiny_dir(), XML_TEMPLATE, tmp_path_factory.mktemp("xml") / "m"), mode="off")


def assemble(lm, text, tools=None, parallel=True, initial="normal", stops=()):
    """Every output of `text`'s tokens fed one by one, then finish; and whether the assembler stopped."""
    calls = ToolCallStream.for_tokenizer(lm.tokenizer, tools, parallel)
    assembler = TextAssembler(lm.tokenizer, stops, split_reasoning=True, initial=initial, tool_calls=calls)
    out = []
    for t in lm.tokenizer.encode(text, add_special_tokens=False):
        if assembler.stopped:
            break
        out += assembler.add(t)
    return out + assembler.finish(), assembler.stopped


def fold(outputs):
    """(content, reasoning, [(name, arguments)], argument pieces per call)."""
    text = {"content": "", "reasoning": ""}
    calls, pieces = {}, {}
    for o in outputs:
        if isinstance(o, TextDelta):
            text[o.channel] += o.text
        else:
            assert isinstance(o, ToolCallDelta)
            if o.id is not None:
                assert o.index == len(calls) and o.id.startswith("call_") and o.name  # new calls in order
                calls[o.index] = [o.name, ""]
                pieces[o.index] = 0
            calls[o.index][1] += o.arguments
            pieces[o.index] += bool(o.arguments)
    return text["content"], text["reasoning"], [tuple(c) for c in calls.values()], list(pieces.values())


def test_formats_come_from_the_chat_template(bundled, xml_lm, tiny_lm):
    json_form, xml_form = tool_call_format(bundled.tokenizer), tool_call_format(xml_lm.tokenizer)
    assert (json_form.name, json_form.form, json_form.start, json_form.end) == (
        "json_tools", "json", "<tool_call>", "</tool_call>")
    assert (xml_form.name, xml_form.form) == ("qwen3_coder", "xml")
    assert tool_call_format(tiny_lm().tokenizer) is None  # its template has no tools
    assert ToolCallStream.for_tokenizer(tiny_lm().tokenizer) is None


def test_json_calls_with_reasoning_and_content(bundled):
    first = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}"}]}}'
    second = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    text = (f"let me see</think>\n\nI will check.\n\n<tool_call>\n{first}\n</tool_call>\n"
            f"<tool_call>\n{second}\n</tool_call>\n")
    content, reasoning, calls, pieces = fold(assemble(bundled, text, initial="reasoning")[0])
    # The separator before a call is not content; the one after </think> is, as without tools.
    assert (reasoning, content) == ("let me see", "\n\nI will check.")
    expected = [mlx_json_tools.parse_tool_call(c) for c in (first, second)]
    assert [(n, json.loads(a)) for n, a in calls] == [(c["name"], c["arguments"]) for c in expected]
    # The arguments as the model wrote them, each call in one delta.
    assert calls[0][1] == '{"city": "Paris", "days": [1, {"x": "}"}]}' and pieces == [1, 1]


def test_a_call_goes_out_when_its_block_closes(bundled):
    calls = ToolCallStream.for_tokenizer(bundled.tokenizer)
    assembler = TextAssembler(bundled.tokenizer, split_reasoning=True, tool_calls=calls)
    tokens = bundled.tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
                                      add_special_tokens=False)
    outputs = [assembler.add(t) for t in tokens]
    assert outputs[:-1] == [[]] * (len(tokens) - 1)  # nothing while the block is open
    (call,) = outputs[-1]
    assert (call.index, call.name, call.arguments) == (0, "add", '{"a": 1}') and call.id.startswith("call_")


def test_without_calls_the_text_is_unchanged(bundled):
    text = "def f(x):\n    return x  \n\n"
    content, _, calls, _ = fold(assemble(bundled, text, tools=[])[0])
    assert (content, calls) == (text, [])  # trailing whitespace is held, then given back


def test_a_block_that_is_no_call_is_dropped(bundled):
    for inside in ("not json", '{"name": "add", "arguments": {"a": 1,}}', '{"name": "add", "arguments": {"a": 1}'):
        content, _, calls, _ = fold(assemble(bundled, f"a <tool_call>\n{inside}\n</tool_call> b")[0])
        assert (content, calls) == ("a  b", [])  # the text around it stays; the markup does not


def test_other_key_order_is_parsed_when_the_block_closes(bundled):
    call = '{"arguments": {"a": 1}, "name": "add"}'
    _, _, calls, pieces = fold(assemble(bundled, f"<tool_call>\n{call}\n</tool_call>")[0])
    assert calls == [("add", '{"a": 1}')] and pieces == [1]


def test_a_call_cut_short_is_dropped(bundled):
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    for text, expected in (("Sure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1", ("Sure.\n", [])),
                           ("<tool_call>\n{\"name\": \"add\", \"argu", ("", [])),
                           (f"{one}\n{one}\n<tool_call>\n{{\"name\"", ("", [("add", '{"a": 1}')] * 2)),
                           (f"{one}\n{one[:-3]}", ("", [("add", '{"a": 1}')]))):
        content, _, calls, _ = fold(assemble(bundled, text)[0])
        assert (content, calls) == expected, text


def test_not_parallel_stops_after_the_first_call(bundled):
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    outputs, stopped = assemble(bundled, f"{one}\n{one}\n", parallel=False)
    assert stopped and fold(outputs)[2] == [("add", '{"a": 1}')]


def test_a_stop_string_inside_a_call(bundled):
    outputs, stopped = assemble(bundled, '<tool_call>\n{"name": "add", "arguments": {"a": 17}}\n</tool_call>',
                                stops=["7"])
    assert stopped and fold(outputs)[:3] == ("", "", [])  # the call it cut is dropped


def test_xml_calls_are_read_by_mlx_lm_when_their_block_closes(xml_lm):
    block = ("<function=pick>\n<parameter=kind>\nred\n</parameter>\n<parameter=n>\n7\n</parameter>\n"
             "<parameter=tag>\na<b\n</parameter>\n</function>")
    text = f"Sure.\n<tool_call>\n{block}\n</tool_call>\n<tool_call>\n<function=pick>\n</function>\n</tool_call>"
    content, _, calls, pieces = fold(assemble(xml_lm, text, XML_TOOLS)[0])
    expected = mlx_qwen3_coder.parse_tool_call(block, XML_TOOLS)
    assert content == "Sure."
    assert calls == [("pick", json.dumps(expected["arguments"])), ("pick", "{}")]
    assert json.loads(calls[0][1]) == {"kind": "red", "n": 7, "tag": "a<b"}  # typed by the tool's schema
    assert pieces == [1, 1]


def test_xml_call_cut_short_is_dropped(xml_lm):
    text = "<tool_call>\n<function=pick>\n<parameter=kind>\nblue\n</parameter>\n<parameter=n>\n3"
    assert fold(assemble(xml_lm, text, XML_TOOLS)[0])[:3] == ("", "", [])


def test_a_bad_escape_in_the_name_is_read_at_the_end(bundled):
    text = '<tool_call>\n{"name": "a\\q", "arguments": {}}\n</tool_call>'
    content, _, calls, _ = fold(assemble(bundled, text)[0])
    assert (content, calls) == ("", [])  # not JSON: no call, and its markup is not content
