"""What a request's output must match (`SamplingParams.structured_output`), and the check of it that
needs no tokenizer (the router refuses invalid grammars before routing). No torch here: importing
`SamplingParams` stays light.

JSON is generated compact (", " and ": " separators, no free whitespace): free whitespace lets a
weak model pad forever instead of closing the object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputParams:
    """What the output must match (exactly one field set), named as vLLM's guided decoding."""

    json: str | None = None  # a JSON schema, serialized
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark, or llama.cpp's GBNF

    def __post_init__(self) -> None:
        kinds = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]  # fmt: skip
        if sum(kinds) != 1:
            raise ValueError(
                "structured output takes exactly one of json, json_object, regex, choice, grammar"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured output 'choice' must not be empty")

    def grammar_text(self) -> str:
        """The llguidance grammar (raises ValueError for input that is not even well-formed)."""
        M = llguidance.LLMatcher
        if self.json is not None:
            return M.grammar_from_json_schema(self.json, defaults=JSON_OPTIONS)
        if self.json_object:
            return M.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if self.regex is not None:
            return M.grammar_from_regex(self.regex)
        if self.choice is not None:
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return llguidance.grammar_from("grammar", self.grammar)


def check(params: StructuredOutputParams) -> str | None:
    """Why the grammar is invalid, or None (no tokenizer needed: the router checks requests)."""
    try:
        error = llguidance.LLMatcher.validate_grammar(params.grammar_text())
    except ValueError as e:
        return str(e)
    return error or None
