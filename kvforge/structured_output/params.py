"""StructuredOutputParams: the one constraint a request's output must satisfy, checked on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The grammar of `json_object`: any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# Keywords under which an object's schema lets keys in that `properties` does not list.
_OPEN_OBJECT_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def schema_as_enforced(schema: Any) -> Any:
    """A JSON schema as the grammar enforces it, in one canonical form, so equal constraints share one compilation:

    - an object whose schema lists its `properties` and says nothing of other keys takes no others (as OpenAI's
      strict mode does, and the common guided-decoding backends by default): a model may not invent keys;
    - each `properties` keeps its order, which is the order the keys are generated in (a schema that puts
      `reasoning` before `answer` gets the reasoning first); every other mapping's keys are sorted.
    """
    if isinstance(schema, list):
        return [schema_as_enforced(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (_properties(value) if key == "properties" and isinstance(value, dict) else schema_as_enforced(value))
           for key, value in sorted(schema.items())}
    if "properties" in out and not any(key in out for key in _OPEN_OBJECT_KEYWORDS):
        out["additionalProperties"] = False
    return out


def _properties(properties: dict[str, Any]) -> dict[str, Any]:
    """A `properties` mapping: the names in the schema's order, each one's schema made canonical."""
    return {name: schema_as_enforced(value) for name, value in properties.items()}


@dataclass(slots=True)
class StructuredOutputParams:
    """Exactly one of: a JSON schema (`json`, a dict or its text), a regular expression (`regex`, the
    whole output must match), a list of strings to choose from (`choice`), an EBNF grammar (`grammar`,
    GBNF as llama.cpp writes it, or Lark), or `json_object` (any JSON object).

    starts_after: the constraint applies only to what follows this text in the output (the end of the
    model's reasoning, "</think>"); before it any token may come. None: from the first token."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    starts_after: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured output needs exactly one of json, regex, choice, grammar or "
                             f"json_object, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(self.json).__name__}")
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.starts_after is not None and (not isinstance(self.starts_after, str) or not self.starts_after):
            raise ValueError(f"starts_after must be a non-empty string, got {self.starts_after!r}")

    def grammar_source(self) -> tuple[str, str]:
        """(kind, text) in the grammar library's terms; the text is canonical, so equal constraints
        share one compiled grammar (starts_after is not part of it: it changes when the grammar starts)."""
        if self.json is not None or self.json_object:
            schema = ANY_JSON_OBJECT if self.json_object else self.json
            return "json", json.dumps(schema_as_enforced(schema))
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        assert self.grammar is not None
        return "grammar", self.grammar
