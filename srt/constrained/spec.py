"""What a request constrains its output to, and the checks that turn a bad spec into a 400.

A spec is (kind, value): a regex, a JSON schema (as JSON text), an EBNF grammar, or a list of
literal choices. The checks here run where requests arrive, so a bad spec never reaches the
scheduler: syntax through xgrammar's parsers (cheap, no token masks), and JSON-schema keywords
that the grammar cannot enforce, which we refuse rather than silently ignore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# JSON output is one line with ", " and ": " separators: whitespace cannot run away until
# max_tokens, and keys and punctuation become fixed text that jump-forward can skip.
JSON_FORMAT = {"any_whitespace": False, "strict_mode": True}
MAX_SCHEMA_DEPTH = 128  # nesting beyond this is refused before any recursive code sees it

# Keywords xgrammar parses but does not enforce (each checked against a violating instance):
# accepting them would let invalid output through while claiming the schema holds.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                       "contains", "minContains", "maxContains", "contentEncoding", "contentMediaType",
                       "contentSchema", "unevaluatedItems")
# Formats that compile to a checked pattern; any other `format` would be ignored.
ENFORCED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname",
                              "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                              "relative-json-pointer"})
# Keywords whose value is a schema, or a list/dict of schemas, to walk into.
_SUBSCHEMA_KEYS = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    value: str  # choices are stored as a JSON list, so every spec is hashable text

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value)


def check_json_schema(schema: Any, field: str = "json_schema") -> None:
    """Raises ValueError naming the first keyword that would not be enforced."""
    _walk(schema, field, 0)


def _walk(node: Any, path: str, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{path.split('.')[0]}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ValueError(f"{path}: a JSON schema must be an object or a boolean")
    for key in UNENFORCED_KEYWORDS:
        if key in node:
            raise ValueError(f"{path}: the JSON-schema keyword {key!r} cannot be enforced during generation")
    if node.get("uniqueItems") is True:
        raise ValueError(f"{path}: the JSON-schema keyword 'uniqueItems' cannot be enforced during generation")
    fmt = node.get("format")
    if fmt is not None and fmt not in ENFORCED_FORMATS:
        raise ValueError(f"{path}: the JSON-schema format {fmt!r} cannot be enforced "
                         f"(supported: {', '.join(sorted(ENFORCED_FORMATS))})")
    if "multipleOf" in node and node.get("type") != "integer":
        raise ValueError(f"{path}: the JSON-schema keyword 'multipleOf' is enforced only for integers")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ValueError(f"{path}: the JSON-schema keyword 'allOf' with more than one schema cannot be enforced")
    for key in _SUBSCHEMA_KEYS:
        if isinstance(node.get(key), (dict, bool)):
            _walk(node[key], f"{path}.{key}", depth + 1)
    for key in _SCHEMA_LIST_KEYS:
        for i, sub in enumerate(node.get(key) or []):
            _walk(sub, f"{path}.{key}[{i}]", depth + 1)
    for key in _SCHEMA_MAP_KEYS:
        sub_map = node.get(key)
        if isinstance(sub_map, dict):
            for name, sub in sub_map.items():
                _walk(sub, f"{path}.{key}.{name}", depth + 1)


def choices_to_ebnf(choices: list[str]) -> str:
    """An EBNF grammar that accepts exactly one of the literal strings."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def check_syntax(spec: GrammarSpec, field: str) -> None:
    """Parses the spec with xgrammar (no tokenizer, no masks); raises ValueError with the
    parser's message."""
    import xgrammar

    try:
        if spec.kind == "regex":
            xgrammar.Grammar.from_regex(spec.value)
        elif spec.kind == "json_schema":
            xgrammar.Grammar.from_json_schema(spec.value, **JSON_FORMAT)
        elif spec.kind == "ebnf":
            xgrammar.Grammar.from_ebnf(spec.value)
        else:
            xgrammar.Grammar.from_ebnf(choices_to_ebnf(spec.choices))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{field}: {_compiler_message(e)}") from None


def _compiler_message(e: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location; keep the words."""
    text = str(e).strip()
    if text.startswith("[") and "]" in text:
        text = text.split("]", 1)[1].strip()
    head, sep, tail = text.partition(": ")
    if sep and (".cc:" in head or ".h:" in head):
        text = tail
    return text.splitlines()[0] if text else type(e).__name__
