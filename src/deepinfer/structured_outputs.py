"""What a request asks its output to follow (vLLM's ``StructuredOutputsParams``); the
grammar machinery that enforces it is ``sampling/structured.py``."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema, as a dict
    or a string), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (EBNF,
    xgrammar's dialect of GBNF) or ``json_object=True`` (any JSON object).
    ``disable_any_whitespace``: JSON without free whitespace between tokens (a model cannot
    then loop on newlines)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: set exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs.json must be a schema dict or string, got {self.json!r}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, str | dict):
            raise ValueError(
                f"structured_outputs.structural_tag must be a dict or JSON string, got {self.structural_tag!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}"
            )
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"
            )

    @classmethod
    def parse(cls, value: Any) -> StructuredOutputsParams | None:
        """From None, an instance, or a dict of its fields (naming any unknown one)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {value!r}")
        unknown = sorted(set(value) - {*KINDS, "disable_any_whitespace"})
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema_text(self) -> str:
        return self.json if isinstance(self.json, str) else jsonlib.dumps(self.json)

    def structural_tag_text(self) -> str:
        tag = self.structural_tag
        return tag if isinstance(tag, str) else jsonlib.dumps(tag, ensure_ascii=False)

    def choice_grammar(self) -> str:
        """The choices as an EBNF alternation of string literals (JSON escapes are xgrammar's)."""
        assert self.choice is not None
        return "root ::= " + " | ".join(jsonlib.dumps(c, ensure_ascii=False) for c in self.choice)
