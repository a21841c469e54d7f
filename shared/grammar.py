"""Structured outputs: a request's constraint (shared/messages.py StructuredOutput) as a grammar of
llguidance, the engine vLLM and SGLang offer beside xgrammar, chosen here by a measured comparison
(benchmarks/grammar_engines.py, benchmarks/results/grammar_engines.md): it compiles the schemas of
real shape in 0.2-1.2 ms (xgrammar 0.3-8) and needs no other package (xgrammar brings transformers
and triton into a serving install); its mask costs about 19 us a row (xgrammar's 2), which a step of
a constrained batch pays on the host.

The gateway checks each constraint here before it accepts the request (a bad one is a 400 naming
its field); a worker keeps one matcher per constrained row (services/worker/grammar_rows.py). Both
hold one GrammarCompiler per tokenizer, whose compiled grammars are cached by constraint.
"""

import json
from collections import OrderedDict
from typing import TYPE_CHECKING

from shared.messages import StructuredOutput

if TYPE_CHECKING:
    import llguidance

    from shared.tokenizer import Tokenizer

# JSON as OpenAI's models write it under a schema: no whitespace between tokens (",", ":"). A small
# model given the choice fills its budget with spaces and newlines; this way every output token
# carries content, and the reply parses as the same JSON.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHED_GRAMMARS = 256  # compiled constraints kept per process (least recently used dropped)


class InvalidConstraint(ValueError):
    """A constraint that cannot be compiled: its message says why (shown to the client)."""


def grammar_text(constraint: StructuredOutput) -> str:
    """llguidance's grammar of a constraint (not yet checked)."""
    import llguidance

    LLMatcher = llguidance.LLMatcher
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)  # one of these strings exactly (Lark literals: JSON's escapes)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(choice, ensure_ascii=False)
                                                                  for choice in choices))
    from llguidance.gbnf_to_lark import any_to_lark

    return LLMatcher.grammar_from_lark(any_to_lark(spec))  # Lark, or GBNF (llama.cpp's) converted


class GrammarCompiler:
    """Compiled constraints of one tokenizer: a fresh matcher for each request, from a cache."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        import llguidance

        self._llguidance = llguidance
        self.vocab_size = tokenizer.vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=tokenizer.vocab_size,
                                                eos_token=sorted(tokenizer.stop_token_ids))
        self._compiled: OrderedDict[StructuredOutput, "llguidance.LLMatcher"] = OrderedDict()

    def check(self, constraint: StructuredOutput) -> None:
        """Raise InvalidConstraint when the constraint cannot be compiled."""
        self._template(constraint)

    def matcher(self, constraint: StructuredOutput) -> "llguidance.LLMatcher":
        """A matcher at the start of the constraint (a copy of the cached compiled one)."""
        return self._template(constraint).deep_copy()

    def _template(self, constraint: StructuredOutput) -> "llguidance.LLMatcher":
        template = self._compiled.get(constraint)
        if template is not None:
            self._compiled.move_to_end(constraint)
            return template
        try:
            grammar = grammar_text(constraint)
        except Exception as error:  # noqa: BLE001 (the converters raise their own types for bad text)
            raise InvalidConstraint(_first_line(str(error))) from None
        error = self._llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidConstraint(_first_line(error))
        template = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidConstraint(_first_line(template.get_error()))
        self._compiled[constraint] = template
        if len(self._compiled) > CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return template


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "the grammar does not compile"
