"""Structured generation: grammar specs, their compilation, per-request matchers, jump-forward."""

from .spec import GrammarSpec, check_json_schema, check_syntax

__all__ = ["GrammarSpec", "check_json_schema", "check_syntax"]
