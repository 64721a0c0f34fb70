"""Structured outputs: vLLM 0.33's parameters, JSON Schema to regex, and the token mask."""

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from labkit.checks import ParameterError
from labkit.engine import LLM, SamplingParams, write_tiny_model
from labkit.engine.constraints import RegexConstraint
from labkit.engine.structured import (
    JSON_MAX_NESTING,
    StructuredOutputsParams,
    choice_to_regex,
    from_response_format,
    json_object_regex,
    json_schema_to_regex,
)

# vllm/sampling_params.py of vLLM 0.33.0, class StructuredOutputsParams (init fields, in order).
VLLM_FIELDS = ["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
               "disable_additional_properties", "whitespace_pattern", "structural_tag"]
SEPARATORS = [None, (",", ":")]  # json.dumps' default and compact styles; both are in policy

# --- strategies: schemas of the teaching subset, and instances valid for them ---------------

# JSON string characters the regex writes: no raw controls (json.dumps escapes \b\f\n\r\t,
# which the regex allows), nothing in U+007F-U+009F, no surrogates.
_CHARS = st.characters(exclude_categories=("Cs",), exclude_characters=(
    [chr(c) for c in range(0x20) if chr(c) not in "\b\f\n\r\t"]
    + [chr(c) for c in range(0x7F, 0xA0)]))
_TEXT = st.text(_CHARS, max_size=6)
_SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | _TEXT \
    | st.floats(allow_nan=False, allow_infinity=False)
_NAMES = st.text("ab.*\" \\é", min_size=1, max_size=3)


@st.composite
def _string_schemas(draw):
    schema = {"type": "string"}
    low = draw(st.none() | st.integers(0, 3))
    high = draw(st.none() | st.integers(low or 0, 5))
    if low is not None:
        schema["minLength"] = low
    if high is not None:
        schema["maxLength"] = high
    return schema


_LEAVES = st.one_of(
    _string_schemas(),
    st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                     {"type": "null"}, {"type": ["string", "null"]}, {}]),
    st.lists(_SCALARS, min_size=1, max_size=4).map(lambda values: {"enum": values}),
    _SCALARS.map(lambda value: {"const": value}),
)


@st.composite
def _objects(draw, children):
    properties = draw(st.dictionaries(_NAMES, children, max_size=4))
    required = [name for name in properties if draw(st.booleans())]
    schema = {"type": "object", "properties": properties, "required": required}
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


@st.composite
def _arrays(draw, children):
    schema = {"type": "array", "items": draw(children)}
    low = draw(st.integers(0, 2))
    if low:
        schema["minItems"] = low
    if draw(st.booleans()):
        schema["maxItems"] = draw(st.integers(low, 3))
    return schema


SCHEMAS = st.recursive(_LEAVES, lambda children: st.one_of(
    _objects(children), _arrays(children),
    st.lists(children, min_size=1, max_size=3).map(lambda branches: {"anyOf": branches}),
    _objects(children).map(lambda s: {"properties": s["properties"],
                                      "required": s["required"]}),  # object without "type"
), max_leaves=8)

_ANY_JSON = st.recursive(_SCALARS, lambda children: st.lists(children, max_size=3)
                         | st.dictionaries(_TEXT, children, max_size=3), max_leaves=6)


def instances(schema):
    """A strategy for values valid for ``schema`` (a schema drawn from SCHEMAS)."""
    if not schema:
        return _ANY_JSON.filter(lambda value: _depth(value) <= JSON_MAX_NESTING)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    if "anyOf" in schema:
        return st.one_of([instances(branch) for branch in schema["anyOf"]])
    kind = schema.get("type", "object")
    if kind == ["string", "null"]:
        return st.none() | _TEXT
    if kind == "string":
        return st.text(_CHARS, min_size=schema.get("minLength", 0),
                       max_size=schema.get("maxLength", 6))
    if kind == "object":
        return _object_instances(schema)
    if kind == "array":
        return st.lists(instances(schema["items"]), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 3))
    return {"integer": st.integers(-10**9, 10**9), "boolean": st.booleans(), "null": st.none(),
            "number": st.integers(-99, 99) | st.floats(allow_nan=False,
                                                       allow_infinity=False)}[kind]


@st.composite
def _object_instances(draw, schema):
    value = {}
    for name, sub in schema["properties"].items():  # the regex writes them in schema order
        if name in schema["required"] or draw(st.booleans()):
            value[name] = draw(instances(sub))
    return value


def dumps(value, separators) -> str:
    return json.dumps(value, ensure_ascii=False, separators=separators)


def is_valid(value, schema) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


# --- JSON Schema to regex: valid values match, and whatever matches is valid ------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), SCHEMAS, st.sampled_from(SEPARATORS))
def test_valid_values_match_the_schema_regex(data, schema, separators):
    value = data.draw(instances(schema))
    assert is_valid(value, schema)  # the strategy itself is right
    assert regex.fullmatch(json_schema_to_regex(schema), dumps(value, separators))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), SCHEMAS, SCHEMAS, st.sampled_from(SEPARATORS))
def test_whatever_matches_the_schema_regex_is_valid(data, schema, other, separators):
    """Values of another schema, or any JSON at all, match only when they are valid."""
    value = data.draw(instances(other) | _ANY_JSON)
    text = dumps(value, separators)
    if regex.fullmatch(json_schema_to_regex(schema), text):
        assert is_valid(json.loads(text), schema)


SCHEMA = {
    "$defs": {"Color": {"enum": ["red", "green", "dark blue"]}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer"},
        "colors": {"type": "array", "items": {"$ref": "#/$defs/Color"}, "maxItems": 2},
        "pet": {"oneOf": [{"type": "null"},
                          {"type": "object", "properties": {"legs": {"type": "integer"}},
                           "required": ["legs"], "additionalProperties": False}]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
}


@pytest.mark.parametrize("value", [
    {"name": "Ada", "age": 36},
    {"name": "B", "age": -1, "colors": ["dark blue"], "pet": None, "ok": True},
    {"name": "x\"y\\z", "age": 0, "pet": {"legs": 4}},
    {"name": "Ada", "age": 36, "ok": False},
])
def test_handwritten_values_match(value):
    assert is_valid(value, SCHEMA)
    for separators in SEPARATORS:
        assert regex.fullmatch(json_schema_to_regex(SCHEMA), dumps(value, separators))


@pytest.mark.parametrize("text", [
    '{"age": 36}',                                     # required name missing
    '{"name": "", "age": 36}',                         # minLength
    '{"name": "123456789", "age": 36}',                # maxLength
    '{"name": "Ada", "age": 3.5}',                     # not an integer
    '{"name": "Ada", "age": 01}',                      # not JSON
    '{"name": "Ada", "age": 36, "colors": ["blue"]}',  # not in the enum
    '{"name": "Ada", "age": 36, "colors": ["red", "red", "red"]}',  # maxItems
    '{"name": "Ada", "age": 36, "pet": {"legs": 4, "tail": true}}',  # additionalProperties
    '{"name": "Ada", "age": 36, "ok": "yes"}',
    '{"name": "A"a", "age": 36}',                      # a raw quote inside a string
    '{"name": "A\\xa", "age": 36}',                    # not a JSON escape
    '{"name": "A\x01", "age": 36}',                    # a raw control character
    '{"name": "Ada",  "age": 36}',                     # two spaces: outside the policy
    '{"name": "Ada", "age": 36}\n',
])
def test_invalid_or_out_of_policy_texts_do_not_match(text):
    assert not regex.fullmatch(json_schema_to_regex(SCHEMA), text)


def test_disable_any_whitespace_writes_compact_json():
    pattern = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).to_regex()
    value = {"name": "Ada", "age": 36, "ok": True}
    assert regex.fullmatch(pattern, dumps(value, (",", ":")))
    assert not regex.fullmatch(pattern, dumps(value, None))


def test_schema_as_json_text_and_property_names_are_literal():
    schema = {"type": "object", "properties": {"a.b*": {"const": "(x|y)"}}, "required": ["a.b*"]}
    pattern = StructuredOutputsParams(json=json.dumps(schema)).to_regex()
    assert regex.fullmatch(pattern, '{"a.b*": "(x|y)"}')
    assert not regex.fullmatch(pattern, '{"aXbb": "x"}')


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "format": "date"}, "format"),
    ({"type": "string", "pattern": "^[a-z]+$"}, "pattern"),
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"type": "array", "items": {}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "prefixItems": [{}]}, "prefixItems"),
    ({"not": {"type": "null"}}, "not"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf"),
    ({"anyOf": [{"type": "string"}], "type": "string"}, "type"),
    ({"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/Node"}}}}}, "$ref"),
    ({"$ref": "#/$defs/Missing"}, "$ref"),
    ({"$ref": "https://example.com/schema"}, "$ref"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
     "additionalProperties"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"type": "date"}, "type"),
    ({"type": "string", "maxLength": -1}, "maxLength"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems"),
    ({"type": "string", "enum": [1, 2]}, "enum"),
])
def test_unsupported_or_bad_keywords_name_the_keyword(schema, keyword):
    with pytest.raises(ParameterError) as err:
        json_schema_to_regex(schema)
    assert err.value.param == keyword and str(err.value).startswith(keyword)


def test_supported_extras_of_the_subset():
    # allOf of one schema (what Pydantic writes for a documented $ref), definitions, type lists
    schema = {"definitions": {"N": {"type": "integer"}},
              "type": "object",
              "properties": {"n": {"allOf": [{"$ref": "#/definitions/N"}]},
                             "s": {"type": ["string", "null"], "maxLength": 2},
                             "m": {"type": "object", "additionalProperties": {"type": "boolean"}},
                             "e": {"type": "object", "additionalProperties": False}},
              "required": ["n", "s", "m", "e"]}
    pattern = json_schema_to_regex(schema)
    for value in [{"n": 1, "s": None, "m": {}, "e": {}},
                  {"n": -7, "s": "ab", "m": {"x": True, "y": False}, "e": {}}]:
        assert is_valid(value, schema) and regex.fullmatch(pattern, dumps(value, None))
    assert not regex.fullmatch(pattern, '{"n": 1, "s": "abc", "m": {}, "e": {}}')
    assert not regex.fullmatch(pattern, '{"n": 1, "s": null, "m": {"x": 1}, "e": {}}')


def _nested(depth: int) -> dict:
    """An object whose arrays and objects nest ``depth`` levels, alternating kinds."""
    value = 1
    for level in range(depth - 1):
        value = {"k": value} if level % 2 else [value]
    return {"top": value}


@given(st.dictionaries(_TEXT, _ANY_JSON, max_size=3), st.sampled_from(SEPARATORS))
@settings(deadline=None)
def test_json_object_matches_any_object_up_to_the_nesting_bound(value, separators):
    assume(_depth(value) <= JSON_MAX_NESTING)
    assert regex.fullmatch(json_object_regex(), dumps(value, separators))


def _depth(value) -> int:
    if isinstance(value, dict | list):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max(map(_depth, children), default=0)
    return 0


def test_json_object_bound_and_non_objects():
    pattern = json_object_regex()
    assert regex.fullmatch(pattern, dumps(_nested(JSON_MAX_NESTING), None))
    assert not regex.fullmatch(pattern, dumps(_nested(JSON_MAX_NESTING + 1), None))
    for text in ["[]", "1", '"x"', "null", "{", '{"a": 1,}', "{'a': 1}"]:
        assert not regex.fullmatch(pattern, text)


# --- the parameters: vLLM's names and checks ----------------------------------------------

def test_fields_are_vllms():
    assert [f.name for f in dataclasses.fields(StructuredOutputsParams)] == VLLM_FIELDS


@pytest.mark.parametrize("fields", [{}, {"json": {}, "regex": "a"}, {"choice": ["a"],
                                                                       "json_object": True}])
def test_exactly_one_kind(fields):
    with pytest.raises(ParameterError) as err:
        StructuredOutputsParams(**fields)
    assert err.value.param == "structured_outputs"


@pytest.mark.parametrize("fields, param", [
    ({"grammar": 'root ::= "a"'}, "grammar"),
    ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag"),
    ({"json_object": False}, "json_object"),
    ({"json": {}, "whitespace_pattern": r"[\n ]*"}, "whitespace_pattern"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": "a\x00"}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": "a"}, "choice"),
    ({"json": ""}, "json"),
    ({"json": "{not json"}, "json"),
    ({"json": [1]}, "json"),
])
def test_unsupported_and_bad_values_name_their_parameter(fields, param):
    with pytest.raises(ParameterError) as err:
        StructuredOutputsParams(**fields).to_regex()
    assert err.value.param == param


def test_grammars_are_refused_with_the_reason():
    with pytest.raises(ParameterError, match="teaching engine does not support"):
        StructuredOutputsParams(grammar='root ::= "a"').to_regex()


@given(st.lists(st.text(max_size=5), min_size=1, max_size=5), st.text(max_size=5))
def test_choice_is_literal_whatever_its_metacharacters(choices, other):
    pattern = choice_to_regex(choices)
    assert all(regex.fullmatch(pattern, choice) for choice in choices)
    assert bool(regex.fullmatch(pattern, other)) == (other in choices)
    assert StructuredOutputsParams(choice=choices).to_regex() == pattern


def test_choice_escapes_regex_metacharacters():
    pattern = choice_to_regex(["a.b", "c|d", "(e)", "f*"])
    assert regex.fullmatch(pattern, "c|d") and regex.fullmatch(pattern, "f*")
    assert not any(regex.fullmatch(pattern, t) for t in ["axb", "c", "d", "e", "ff"])


def test_from_dict_names_unknown_fields():
    assert StructuredOutputsParams.from_dict({"regex": "a+"}).to_regex() == "a+"
    with pytest.raises(ParameterError, match="guided_json") as err:
        StructuredOutputsParams.from_dict({"guided_json": {}})
    assert err.value.param == "structured_outputs"


# --- OpenAI's response_format ----------------------------------------------------------------

def test_response_format_maps_like_vllm():
    assert from_response_format({"type": "text"}) is None
    base = StructuredOutputsParams(regex="a+")
    assert from_response_format({"type": "text"}, base) is base
    assert from_response_format({"type": "json_object"}).json_object is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = from_response_format({"type": "json_schema",
                                   "json_schema": {"name": "thing", "schema": schema}},
                                  StructuredOutputsParams(json={}, disable_any_whitespace=True))
    assert params.json == schema and params.disable_any_whitespace
    assert regex.fullmatch(params.to_regex(), '{"a":1}')


@pytest.mark.parametrize("response_format, structured_outputs, param", [
    ({"type": "json_schema"}, None, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, None, "response_format"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, None, "response_format"),
    ({"type": "structural_tag", "format": {}}, None, "response_format"),
    ({"type": "xml"}, None, "response_format"),
    ("json_object", None, "response_format"),
    ({"type": "json_object"}, StructuredOutputsParams(regex="a"), "structured_outputs"),
])
def test_bad_response_formats_name_their_parameter(response_format, structured_outputs, param):
    with pytest.raises(ParameterError) as err:
        from_response_format(response_format, structured_outputs)
    assert err.value.param == param


# --- the token mask --------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.data(), SCHEMAS)
def test_mask_equals_the_definition(data, schema):
    """Grouping by first character changes nothing: the mask is the brute-force one."""
    pattern = json_schema_to_regex(schema)
    full = dumps(data.draw(instances(schema)), data.draw(st.sampled_from(SEPARATORS)))
    cut = data.draw(st.integers(0, len(full)))
    text = full[:cut]
    # Pieces from the characters around the cut, so that some of them continue the output.
    chars = st.sampled_from(sorted(set(full[max(cut - 3, 0):cut + 3] + '{}"a1 \\\ufffd')))
    pieces = data.draw(st.lists(st.text(chars, max_size=3), min_size=1, max_size=40))
    eos = len(pieces)
    mask = RegexConstraint(pattern, [*pieces, ""], eos).allowed(text)
    expected = [bool(p) and "\ufffd" not in p
                and regex.fullmatch(pattern, text + p, partial=True) is not None for p in pieces]
    assert mask[:eos].tolist() == expected
    assert mask[eos] == (regex.fullmatch(pattern, text) is not None)


def test_partial_utf8_tokens_are_never_allowed():
    """Alone, a token holding part of a character decodes to U+FFFD: its text is unknown."""
    pieces = ["\ufffd", "a\ufffd", "a", '"', ""]
    mask = RegexConstraint(json_schema_to_regex({"type": "string"}), pieces, 4).allowed('"')
    assert mask.tolist() == [False, False, True, True, False]


# End-of-sequence first (hypothesis shrinks towards it), then JSON's punctuation, then text;
# "\ufffd" stands for a partial UTF-8 token and "\x85" for a character the regex leaves out.
_VOCAB = ["", "}", "]", '"', ",", ":", " ", "{", "[", "0", "1", "-", ".", "e", "+", "a", "\\",
          "n", "t", "r", "u", "l", "f", "s", "true", "null", '":', '", "', "é", "\ufffd", "\x85"]


@settings(max_examples=300, deadline=None)
@given(st.data(), SCHEMAS)
@pytest.mark.slow
def test_every_walk_the_mask_allows_ends_in_valid_json(data, schema):
    """Sample like the engine does, one allowed token at a time: what ends is valid."""
    constraint = RegexConstraint(json_schema_to_regex(schema), _VOCAB, eos_token_id=0)
    text = ""
    for _ in range(60):
        allowed = np.flatnonzero(constraint.allowed(text)).tolist()
        assume(allowed)  # a const or enum may need a character this vocabulary lacks
        token = data.draw(st.sampled_from(allowed))
        if token == 0:
            assert is_valid(json.loads(text), schema)
            return
        text += _VOCAB[token]


def test_invalid_regex_names_the_parameter():
    with pytest.raises(ParameterError, match="regex: invalid pattern") as err:
        RegexConstraint("(unclosed", ["a"], None)
    assert err.value.param == "regex"


# --- end to end: a tiny random model writes valid JSON ----------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_tiny_model_writes_json_valid_for_the_schema(tiny):
    # Bounded strings and arrays, so that a random model finishes well within max_tokens.
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer"},
                             "colors": {"type": "array", "items": {"enum": ["red", "green"]},
                                        "maxItems": 3},
                             "ok": {"type": "boolean"}},
              "required": ["name", "age"]}
    pattern = StructuredOutputsParams(json=schema).to_regex()
    llm = LLM(tiny)
    for seed in range(5):
        out = llm.generate("Describe a person as JSON:",
                           SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                                          regex=pattern))[0].outputs[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
