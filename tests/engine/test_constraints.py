"""Structured output keeps drafting on and the output exact: equal to plain decoding under the same grammar.

The reference mask here is built from llguidance directly and from scratch at every position (a
fresh matcher fed the whole generated prefix), so it shares nothing with the engine's processor,
whose matcher follows drafts and rolls back.
"""

import dataclasses
import json

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from scipy.stats import chi2

from dyno_ui.paths import BUNDLED_MODEL
from speculative.config import SamplingParams, SpecConfig
from speculative.constraints import (
    GrammarProcessor, JsonSchema, ToolCalls, ToolSchema, _common_prefix, combine, constraint_for, tool_call_schema,
)
from speculative.engine import generate
from helpers.drafts import drafted as drafted_run
from speculative.errors import DynoError
from speculative.events import Round, Token
from speculative.loader import load_checkpoint
from speculative.round.processors import processors_for

PERSON = {  # bounded strings and arrays: a random model finishes it in ~200 tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
TOOLS = (
    ToolSchema("get_weather", {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}),
    ToolSchema("add", {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}),
)


@pytest.fixture(scope="module")
def bundled():
    return load_checkpoint(BUNDLED_MODEL)


def reference_mask(constraint, generated, logits):
    """[1, V] logits with what the grammar forbids after `generated` at -inf: a fresh matcher, no rollback."""
    vocab = constraint.vocabulary
    if any(t in vocab.eos for t in generated):  # past the end: nothing to mask
        return logits
    matcher = llguidance.LLMatcher(vocab.tokenizer, constraint.grammar, log_level=0)
    assert matcher.consume_tokens(list(generated)), matcher.get_error()
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = mx.array(bits[: logits.shape[-1]].astype(bool))
    return mx.where(allowed, logits, -mx.inf)


def plain_reference(lm, prompt, constraint, n):
    """mlx-lm's generate_step, greedy, with the reference mask as its one logits processor."""
    def processor(tokens, logits):
        return reference_mask(constraint, tokens[len(prompt):].tolist(), logits)

    out = []
    for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n, logits_processors=[processor]):
        out.append(int(t))
        if out[-1] in lm.eos_token_ids:
            break
    return out


def run(lm, prompt, params, mode, depth=3, draft_vocab=None):
    events = list(generate(lm, prompt, params, SpecConfig(mode, depth, draft_vocab=draft_vocab)))
    return [e.id for e in events if isinstance(e, Token)], [e for e in events if isinstance(e, Round)], events[-1]


def parsed(lm, tokens):
    """The JSON value the tokens spell (EOS dropped)."""
    return json.loads(lm.tokenizer.decode([t for t in tokens if t not in lm.eos_token_ids]))


# ---- greedy: drafting at depth 1 and 3 gives plain decoding's tokens under the grammar ----

@pytest.mark.parametrize("model", ["bundled", "tied-gqa2"])
def test_greedy_drafting_equals_plain_with_a_schema(bundled, tiny_lm, model):
    lm = bundled if model == "bundled" else tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode("def person(x):\n    return " if model == "bundled" else "x = ")
    # The bundled Python model indents all it can (20 spaces a gap by default): one space keeps it short.
    schema = {**PERSON, "x-guidance": {"whitespace_pattern": "[ ]?"}} if model == "bundled" else PERSON
    constraint = constraint_for(JsonSchema(schema), lm)
    params = SamplingParams(max_tokens=320, constraint=constraint)
    plain, _, done = run(lm, prompt, params, "off")
    if model == "tied-gqa2":  # the bundled model's masks are checked in test_processor_follows_any_prefix_order
        assert plain == plain_reference(lm, prompt, constraint, 320)
    assert done.finish_reason == "stop"
    jsonschema.validate(parsed(lm, plain), PERSON)
    for depth in (1, 3):
        tokens, rounds, _ = run(lm, prompt, params, "mtp", depth)
        assert tokens == plain, depth
        assert rounds and all(r.drafted == depth for r in rounds)  # drafting stayed on
        assert sum(r.accepted for r in rounds) > 0.2 * len(tokens)  # and the masked drafts are kept


def test_unconstrained_output_is_not_json(tiny_lm):
    """What makes the tests above mean something: the random model does not write JSON by itself."""
    lm = tiny_lm("tied-gqa2")
    tokens, _, _ = run(lm, lm.tokenizer.encode("x = "), SamplingParams(max_tokens=40), "off")
    with pytest.raises(ValueError):
        parsed(lm, tokens)


def test_json_object_and_a_reduced_draft_vocabulary(tiny_lm):
    """Draft rows from half the vocabulary often hold no allowed token; output stays exact."""
    lm = tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode("x = ")
    constraint = constraint_for(JsonSchema(), lm)
    params = SamplingParams(max_tokens=60, constraint=constraint)
    plain, _, _ = run(lm, prompt, params, "off")
    assert plain == plain_reference(lm, prompt, constraint, 60)
    tokens, rounds, _ = run(lm, prompt, params, "mtp", 3, draft_vocab=160)
    assert tokens == plain and rounds


def test_tool_call_with_drafting(bundled):
    """A required tool call: the markers, then a call of an offered tool whose arguments fit its schema."""
    lm = bundled
    prompt = lm.tokenizer.encode("def main():\n    ")
    constraint = constraint_for(ToolCalls(TOOLS, parallel=False), lm)
    params = SamplingParams(max_tokens=320, constraint=constraint)
    plain, _, done = run(lm, prompt, params, "off")
    tokens, rounds, _ = run(lm, prompt, params, "mtp", 3)
    assert tokens == plain and rounds
    assert done.finish_reason == "stop"
    text = lm.tokenizer.decode([t for t in tokens if t not in lm.eos_token_ids])
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text[len("<tool_call>\n"): -len("\n</tool_call>")])
    jsonschema.validate(call["arguments"], {t.name: t.parameters for t in TOOLS}[call["name"]])


def test_batched_path_applies_the_constraint(tiny_lm):
    """mlx-lm's BatchGenerator (`--decode-concurrency`) with processors_for: each row its own grammar."""
    lm = tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode("x = ")
    constrained = SamplingParams(max_tokens=40, constraint=constraint_for(JsonSchema(PERSON), lm))
    expected = {0: run(lm, prompt, constrained, "off")[0], 1: run(lm, prompt, SamplingParams(max_tokens=40), "off")[0]}
    batch = BatchGenerator(lm.model, stop_tokens=[[t] for t in lm.eos_token_ids], completion_batch_size=2,
                           prefill_batch_size=2)
    uids = batch.insert([prompt, prompt], max_tokens=[40, 40],
                        logits_processors=[processors_for(constrained), processors_for(SamplingParams())])
    got = {uid: [] for uid in uids}
    while any(len(v) < 40 for v in got.values()):
        for r in batch.next_generated():
            got[r.uid].append(r.token)
    batch.close()
    assert [got[u] for u in uids] == [expected[0], expected[1]]


# ---- sampling: drafting's distribution is plain decoding's under the grammar ----

# A quote, then letters whose allowed set alternates ({a, b}, {c, d}, {a, b, quote}, ...): a row
# masked with the wrong prefix allows a token plain decoding never draws.
PAIRS = {"type": "string", "pattern": "^([ab][cd])+$"}
LENGTH = 4  # tokens sampled: the first, then two rounds at depth 2 (rejections roll the matcher back)
SAMPLES = 300
FALSE_ALARM = 1e-6  # a correct engine fails with this probability


def constrained_dist(lm, constraint, prompt, generated):
    """Plain decoding's next-token distribution at temperature 1: a fresh forward, the reference
    mask, generate_step's log-softmax in the model's dtype, categorical's float32 softmax."""
    logits = reference_mask(constraint, generated, lm.model(mx.array(prompt + generated)[None])[:, -1])
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return np.array(mx.softmax(logprobs.astype(mx.float32), axis=-1)[0])


def first_tokens(spec, prompt, n):
    """The first n tokens a speculator emits, with how many drafts it made and kept."""
    tokens, drafted, accepted = [], 0, 0
    for e in spec.run(prompt):
        if isinstance(e, Round):
            drafted, accepted = drafted + e.drafted, accepted + e.accepted
        elif len(tokens) < n:
            tokens.append(e.id)
        if len(tokens) == n:
            return tuple(tokens), drafted, accepted


def pearson(counts, joint, n):
    """Pearson statistic over cells expected at least 5 times, the rest pooled; (stat, dof)."""
    cells = [c for c, p in joint.items() if p * n >= 5]
    observed = np.array([counts.get(c, 0) for c in cells] + [n - sum(counts.get(c, 0) for c in cells)])
    expected = np.array([joint[c] * n for c in cells] + [n - sum(joint[c] * n for c in cells)])
    if expected[-1] < 5:  # too little left to pool: drop it (and check it stayed small)
        assert observed[-1] <= max(5, 3 * expected[-1])
        observed, expected = observed[:-1], expected[:-1]
    return float(((observed - expected) ** 2 / expected).sum()), len(observed) - 1


@pytest.mark.slow
def test_sampled_distribution_with_drafting_is_plain_decoding(tiny_lm):
    lm = tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode("x = ")
    constraint = constraint_for(JsonSchema(PAIRS), lm)
    base = SamplingParams(temperature=1.0, max_tokens=LENGTH, constraint=constraint)
    joint = {(): 1.0}  # P(t1 .. tn) under plain decoding with the grammar, enumerated over its support
    for _ in range(LENGTH):
        longer = {}
        for prefix, p in joint.items():
            dist = constrained_dist(lm, constraint, prompt, list(prefix))
            longer.update({prefix + (int(t),): p * dist[t] for t in np.flatnonzero(dist)})
        joint = longer
    counts, drafted, accepted = {}, 0, 0
    for seed in range(SAMPLES):
        spec = drafted_run(lm, dataclasses.replace(base, seed=seed), 2)
        tokens, d, a = first_tokens(spec, prompt, LENGTH)
        assert tokens in joint, tokens  # never a token the grammar forbids
        counts[tokens] = counts.get(tokens, 0) + 1
        drafted, accepted = drafted + d, accepted + a
    stat, dof = pearson(counts, joint, SAMPLES)
    assert dof >= 5 and stat < chi2.isf(FALSE_ALARM, dof), (stat, dof)
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both the accept and the residual branch ran


# ---- the processor is a function of the prefix, whatever order it is asked in ----

def test_processor_follows_any_prefix_order(bundled):
    lm = bundled
    constraint = constraint_for(JsonSchema(PERSON), lm)
    text = '{"name": "ab", "age": 7, "ok": true, "tags": ["a", "c"]}'
    tokens = lm.tokenizer.encode(text)
    logits = mx.random.normal((1, lm.vocab_size), key=mx.random.key(0))
    processor = constraint.processor()
    # forward, a draft-like excursion off the grammar, a jump back, past EOS, and from scratch
    eos = min(lm.eos_token_ids)
    order = [5, 6, 7, 3, 9, 2, len(tokens), 0, 4, 4, 11, 1]
    prefixes = [tokens[:n] for n in order] + [tokens[:4] + [tokens[9]], tokens + [eos], tokens[:8]]
    for prefix in prefixes:
        got = processor.mask(prefix, logits)
        valid = llguidance.LLMatcher(constraint.vocabulary.tokenizer, constraint.grammar, log_level=0)
        if valid.validate_tokens(prefix) == len(prefix):
            assert mx.array_equal(got, reference_mask(constraint, prefix, logits)).item(), prefix
        else:  # off the grammar or past EOS: a row never used, left as it was
            assert mx.array_equal(got, logits).item(), prefix
    ends = sorted(lm.eos_token_ids)
    assert (processor.mask(tokens[:8], logits)[0, ends] == -mx.inf).all().item()  # EOS only once it parses
    done = processor.mask(tokens, logits)[0]
    assert (done[ends] > -mx.inf).all().item() and (done > -mx.inf).sum().item() == len(ends)


def test_common_prefix():
    assert _common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert _common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert _common_prefix([9], [1]) == 0 and _common_prefix([], [1]) == 0
    assert all(_common_prefix(list(range(50)), list(range(n)) + [-1]) == n for n in range(50))


# ---- compiling: schemas and tool calls; errors are one DynoError line ----

@pytest.mark.parametrize("schema, message", [
    ({"type": "objekt"}, "invalid JSON schema: Invalid type: objekt"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "invalid JSON schema: "),
    ("not a schema", "invalid JSON schema: a schema must be a JSON object, got str"),
])
def test_invalid_schema_is_one_dyno_error_line(bundled, schema, message):
    with pytest.raises(DynoError) as e:
        constraint_for(JsonSchema(schema), bundled)
    assert e.value.message.startswith(message) and "\n" not in e.value.message


def test_tool_call_schema():
    """Which tools a tool choice allows is the runtime's (tests/server/test_chat_request.py)."""
    one = tool_call_schema(TOOLS[1:])
    assert one["properties"]["name"] == {"const": "add"}
    assert one["properties"]["arguments"] == TOOLS[1].parameters
    both = tool_call_schema(TOOLS)
    assert [s["properties"]["name"]["const"] for s in both["anyOf"]] == ["get_weather", "add"]
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, both)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"city": "x"}}, both)
    with pytest.raises(DynoError, match="no tools were given"):
        tool_call_schema([])


def test_sampling_params_with_a_constraint(bundled):
    constraint = constraint_for(JsonSchema(PERSON), bundled)
    a = SamplingParams(constraint=constraint)
    assert a.has_processors and not a.has_penalties and not SamplingParams().has_processors
    assert a == SamplingParams(constraint=constraint_for(JsonSchema(PERSON), bundled))
    assert hash(a) == hash(SamplingParams(constraint=constraint_for(JsonSchema(PERSON), bundled)))
    assert a != SamplingParams(constraint=constraint_for(JsonSchema(), bundled))
    assert dataclasses.replace(a, seed=3).constraint is constraint
    assert dataclasses.asdict(a)["constraint"]["vocabulary"] is constraint.vocabulary  # copies nothing big
    assert isinstance(processors_for(a)[-1], GrammarProcessor)
    with pytest.raises(DynoError, match="invalid sampling value: constraint must be a Constraint"):
        SamplingParams(constraint={"type": "json_object"})


# ---- Qwen3.5's XML tool-call form, and grammars combined (tool call or format, after reasoning) ----

def accepts(constraint, lm, text):
    """True when `text`'s tokens are a complete output of the grammar."""
    matcher = llguidance.LLMatcher(constraint.vocabulary.tokenizer, constraint.grammar, log_level=0)
    tokens = lm.tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and matcher.is_accepting()


def xml_call(name, **arguments):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_xml_tool_call_form(bundled):
    tools = (ToolSchema("f", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 5}, "unit": {"type": "string", "enum": ["c", "f"]},
        "n": {"type": "integer", "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["city", "n"]}), TOOLS[1])
    constraint = constraint_for(ToolCalls(tools, "xml"), bundled)
    assert accepts(constraint, bundled, xml_call("f", city="a <b", unit="f", n=3, ok="True"))
    assert accepts(constraint, bundled, xml_call("f", city="", n=-2) + "\n" + xml_call("add", a=1, b=2))
    for bad in (xml_call("f", city="Lisbon", n=3),  # longer than maxLength
                xml_call("f", city="x", unit="k", n=3),  # not in the enum
                xml_call("f", city="x", n=12),  # above the maximum
                xml_call("f", n=3),  # a required parameter missing
                xml_call("f", n=3, city="x"),  # not in the schema's order
                xml_call("add", a=1), xml_call("mul", a=1)):
        assert not accepts(constraint, bundled, bad), bad
    named = constraint_for(ToolCalls((TOOLS[1],), "xml", parallel=False), bundled)  # one tool: a named choice
    assert accepts(named, bundled, xml_call("add", a=1, b=2))
    assert not accepts(named, bundled, xml_call("add", a=1, b=2) + "\n" + xml_call("add", a=1, b=2))
    with pytest.raises(DynoError, match="invalid tool-call form 'yaml'"):
        constraint_for(ToolCalls(tools, "yaml"), bundled)


def test_combined_grammars_after_reasoning(bundled):
    call = constraint_for(ToolCalls(TOOLS), bundled)
    person = constraint_for(JsonSchema(PERSON), bundled)
    answer = '{"name": "ab", "age": 7, "ok": true, "tags": []}'
    called = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    either = combine([call, person], bundled)
    assert accepts(either, bundled, answer) and accepts(either, bundled, called)
    assert not accepts(either, bundled, "hello")
    thinking = combine([call, person], bundled, "</think>")
    assert thinking.kind == "reasoning+tool_call+json_schema"
    assert accepts(thinking, bundled, f"free text, even {answer}\n</think>\n\n{answer}")
    # Special tokens are not free text: no call (<tool_call>) or end of turn inside the reasoning.
    assert not accepts(thinking, bundled, f"{called}\n</think>\n\n{answer}")
    assert accepts(thinking, bundled, f"</think>{called}")
    assert not accepts(thinking, bundled, answer)  # still thinking: the answer comes after </think>
    assert not accepts(thinking, bundled, f"x</think>\n\n\n{answer}")  # at most two newlines between
    assert combine([person], bundled) is person
    with pytest.raises(DynoError, match="cannot be combined again"):
        combine([either], bundled, "</think>")


def test_tool_call_json_is_written_as_the_template_writes_it(bundled):
    """", " and ": " and no other whitespace (the template's tojson): a sampled call cannot pad itself."""
    call = constraint_for(ToolCalls(TOOLS), bundled)
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert accepts(call, bundled, good)
    for bad in (good.replace('": ', '":'), good.replace(', "', ',"'), good.replace('{"a"', '{ "a"'),
                good.replace('{"a": 1, ', '{\n  "a": 1,\n  ')):
        assert not accepts(call, bundled, bad), bad
    xml = constraint_for(ToolCalls((ToolSchema("f", {
        "type": "object", "properties": {"o": {"type": "object"}}, "required": ["o"]}),), "xml"), bundled)
    assert accepts(xml, bundled, xml_call("f", o='{"k": [1, 2]}'))
    assert not accepts(xml, bundled, xml_call("f", o='{"k": [1,  2]}'))


def test_text_then_optional_calls(bundled):
    """tool_choice auto with strict tools: any text, and a call, if the model makes one, fits its schema."""
    call = constraint_for(ToolCalls(TOOLS), bundled)
    optional = combine([call], bundled, optional=True)
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert optional.kind == "text+tool_call"
    for text in ("", "def f(x): {not json", f"Let me add.\n\n{good}", good):
        assert accepts(optional, bundled, text), text
    assert not accepts(optional, bundled, good.replace('"b": 2', '"b": "two"'))
    assert not accepts(optional, bundled, f"{good} and more")  # nothing after the calls
    assert accepts(combine([call], bundled, "</think>", optional=True), bundled, f"hmm</think>\n\nok {good}")


def test_call_arguments_hold_only_declared_keys(bundled):
    """A schema that does not say additionalProperties is read as false in a call's arguments (nested
    objects and $defs too); true or a schema allows other keys. Declared keys never repeat."""
    def call(arguments):
        return f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'

    item = {"type": "object", "properties": {"k": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "o": item, "r": {"$ref": "#/$defs/I"},
                                               "free": {"type": "object"}, "xs": {"type": "array", "items": item}},
              "$defs": {"I": item}}
    for form, text in (("json", call), ("xml", None)):
        constraint = constraint_for(ToolCalls((ToolSchema("f", schema),), form), bundled)
        if form == "xml":
            assert accepts(constraint, bundled, xml_call("f", a="x", o='{"k": 1}', free='{"any": [1]}'))
            assert not accepts(constraint, bundled, xml_call("f", a="x", o='{"k": 1, "j": 2}'))
            continue
        good = '{"a": "x", "o": {"k": 1}, "r": {"k": 2}, "free": {"any": 1}, "xs": [{"k": 3}]}'
        assert accepts(constraint, bundled, text(good))
        for bad in ('{"a": "x", "b": "y"}', '{"a": "x", "a": "y"}', '{"o": {"k": 1, "j": 2}}', '{"r": {"j": 2}}',
                    '{"xs": [{"k": 1, "k": 2}]}', '{"xs": [{"j": 1}]}'):
            assert not accepts(constraint, bundled, text(bad)), bad
    opened = {**schema, "additionalProperties": True}
    assert accepts(constraint_for(ToolCalls((ToolSchema("f", opened),)), bundled), bundled, call('{"a": "x", "b": 1}'))
    typed = {**schema, "additionalProperties": {"type": "integer"}}
    typed_calls = constraint_for(ToolCalls((ToolSchema("f", typed),)), bundled)
    assert accepts(typed_calls, bundled, call('{"a": "x", "b": 1}'))
    assert not accepts(typed_calls, bundled, call('{"a": "x", "b": "y"}'))
    assert accepts(constraint_for(ToolCalls((ToolSchema("f", {"type": "object", "properties": {}}),)), bundled),
                   bundled, call("{}"))
    # Schemas combined by allOf are intersected: left as written, so their keys stay allowed together.
    both = {"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}},
                                        {"properties": {"b": {"type": "integer"}}}]}
    assert accepts(constraint_for(ToolCalls((ToolSchema("f", both),)), bundled), bundled, call('{"a": "x", "b": 1}'))
    # A response_format schema keeps JSON Schema's reading: other keys allowed.
    assert accepts(constraint_for(JsonSchema(item), bundled), bundled, '{"k": 1, "j": 2}')
