"""Structured output: a grammar (any JSON object, a JSON schema, tool calls) as a logits processor.

What to hold the output to comes as a spec (JsonSchema, ToolCalls) and `constraint_for` compiles it;
the specs are the engine's own terms, so each API translates its request fields into them.

llguidance compiles the grammar against the model's vocabulary and answers, for a generated
prefix, which tokens keep the output inside the grammar; every other token gets -inf, and EOS is
allowed only where the grammar accepts. Like the penalties (round/processors.py), the mask is a function
of the generated tokens only, so the engine applies it to draft rows and verify rows alike and
drafting stays exact. The matcher under it is stateful: asked about a prefix, it rolls back to
the longest prefix it shares with the one it holds and consumes the rest, so checking k drafts and
dropping the rejected ones costs k token steps and a rollback, not a rebuild.

llguidance (not xgrammar, not outlines-core): no torch or pydantic, wheels for Linux x86-64 and
macOS arm64, rollback; masks cost ~12 us a token on a 4k vocabulary and ~28 us on 131k, and a
schema compiles in ~2 ms (outlines-core: 0.8 s on 131k, and 7-18 s for "any JSON object").
"""

import json
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import llguidance
import mlx.core as mx
import numpy as np

from .errors import DynoError

JSON_OBJECT = {"type": "object"}  # what "any JSON object" compiles to
# Whitespace between JSON tokens, bounded as llama.cpp's JSON grammars bound it: unbounded, a model
# can fill max_tokens with spaces. A schema's own "x-guidance" whitespace options replace these.
JSON_OPTIONS = {"whitespace_pattern": r"[ \t]{0,20}|\n{1,2}[ \t]{0,20}"}
# A tool call's JSON as Qwen's templates write it (`tojson`: ", " and ": ", no other whitespace),
# which is what the model was trained on; free whitespace let a sampled forced call run to max_tokens.
TOOL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Qwen's JSON tool-call form (its chat templates' <tool_call> block around {"name", "arguments"}).
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
FORMS = ("json", "xml")  # the tool-call forms a grammar can hold a call to
NO_TOOLS = "invalid tool calls: no tools were given"


@dataclass(frozen=True)
class JsonSchema:
    """Output that is one JSON value valid against `schema`; None: any JSON object."""

    schema: Optional[Mapping] = None


@dataclass(frozen=True)
class ToolSchema:
    """A tool a call may name: its name and the JSON schema of its arguments."""

    name: str
    parameters: Mapping


@dataclass(frozen=True)
class ToolCalls:
    """Output that is `open` + a call of one of `tools` + `close`, repeated when `parallel` (calls
    separated by a newline, as Qwen's templates write them).

    form "json": the call is Qwen's JSON object (tool_call_schema). form "xml": the
    `<function=NAME>` / `<parameter=KEY>` form of Qwen3.5 and Qwen3-Coder templates (xml_call_lark).
    """

    tools: Tuple[ToolSchema, ...]
    form: str = "json"
    parallel: bool = True
    open: str = TOOL_CALL_OPEN
    close: str = TOOL_CALL_CLOSE


Spec = Union[JsonSchema, ToolCalls]


class Vocabulary:
    """A model's vocabulary as llguidance sees it: logits rows and the EOS tokens (compared by identity)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, rows: int):
        self.tokenizer, self.rows = tokenizer, rows
        self.eos = frozenset(tokenizer.eos_tokens)

    def __deepcopy__(self, memo):  # immutable, and llguidance's objects cannot be copied
        return self


# Building llguidance's token trie reads the whole vocabulary (~1 s on 131k tokens): once per tokenizer.
_vocabularies: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {(rows, eos): Vocabulary}


def vocabulary(lm) -> Vocabulary:
    """The grammar vocabulary of a LoadedModel: its tokenizer, logits width and EOS tokens (cached)."""
    tokenizer = lm.tokenizer
    key = (lm.vocab_size, tuple(sorted(lm.eos_token_ids)))
    per_tokenizer = _vocabularies.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps transformers'
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise DynoError("structured output needs a fast (tokenizer.json) tokenizer; this model has none")
        text = json.loads(backend.to_str())
        text["padding"] = text["truncation"] = None  # the vocabulary only; no batch shaping
        ll = llguidance.LLTokenizer(json.dumps(text), n_vocab=key[0], eos_token=list(key[1]) or None)
        per_tokenizer[key] = Vocabulary(ll, key[0])
    return per_tokenizer[key]


@dataclass(frozen=True)
class Constraint:
    """A grammar compiled for one model's vocabulary; SamplingParams carries it, each generation
    gets its own matcher (`processor()`). Equal when grammar and vocabulary are."""

    grammar: str  # llguidance's grammar (JSON text)
    vocabulary: Vocabulary = field(repr=False)
    kind: str = "json_schema"  # what it was made from: json_object, json_schema, tool_call, or a combination

    def __deepcopy__(self, memo):  # frozen and immutable: dataclasses.asdict may copy SamplingParams
        return self

    def processor(self) -> "GrammarProcessor":
        """A fresh logits processor for one generation."""
        return GrammarProcessor(self)


def _compile(grammar: str, lm, kind: str, what: str) -> Constraint:
    """Check `grammar` against the model's vocabulary; a grammar error is one DynoError line."""
    vocab = vocabulary(lm)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocab.tokenizer)
    if is_error:
        raise DynoError(f"invalid {what}: {_first_line(messages[0] if messages else 'rejected')}")
    return Constraint(grammar, vocab, kind)


def _first_line(message: str) -> str:
    lines = str(message).strip().splitlines()
    return lines[0] if lines else "rejected"


def _schema_grammar(schema: Any, what: str) -> str:
    if not isinstance(schema, Mapping):
        raise DynoError(f"invalid {what}: a schema must be a JSON object, got {type(schema).__name__}")
    try:
        options = schema.get("x-guidance")
        own = isinstance(options, Mapping) and bool({"whitespace_flexible", "whitespace_pattern"} & set(options))
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=None if own else JSON_OPTIONS)
    except (ValueError, TypeError) as e:  # not serialisable, or not an object
        raise DynoError(f"invalid {what}: {_first_line(e)}") from None


def constraint_for(spec: Spec, lm) -> Constraint:
    """`spec` compiled for the model's vocabulary; a bad schema or form is one DynoError line."""
    if isinstance(spec, JsonSchema):
        kind = "json_object" if spec.schema is None else "json_schema"
        schema = JSON_OBJECT if spec.schema is None else spec.schema
        return _compile(_schema_grammar(schema, "JSON schema"), lm, kind, "JSON schema")
    if isinstance(spec, ToolCalls):
        return _tool_calls(spec, lm)
    raise DynoError(f"not a constraint spec: {type(spec).__name__}")


def tool_call_schema(tools: Sequence[ToolSchema]) -> dict:
    """JSON schema of one call {"name": ..., "arguments": {...}} of one of `tools`, with the arguments
    valid against that tool's parameters (their own "#/$defs/..." references rebased to where they sit)."""
    if not tools:
        raise DynoError(NO_TOOLS)
    at = ["#/properties/arguments"] if len(tools) == 1 else [f"#/anyOf/{i}/properties/arguments"
                                                             for i in range(len(tools))]
    calls = [{
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": _rebased(t.parameters, base)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t, base in zip(tools, at)]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


_VALUES = ("const", "enum", "default", "examples")  # data, not schemas: never rebased


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local references ("#/$defs/X", "#") pointing into it at `base`, where it sits
    inside the call's schema (references are read from the root of the whole schema)."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in _VALUES:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, Mapping):  # names of properties or definitions, then schemas
            out[k] = {name: _rebased(sub, base) for name, sub in v.items()}
        else:
            out[k] = _rebased(v, base)
    return out


# Subschemas of the values an object or array holds, closed in turn by declared_only.
_VALUE_SCHEMAS = ("additionalProperties", "items", "additionalItems", "contains")
_VALUE_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# Keywords that combine an object with other schemas: an object using them is left open, since
# closing it would forbid the keys those schemas declare (llguidance intersects them).
_COMBINING = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependentSchemas",
              "unevaluatedProperties")


def declared_only(schema: Any, close: bool = True) -> Any:
    """`schema` with `"additionalProperties": false` in each object schema that declares its keys
    (`properties`, `patternProperties`) and does not say, so an object holds only those keys (as
    strict structured-output APIs read schemas). JSON Schema's own default allows any other key, with
    which a model wrote invented keys until max_tokens. An object that declares no keys at all
    (`{"type": "object"}`) is free-form and stays so; `"properties": {}` declares none: `{}`.

    llguidance writes declared keys in their order, once each, so no key repeats; a schema that
    allows other keys (additionalProperties true or a schema) keeps them, and a grammar cannot stop
    one of those from repeating. An object combined with allOf, anyOf, $ref and the like is left as
    written (the schemas it combines with are closed on their own, allOf's members excepted).
    """
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: declared_only(v) for k, v in out[key].items()}
    for key in _VALUE_SCHEMAS:
        if isinstance(out.get(key), Mapping):
            out[key] = declared_only(out[key])
    for key in _VALUE_SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [declared_only(v) for v in out[key]]
    if isinstance(out.get("allOf"), list):  # intersected: a member closed alone would forbid the others' keys
        out["allOf"] = [declared_only(v, close=False) for v in out["allOf"]]
    kind = out.get("type")
    declares = "properties" in out or "patternProperties" in out
    is_object = kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind)
    if close and declares and is_object and "additionalProperties" not in out and not any(k in out for k in _COMBINING):
        out["additionalProperties"] = False
    return out


def _tool_calls(spec: ToolCalls, lm) -> Constraint:
    """The grammar of ToolCalls. The markers' special tokens (Qwen's <tool_call>) are matched as
    those tokens, not spelled out. Arguments hold only the keys their schema declares (declared_only)."""
    if spec.form not in FORMS:
        raise DynoError(f"invalid tool-call form {spec.form!r}: json or xml")
    if not spec.tools:
        raise DynoError(NO_TOOLS)
    vocab = vocabulary(lm)
    tools = tuple(ToolSchema(t.name, declared_only(t.parameters)) for t in spec.tools)
    if spec.form == "json":
        schema = tool_call_schema(tools)
        _schema_grammar(schema, "tool schema")  # a non-serialisable schema fails with its own message
        schema = {"x-guidance": TOOL_JSON_OPTIONS, **schema}  # inside Lark, %json takes options from the schema
        body, rules = f"%json {json.dumps(schema)}", ""
    else:
        body, rules = xml_call_lark(tools)
    call = f"{_lark_text(spec.open, vocab)} {body} {_lark_text(spec.close, vocab)}"
    start = 'call ("\\n" call)*' if spec.parallel else "call"
    grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {start}\ncall: {call}\n{rules}")
    return _compile(grammar, lm, "tool_call", "tool schema")


def xml_call_lark(tools: Sequence[ToolSchema]) -> tuple:
    """(Lark body, its rules) of one call in the XML form, as Qwen3.5's template writes it:
    `<function=NAME>\\n`, then `<parameter=KEY>\\nVALUE\\n</parameter>\\n` per argument, then `</function>`.

    Arguments come in the schema's property order, required ones always, the others optionally.
    A string-typed value is raw text (mlx-lm's qwen3_coder parser reads it as is): its enum or const,
    else any text within its min/maxLength (string patterns and formats are not enforced in this form);
    every other value is JSON valid against its schema (the parser json-decodes it), booleans also
    in Python's spelling, which the template's `| string` writes.
    """
    alternatives, rules = [], []
    for i, tool in enumerate(tools):
        name, parameters = tool.name, tool.parameters
        _schema_grammar(parameters, "tool schema")
        properties = parameters.get("properties") or {}
        required = parameters.get("required")
        required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
        params = []
        for j, (key, prop) in enumerate(properties.items() if isinstance(properties, Mapping) else ()):
            rule = f"p{i}_{j}"
            opening = json.dumps(f"<parameter={key}>\n")
            prop = dict(prop) if isinstance(prop, Mapping) else {}
            prop.update({k: parameters[k] for k in ("$defs", "definitions") if k in parameters})  # for $refs
            value = _xml_value(prop, f"v{i}_{j}", rules)
            rules.append(f"{rule}: {opening} {value}")
            params.append(rule if key in required else f"{rule}?")
        rules.append(f"f{i}: {json.dumps(f'<function={name}>' + chr(10))} {' '.join(params)} \"</function>\"")
        alternatives.append(f"f{i}")
    return f"({' | '.join(alternatives)})", "\n".join(rules) + "\n"


def _xml_value(prop: Mapping, rule: str, rules: List[str]) -> str:
    """A parameter's value and the line after it, as Lark (extra rules appended to `rules`)."""
    end = '"\\n</parameter>\\n"'
    if prop.get("type") == "string":
        choices = [prop["const"]] if "const" in prop else prop.get("enum")
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            return f"({' | '.join(json.dumps(c) for c in choices)}) {end}"
        low, high = prop.get("minLength", 0), prop.get("maxLength")
        low = low if isinstance(low, int) and low >= 0 else 0
        high = f"{high}" if isinstance(high, int) and high >= low else ""
        # Lazy: the text ends at the first closing tag, which it therefore cannot contain.
        rules.append(f'{rule}[lazy]: /(?s:.{{{low},{high}}})/ "\\n</parameter>"')
        return f'{rule} "\\n"'
    value = f"%json {json.dumps({'x-guidance': TOOL_JSON_OPTIONS, **prop})}"
    if prop.get("type") == "boolean":
        value = f'({value} | "True" | "False")'
    return f"{value} {end}"


def combine(constraints: Sequence[Constraint], lm, reasoning_end: Optional[str] = None,
            optional: bool = False) -> Constraint:
    """Output that one of `constraints` accepts (tool calls or a JSON schema, say), after the
    model's reasoning when `reasoning_end` is given. `optional`: free text (no special tokens)
    first, and the constrained part only if the model starts it (calls the model may make, which
    then follow their schemas).

    For a prompt that opened a reasoning block (a <think> the template wrote): free text without
    special tokens, `reasoning_end`, at most two newlines, then the constrained answer. The text is
    not constrained, as the model's answer is not (vLLM's structured output also starts after the
    reasoning), and it stays a function of the prefix, so drafting stays exact.
    """
    constraints = list(constraints)
    if not constraints:
        raise DynoError("nothing to combine")
    if len(constraints) == 1 and reasoning_end is None and not optional:
        return constraints[0]
    vocab = vocabulary(lm)
    entries = []
    for i, c in enumerate(constraints):
        entry = _grammar_entry(c.grammar)
        entry["name"] = f"answer{i}"
        entries.append(entry)
    answer = "(" + " | ".join(f"@answer{i}" for i in range(len(entries))) + ")"
    answer = f"/(?s:.*)/ {answer}?" if optional else answer
    thinking = f'/(?s:.*)/ {_lark_text(reasoning_end, vocab)} /\\n{{0,2}}/ ' if reasoning_end else ""
    top = {"grammars": [{"lark_grammar": f"start: {thinking}{answer}\n"}, *entries]}
    kind = ("text+" if optional else "") + "+".join(c.kind for c in constraints)
    return _compile(json.dumps(top), lm, f"reasoning+{kind}" if reasoning_end else kind, "grammar")


def _grammar_entry(grammar: str) -> dict:
    """One llguidance grammar (JSON or Lark text) as an entry of a top-level grammar list."""
    if grammar.lstrip().startswith("{"):
        grammars = json.loads(grammar).get("grammars") or []
        if len(grammars) != 1:
            raise DynoError("a combined grammar cannot be combined again")
        return dict(grammars[0])
    return {"lark_grammar": grammar}


def _lark_text(text: str, vocab: Vocabulary) -> str:
    """`text` as a Lark sequence: string literals, and special tokens by id (<[id]>) since
    llguidance matches a special token only as itself."""
    if not text:
        return ""
    tokenizer = vocab.tokenizer
    parts, run = [], []
    for t in tokenizer.tokenize_str(text, parse_special=True):
        if tokenizer.is_special_token(t):
            if run:
                parts.append(json.dumps(tokenizer.decode_str(run)))
                run = []
            parts.append(f"<[{t}]>")
        else:
            run.append(t)
    if run:
        parts.append(json.dumps(tokenizer.decode_str(run)))
    return " ".join(parts)


def _common_prefix(a: List[int], b: List[int]) -> int:
    """Length of the longest common prefix of two token lists (binary search over C-speed compares)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    hi -= 1  # a[:hi + 1] != b[:hi + 1] from here on; a[:lo] == b[:lo]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class GrammarProcessor:
    """The mask for one generation, as a function of its generated tokens.

    Called the mlx-lm way, `(tokens, logits)`, it takes the tokens of its first call as the
    prompt (mlx-lm's generate_step and BatchGenerator, and the engine's PrefixProcessors, call
    processors first with the prompt, then with one more token a position) and masks for what
    follows them. `mask(generated, logits)` is the same with the generated tokens given.
    """

    MASKS_KEPT = 32  # masks cached by prefix length: a verify row reuses its draft row's

    def __init__(self, constraint: Constraint):
        self.vocab = constraint.vocabulary
        self.grammar = constraint.grammar
        self.matcher = self._new_matcher()
        self.consumed: List[int] = []  # the prefix the matcher holds
        self.prompt_length: Optional[int] = None
        self.words = np.zeros((self.vocab.rows + 31) // 32, dtype=np.int32)  # the mask, 1 bit a token
        self.shifts = mx.arange(32, dtype=mx.int32)
        self.masks: Dict[int, mx.array] = {}

    def _new_matcher(self) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.vocab.tokenizer, self.grammar, log_level=0)
        if matcher.is_error():
            raise DynoError(f"invalid grammar: {_first_line(matcher.get_error())}")
        return matcher

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.prompt_length is None:
            self.prompt_length = tokens.size
        return self.mask(tokens[self.prompt_length:].tolist(), logits)

    def mask(self, generated: Sequence[int], logits: mx.array) -> mx.array:
        """[1, V] `logits` with the tokens the grammar forbids after `generated` at -inf.

        A prefix the grammar rejects (a draft the verify pass will reject) or one that already
        holds EOS has no row that is ever used: its logits are returned unchanged.
        """
        if not self._follow(list(generated)):
            return logits
        allowed = self._allowed()
        masked = mx.where(allowed, logits, -mx.inf)
        # A draft row from a reduced draft vocabulary (draft_vocab.py) may hold no allowed token:
        # then draft uniformly over the allowed ones (any q is exact). Full rows are never empty.
        return mx.where(mx.any(masked > -mx.inf), masked, mx.where(allowed, 0.0, -mx.inf).astype(logits.dtype))

    def _follow(self, generated: List[int]) -> bool:
        """Move the matcher to `generated`; False when it is not a grammar prefix or ends past EOS."""
        keep = _common_prefix(self.consumed, generated)
        if keep < len(self.consumed):
            if not self.matcher.rollback(len(self.consumed) - keep) or self.matcher.is_error():
                self.matcher, keep = self._new_matcher(), 0  # rollback refused: replay from the start
            del self.consumed[keep:]
            self.masks = {n: m for n, m in self.masks.items() if n <= keep}
        new = generated[keep:]
        for i, t in enumerate(new):
            if t in self.vocab.eos:  # never consumed: nothing past EOS is generated
                new = new[:i]
                break
        ok = self.matcher.validate_tokens(new) if new else 0
        if ok and not self.matcher.consume_tokens(new[:ok]):
            raise DynoError(f"grammar matcher failed: {_first_line(self.matcher.get_error())}")
        self.consumed += new[:ok]
        return len(self.consumed) == len(generated)

    def _allowed(self) -> mx.array:
        """[V] bool: the tokens the grammar allows after the consumed prefix (cached by its length)."""
        n = len(self.consumed)
        if n not in self.masks:
            self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
            if self.matcher.is_error():
                raise DynoError(f"grammar matcher failed: {_first_line(self.matcher.get_error())}")
            words = mx.array(self.words)  # [W] int32, bit j of word w is token 32w + j
            bits = (words[:, None] >> self.shifts) & 1  # [W, 32]
            self.masks[n] = bits.reshape(-1)[: self.vocab.rows].astype(mx.bool_)
            if len(self.masks) > self.MASKS_KEPT:
                self.masks = {k: self.masks[k] for k in sorted(self.masks)[-self.MASKS_KEPT // 2 :]}
        return self.masks[n]
