"""Structured outputs with vLLM's parameters, enforced as one regular expression
(:ref:`ch02-sglang`).

vLLM 0.33 takes one constraint per request: ``SamplingParams(structured_outputs=
StructuredOutputsParams(json=schema))`` offline, and online the request field
``structured_outputs`` or OpenAI's ``response_format``. The kinds are a JSON schema (``json``),
a ``regex``, a list of ``choice`` strings, a ``grammar``, any JSON object (``json_object``) and
a ``structural_tag``. vLLM hands them to a grammar backend (xgrammar, guidance, outlines) that
compiles them to an automaton over tokens.

The teaching engine turns every kind that a regular expression can express into one regex, the
way outlines (vLLM's older backend) does with ``build_regex_from_schema``, and masks tokens with
:class:`~labkit.engine.constraints.RegexConstraint`. A grammar or a structural tag needs a
context-free parser, which it does not have: those are rejected with the parameter named.

Whitespace policy: outlines' default, one optional space (``[ ]?``) wherever JSON allows
whitespace (around ``{ } [ ] , :``), none before or after the document. ``json.dumps`` output
matches with its default separators and with ``separators=(",", ":")``; indented output does
not. ``disable_any_whitespace=True`` allows no whitespace at all.

Exactness: every string the regex accepts is valid for the schema. The converse is not the goal:
the regex writes each property in schema order, never writes undeclared properties, escapes only
``\\" \\\\ \\/ \\b \\f \\n \\r \\t``, and leaves out control characters (U+0000-U+001F and
U+007F-U+009F), like outlines.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import regex

from labkit.checks import ParameterError
from labkit.engine.constraints import compile_bounded

WHITESPACE = r"[ ]?"
STRING_CHAR = r'(?:[^"\\\x00-\x1f\x7f-\x9f]|\\["\\/bfnrt])'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"

JSON_MAX_NESTING = 3
"""How deep objects and arrays may nest where the schema leaves the value open (``{}``, an
object without ``properties``, ``json_object``). A regex cannot count brackets, so it spells
out every level; each level multiplies the pattern's size by about four."""

MAX_PATTERN_CHARS = 5_000_000
"""The longest regex a schema may turn into, counted while it is built (each subschema's
part once per level it sits in). Nested arrays double the pattern at every level and optional
properties square it, so a schema of a few hundred bytes could otherwise ask for more memory
than the machine has; any pattern near this size is refused later for its expanded size."""

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The constraint fields of ``StructuredOutputsParams``; exactly one must be set."""

_ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$schema", "$id",
                          "$comment", "deprecated", "readOnly", "writeOnly", "$defs",
                          "definitions"})
_KEYWORDS = {
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "string": frozenset({"minLength", "maxLength"}),
    "integer": frozenset(), "number": frozenset(), "boolean": frozenset(), "null": frozenset(),
}
_SCALARS = {"integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}


@dataclass
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams`` (``vllm/sampling_params.py``), field for field.

    Set exactly one of ``json`` (a JSON schema, as a dict or JSON text), ``regex``, ``choice``,
    ``grammar``, ``json_object`` or ``structural_tag``. ``disable_any_whitespace`` asks for
    JSON without whitespace. ``disable_additional_properties`` is accepted and changes nothing
    here, since the regex never writes undeclared properties. ``whitespace_pattern`` is
    rejected: vLLM 0.33 keeps the field but none of its backends reads it.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):  # "no" would read as true
                raise ParameterError(flag, f"{flag} must be true or false, got "
                                           f"{getattr(self, flag)!r}")
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ParameterError("structured_outputs",
                                 f"structured_outputs: you can only use one kind of constraint, "
                                 f"but {', '.join(given)} are specified")
        if not given:
            raise ParameterError("structured_outputs",
                                 f"structured_outputs: you must use one kind of constraint, "
                                 f"one of {', '.join(KINDS)}; none is specified")

    @classmethod
    def from_dict(cls, fields: Mapping) -> StructuredOutputsParams:
        """Build from a request's ``structured_outputs`` object, naming any unknown field."""
        if not isinstance(fields, Mapping):
            raise ParameterError("structured_outputs",
                                 "structured_outputs must be an object, got "
                                 f"{type(fields).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ParameterError("structured_outputs",
                                 f"structured_outputs: unknown field {unknown[0]!r}; the fields "
                                 f"are {', '.join(sorted(known))}")
        return cls(**fields)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`KINDS`."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    def to_regex(self) -> str:
        """The one regex whose full matches are the outputs this constraint allows.

        Raises :class:`~labkit.checks.ParameterError` naming the field (or, for a JSON
        schema, the keyword) that the teaching engine cannot honour.
        """
        if self.whitespace_pattern is not None:
            raise ParameterError("whitespace_pattern",
                                 "whitespace_pattern is not supported: vLLM 0.33 no longer reads "
                                 "it; use disable_any_whitespace=True for JSON without spaces")
        whitespace = "" if self.disable_any_whitespace else WHITESPACE
        kind = self.kind
        if kind == "regex":
            return _checked_regex(self.regex)
        if kind == "choice":
            return choice_to_regex(self.choice)
        if kind == "json":
            return json_schema_to_regex(self.json, whitespace=whitespace)
        if kind == "json_object":
            if self.json_object is not True:
                raise ParameterError("json_object",
                                     "json_object must be True if set; omit structured_outputs "
                                     "to disable structured outputs")
            return json_object_regex(whitespace=whitespace)
        raise ParameterError(kind, f"{kind}: the teaching engine does not support this kind of "
                                   "structured output: it needs a context-free grammar, and the "
                                   "engine enforces regular expressions only (json, regex, "
                                   "choice, json_object); run vLLM for grammars")


def from_response_format(response_format: Mapping,
                         structured_outputs: StructuredOutputsParams | None = None
                         ) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as structured outputs, mapped the way vLLM 0.33 does.

    ``text`` leaves ``structured_outputs`` as it is (``None``: no constraint); ``json_object``
    sets ``json_object=True``; ``json_schema`` sets ``json`` to ``json_schema.schema``. The
    format replaces the constraint field of ``structured_outputs`` and keeps its options
    (vLLM's ``dataclasses.replace``), so a request that also sets another kind is rejected.
    ``structural_tag`` is rejected: the teaching engine has no grammar backend.
    """
    if not isinstance(response_format, Mapping):
        raise ParameterError("response_format", "response_format must be an object with a "
                                                "'type', got " + type(response_format).__name__)
    kind = response_format.get("type")
    if kind == "text":
        return structured_outputs
    if kind == "json_object":
        overrides = {"json_object": True}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ParameterError("response_format",
                                 "response_format: when type is 'json_schema', the "
                                 "'json_schema' field must be provided")
        if not isinstance(spec.get("name"), str):
            raise ParameterError("response_format",
                                 "response_format.json_schema.name must be a string")
        if not isinstance(spec.get("schema"), Mapping):
            raise ParameterError("response_format",
                                 "response_format.json_schema.schema must be a JSON Schema "
                                 "object")
        overrides = {"json": dict(spec["schema"])}
    elif kind == "structural_tag":
        raise ParameterError("response_format",
                             "response_format: type 'structural_tag' is not supported by the "
                             "teaching engine, which has no grammar backend")
    else:
        raise ParameterError("response_format",
                             "response_format.type must be one of 'text', 'json_object', "
                             f"'json_schema', 'structural_tag', got {kind!r}")
    if structured_outputs is None:
        return StructuredOutputsParams(**overrides)
    return dataclasses.replace(structured_outputs, **overrides)


def choice_to_regex(choices: list[str]) -> str:
    """Exactly one of the strings, taken literally (regex metacharacters are escaped)."""
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ParameterError("choice", f"choice must be a list of strings, got {choices!r}")
    if not choices:
        raise ParameterError("choice", "choice cannot be an empty list")
    return "(?:" + "|".join(regex.escape(c, special_only=True) for c in choices) + ")"


def json_object_regex(*, whitespace: str = WHITESPACE) -> str:
    """Any JSON object whose objects and arrays nest at most :data:`JSON_MAX_NESTING` deep."""
    return _object_of(STRING, _any_value(whitespace, JSON_MAX_NESTING - 1), whitespace)


def json_schema_to_regex(schema: Mapping | str, *, whitespace: str = WHITESPACE) -> str:
    """A regex for JSON documents valid for ``schema``, in the teaching subset of JSON Schema.

    Supported: ``type`` (one or a list); objects with ``properties`` (written in their order,
    the ``required`` ones always, the others optionally) and ``additionalProperties``; arrays
    with ``items``, ``minItems``, ``maxItems``; strings with ``minLength``, ``maxLength``;
    integer, number, boolean, null; ``enum``, ``const``, ``anyOf``, ``oneOf`` (as anyOf: exact
    when the branches do not overlap), ``allOf`` of one schema, and non-recursive ``$ref`` into
    ``$defs`` or ``definitions``. Any other keyword raises a ParameterError naming it.
    """
    if isinstance(schema, str):
        if not schema.strip():
            raise ParameterError("json", "json: the JSON schema cannot be an empty string")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ParameterError("json", f"json: the schema is not valid JSON: {err}") from None
    if not isinstance(schema, Mapping):
        raise ParameterError("json", f"json must be a JSON Schema object, got {schema!r}")
    try:
        return _SchemaConverter(schema, whitespace).value(schema, "#")
    except RecursionError:  # a few hundred levels: far past any schema a regex could serve
        raise ParameterError("json", "json: the schema nests too deeply") from None


@dataclass
class _SchemaConverter:
    """Walks a schema top-down, returning a regex for each subschema."""

    root: Mapping
    ws: str
    expanding: list[str] = field(default_factory=list)  # $refs being expanded: no recursion
    spent: int = 0  # characters of regex built so far, against MAX_PATTERN_CHARS

    def value(self, schema, path: str) -> str:
        pattern = self._value(schema, path)
        self._spend(len(pattern), path)
        return pattern

    def _spend(self, size: int, path: str) -> None:
        """Count ``size`` more characters of regex, refusing the schema past the budget."""
        self.spent += size
        if self.spent > MAX_PATTERN_CHARS:
            raise ParameterError("json", f"json: the schema's regex grows past "
                                         f"{MAX_PATTERN_CHARS} characters (at {path}): nested "
                                         f"arrays double it at every level, optional "
                                         f"properties square it")

    def _value(self, schema, path: str) -> str:
        if schema is True:
            return _any_value(self.ws, JSON_MAX_NESTING)
        if not isinstance(schema, Mapping):
            raise ParameterError("json", f"json: a subschema must be an object, got {schema!r} "
                                         f"(at {path})")
        keys = set(schema) - _ANNOTATIONS
        if not keys:
            return _any_value(self.ws, JSON_MAX_NESTING)
        for combinator in ("$ref", "allOf", "anyOf", "oneOf"):
            if combinator in keys:
                _no_siblings(combinator, keys, path)
        if "$ref" in keys:
            return self._ref(schema["$ref"], path)
        if "allOf" in keys:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise ParameterError("allOf", f"allOf: only an allOf of exactly one schema is "
                                              f"supported (at {path})")
            return self.value(parts[0], f"{path}/allOf/0")
        for combinator in ("anyOf", "oneOf"):
            if combinator in keys:
                branches = schema[combinator]
                if not isinstance(branches, list) or not branches:
                    raise ParameterError(combinator, f"{combinator} must be a non-empty list of "
                                                     f"schemas (at {path})")
                return _alternatives(self.value(b, f"{path}/{combinator}/{i}")
                                     for i, b in enumerate(branches))
        if "enum" in keys or "const" in keys:
            return self._enum(schema, keys, path)
        unknown = sorted(keys - {"type"} - set().union(*_KEYWORDS.values()))
        if unknown:
            raise ParameterError(unknown[0], f"{unknown[0]}: the teaching engine does not support "
                                             f"this JSON Schema keyword (at {path})")
        return _alternatives(self._typed(t, schema, path) for t in _types(schema, keys, path))

    def _typed(self, kind: str, schema: Mapping, path: str) -> str:
        if kind == "object":
            return self._object(schema, path)
        if kind == "array":
            return self._array(schema, path)
        if kind == "string":
            low = _count(schema, "minLength", 0, path)
            high = _count(schema, "maxLength", None, path)
            return f'"{STRING_CHAR}{_repeat(low, high, path, "maxLength")}"'
        return _SCALARS[kind]

    def _object(self, schema: Mapping, path: str) -> str:
        extra = schema.get("additionalProperties", True)
        if "properties" not in schema:
            if schema.get("required"):
                raise ParameterError("required", f"required: needs properties that define the "
                                                 f"required names (at {path})")
            if extra is False:
                return rf"\{{{self.ws}\}}"
            value = (_any_value(self.ws, JSON_MAX_NESTING - 1) if extra is True
                     else self.value(extra, f"{path}/additionalProperties"))
            return _object_of(STRING, value, self.ws)
        if not isinstance(extra, bool):
            raise ParameterError("additionalProperties",
                                 "additionalProperties: a schema for extra properties beside "
                                 f"properties is not supported, only true or false (at {path})")
        properties = schema["properties"]
        if not isinstance(properties, Mapping):
            raise ParameterError("properties", f"properties must be an object (at {path})")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(name not in properties for name in required):
            raise ParameterError("required", f"required must list names defined in properties, "
                                             f"got {required!r} (at {path})")
        members = [(name in required, self._literal(name) + f"{self.ws}:{self.ws}"
                    + self.value(sub, f"{path}/properties/{name}"))
                   for name, sub in properties.items()]
        if not required:  # member j is written again after each earlier one: count first
            repeat = 2 * len(self.ws) + 6  # "(?:", the comma and ")?" around each repeat
            self._spend(sum(j * (len(m) + repeat) for j, (_, m) in enumerate(members, 1)), path)
        return _members(members, self.ws)

    def _array(self, schema: Mapping, path: str) -> str:
        item = (self.value(schema["items"], f"{path}/items") if "items" in schema
                else _any_value(self.ws, JSON_MAX_NESTING - 1))
        low = _count(schema, "minItems", 0, path)
        high = _count(schema, "maxItems", None, path)
        return _array_of(item, low, high, self.ws, path)

    def _enum(self, schema: Mapping, keys: set, path: str) -> str:
        keyword = "const" if "const" in keys else "enum"
        _no_siblings(keyword, keys - {"type"}, path)
        values = [schema["const"]] if keyword == "const" else schema["enum"]
        if not isinstance(values, list) or not values:
            raise ParameterError("enum", f"enum must be a non-empty list (at {path})")
        if "type" in keys:
            allowed = _types(schema, keys, path)
            values = [v for v in values if _json_types(v) & set(allowed)]
            if not values:
                raise ParameterError(keyword, f"{keyword}: no value has the type "
                                              f"{schema['type']!r} (at {path})")
        return _alternatives(self._literal(v) for v in values)

    def _literal(self, value) -> str:
        """Exactly ``value``, written with this converter's whitespace policy."""
        if isinstance(value, dict):
            return _members([(True, self._literal(k) + f"{self.ws}:{self.ws}" + self._literal(v))
                             for k, v in value.items()], self.ws)
        if isinstance(value, list):
            inner = f"{self.ws},{self.ws}".join(self._literal(v) for v in value)
            return rf"\[{self.ws}{inner}{self.ws}\]" if value else rf"\[{self.ws}\]"
        return regex.escape(json.dumps(value, ensure_ascii=False), special_only=True)

    def _ref(self, ref, path: str) -> str:
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(ref, str) and ref.startswith(prefix):
                name = ref[len(prefix):].replace("~1", "/").replace("~0", "~")
                defs = self.root.get(prefix[2:-1], {})
                if name not in defs:
                    raise ParameterError("$ref", f"$ref: {ref!r} is not defined (at {path})")
                if ref in self.expanding:
                    raise ParameterError("$ref", f"$ref: {ref!r} is recursive, which a regex "
                                                 f"cannot express (at {path})")
                self.expanding.append(ref)
                try:
                    return self.value(defs[name], ref)
                finally:
                    self.expanding.pop()
        raise ParameterError("$ref", f"$ref: only references to '#/$defs/NAME' or "
                                     f"'#/definitions/NAME' are supported, got {ref!r} "
                                     f"(at {path})")


def _types(schema: Mapping, keys: set, path: str) -> list[str]:
    """The JSON types a schema allows: its ``type``, else those its keywords apply to."""
    if "type" not in keys:
        implied = [t for t, words in _KEYWORDS.items() if words & keys]
        return implied or list(_KEYWORDS)
    types = schema["type"]
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or any(t not in _KEYWORDS for t in types):
        raise ParameterError("type", f"type must be one of {', '.join(_KEYWORDS)} or a list of "
                                     f"them, got {schema['type']!r} (at {path})")
    return types


def _json_types(value) -> set[str]:
    """The JSON Schema types ``value`` belongs to (an integer is also a number)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _no_siblings(keyword: str, keys: set, path: str) -> None:
    others = sorted(keys - {keyword})
    if others:
        raise ParameterError(others[0], f"{others[0]}: the teaching engine does not support "
                                        f"{others[0]!r} beside {keyword!r} (at {path})")


def _count(schema: Mapping, keyword: str, default, path: str):
    value = schema.get(keyword, default)
    if value is not default and (isinstance(value, bool) or not isinstance(value, int)
                                 or value < 0):
        raise ParameterError(keyword, f"{keyword} must be a non-negative integer, got "
                                      f"{value!r} (at {path})")
    return value


def _repeat(low: int, high: int | None, path: str, keyword: str) -> str:
    if high is not None and high < low:
        raise ParameterError(keyword, f"{keyword} is below its minimum, {high} < {low} "
                                      f"(at {path})")
    if high is None:
        return "*" if low == 0 else f"{{{low},}}"
    return f"{{{low},{high}}}"


def _alternatives(parts) -> str:
    parts = list(dict.fromkeys(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _members(members: list[tuple[bool, str]], ws: str) -> str:
    """An object with these ``(required, member regex)`` in order; the optional may be absent.

    Commas go between present members only. With a required member, those before the last
    required one carry their comma after, those after it before; without one, the object is
    empty or starts at some member ``i``, followed by any of the later ones.
    """
    comma = f"{ws},{ws}"
    required = [i for i, (needed, _) in enumerate(members) if needed]
    if required:
        last = required[-1]
        parts = []
        for i, (needed, member) in enumerate(members):
            part = member + comma if i < last else member if i == last else comma + member
            parts.append(part if needed else f"(?:{part})?")
        return rf"\{{{ws}{''.join(parts)}{ws}\}}"
    if not members:
        return rf"\{{{ws}\}}"
    starts = [member + "".join(f"(?:{comma}{later})?" for _, later in members[i + 1:])
              for i, (_, member) in enumerate(members)]
    return rf"\{{{ws}(?:(?:{'|'.join(starts)}){ws})?\}}"


def _object_of(key: str, value: str, ws: str) -> str:
    """An object with any number of ``key: value`` members."""
    member = f"{key}{ws}:{ws}{value}"
    return rf"\{{{ws}(?:{member}(?:{ws},{ws}{member})*{ws})?\}}"


def _array_of(item: str, low: int, high: int | None, ws: str, path: str = "#") -> str:
    """An array of ``low`` to ``high`` (``None``: any number of) items."""
    if high == 0:
        return rf"\[{ws}\]"
    more = _repeat(max(low - 1, 0), None if high is None else high - 1, path, "maxItems")
    items = f"{item}(?:{ws},{ws}{item}){more}{ws}"
    return rf"\[{ws}{items}\]" if low > 0 else rf"\[{ws}(?:{items})?\]"


def _any_value(ws: str, nesting: int) -> str:
    """Any JSON value whose objects and arrays nest at most ``nesting`` levels."""
    scalars = f"{STRING}|{NUMBER}|{BOOLEAN}|{NULL}"
    if nesting == 0:
        return f"(?:{scalars})"
    inner = _any_value(ws, nesting - 1)
    return f"(?:{scalars}|{_object_of(STRING, inner, ws)}|{_array_of(inner, 0, None, ws)})"


def _checked_regex(pattern: str) -> str:
    if not isinstance(pattern, str):
        raise ParameterError("regex", f"regex must be a string, got {pattern!r}")
    if "\x00" in pattern:
        raise ParameterError("regex", "regex must not contain a NUL character ('\\x00')")
    compile_bounded(pattern)  # a bad pattern is refused here, a huge one before compiling
    return pattern
