"""Structured outputs through xgrammar, vLLM's default backend: JSON schemas, any JSON object, regular expressions,
fixed choices and grammars, EBNF or Lark (nvllm.sampling_params.StructuredOutputsParams).

A request's constraint is compiled once against the tokenizer's vocabulary (xgrammar's compiler caches it; the
server compiles it off the engine thread before the request is queued, so a bad schema is a 400 and a slow one does
not stall the batch). Each sequence keeps a matcher that follows its tokens. Before every draw the tokens its matcher
would refuse are set to −inf in that row's logits, first: log-probabilities are those of the masked distribution
(vLLM applies the bitmask before its sampler too), and bias, penalties, temperature and the filters come after.
Once the constraint is complete the matcher allows only the end-of-sequence tokens, and the sequence ends there:
min_tokens does not keep them banned then (it would leave nothing to draw). A sequence whose matcher has
terminated, or refuses a token, is finished."""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import TYPE_CHECKING

import torch

from nvllm.env_vars import env_number
from nvllm.kernels import report
from nvllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from nvllm.layers.sampler import SampleRow

logger = logging.getLogger("nvllm")

# xgrammar's compiled-grammar cache, bounded as vLLM bounds it (VLLM_XGRAMMAR_CACHE_MB): every new schema adds to it
_CACHE_MB = env_number("NVLLM_XGRAMMAR_CACHE_MB", 512, minimum=1)
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured outputs need the xgrammar package (pip install xgrammar)") from e
    return xgrammar


class InvalidConstraint(ValueError):
    """A request's output constraint that does not compile (the caller's mistake)."""


class StructuredOutputs:
    """The engine's grammar compiler (built at the first constrained request: reading a large vocabulary takes a
    moment) and the masking of a step's constrained rows."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], disable_any_whitespace: bool = False):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.disable_any_whitespace = disable_any_whitespace  # the engine's setting, for every request
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _import_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=_CACHE_MB * 1024 * 1024)
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled constraint; ValueError naming what is wrong with it. Thread-safe. Kept on ``params``: the
        server compiles it off the engine thread, and the engine's own call finds it there whatever the
        compiler's cache has dropped since (keyed by this engine's compiler: one SamplingParams may serve models of
        different vocabularies)."""
        compiler, key = self._get_compiler(), params.content_key()
        if params.compiled is not None and params.compiled[0] is compiler and params.compiled[1] == key:
            return params.compiled[2]
        grammar = self._compile(params)
        params.compiled = (compiler, key, grammar)
        return grammar

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind = params.kind
        try:
            if kind in ("json", "json_object"):  # any JSON object: the schema {"type": "object"}, as vLLM has it
                schema = params.json if kind == "json" else {"type": "object"}
                what = unenforced_keyword(_parsed(schema))
                if what is not None:
                    raise ValueError(f"the schema uses {what}, which the grammar cannot enforce: a reply could "
                                     "break the schema")
                return _compile_json_schema(compiler, schema if isinstance(schema, str) else json.dumps(schema),
                                            not (params.disable_any_whitespace or self.disable_any_whitespace))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            if is_lark(params.grammar):
                return compiler.compile_grammar(_import_xgrammar().Grammar.from_lark(params.grammar))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidConstraint(f"invalid structured outputs {kind}: {_message(e)}") from None

    def matcher(self, params: StructuredOutputsParams):
        """A new matcher for one sequence (its tokens are fed as they come: ``advance``)."""
        return _import_xgrammar().GrammarMatcher(self.compile(params))


_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains", "minContains",
               "maxContains")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name → schema
_DATA = ("enum", "const", "default", "examples", "required", "title", "description")  # values, not schemas


def unenforced_keyword(node) -> str | None:
    """The first JSON Schema keyword in ``node`` that xgrammar compiles but does not enforce (measured with its
    0.2 releases: the mask lets through replies that break it), or None. vLLM refuses such schemas with its
    xgrammar backend too."""
    if isinstance(node, list):
        return next((w for w in map(unenforced_keyword, node) if w is not None), None)
    if not isinstance(node, dict):
        return None
    found = next((k for k in _UNENFORCED if k in node), None)
    if found is not None:
        return f"'{found}'"
    if node.get("uniqueItems") is True:
        return "'uniqueItems'"
    if "multipleOf" in node and not _integer_multiple(node):  # an integer's whole multiple is enforced, no other
        return "'multipleOf' on a number"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#/") and ref != "#":  # a remote or anchor reference lets all by
        return f"'$ref' to {ref[:80]!r} (only references inside the schema, '#/…', are followed)"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one schema"
    for key in ("pattern", "format"):
        if key in node and ("minLength" in node or "maxLength" in node):
            return f"'{key}' together with 'minLength'/'maxLength'"
    for key, value in node.items():
        if key in _DATA:
            continue
        found = unenforced_keyword(list(value.values()) if key in _SCHEMA_MAPS and isinstance(value, dict)
                                   else value)
        if found is not None:
            return found
    return None


# xgrammar 0.2 writes a string with minLength/maxLength as a repeat of this class, which lets through the raw
# control characters JSON forbids inside a string (an unbounded string's class excludes them: the second)
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _compile_json_schema(compiler, schema: str, any_whitespace: bool):
    """The schema's grammar, with a length-bounded string's characters those JSON allows in a string (the grammar
    converted once, then compiled as text: the compiler caches it by that text)."""
    ebnf = str(_import_xgrammar().Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return compiler.compile_grammar(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def _integer_multiple(node: dict) -> bool:
    """Whether a node's ``multipleOf`` is one xgrammar enforces: a whole number, on a node whose types are integer
    (null beside it too) and never number."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    step = node["multipleOf"]
    return isinstance(types, list) and "integer" in types and "number" not in types and \
        isinstance(step, (int, float)) and not isinstance(step, bool) and float(step).is_integer() and step > 0


def _parsed(schema: str | dict):
    """A schema given as text, parsed (None where it is not JSON: xgrammar's compiler then says what is wrong)."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except ValueError:
        return None


_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?\d+)?\s*:(?!:=)", re.M)


def is_lark(grammar: str) -> bool:
    """Whether a grammar is written in Lark (rules ``name: ...``, as vLLM accepts them) rather than in EBNF
    (``name ::= ...``): a grammar with no ``::=`` and a Lark rule or ``%`` directive at the start of a line."""
    return "::=" not in grammar and bool(_LARK_RULE.search(grammar) or re.search(r"^\s*%(import|ignore)\b", grammar,
                                                                                   re.M))


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings: each a literal, escaped as a JSON string (xgrammar reads its escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def apply_grammar_masks(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Set to −inf, in place, every token the row's matcher would refuse (rows with a ``grammar``)."""
    want = [i for i, r in enumerate(rows) if r.grammar is not None]

    def fill(bitmask: torch.Tensor) -> None:
        for j, i in enumerate(want):
            rows[i].grammar.fill_next_token_bitmask(bitmask, j)

    _mask_rows(logits, want, fill)


def apply_draft_grammar_masks(logits: torch.Tensor, runs: list[tuple[int, object, list[int]]]) -> None:
    """Speculative verification: ``runs`` holds (first row, matcher, drafted ids) of each constrained request,
    whose k + 1 rows from its first score the positions after its drafts[:j]. Row j is masked with the matcher
    advanced through drafts[:j]; after a draft the matcher refuses (verification rejects it: its probability is
    0) or after one that ends the constraint (the sequence ends there), the rows are left as they are, since no
    token is drawn from them. Each matcher is rolled back to where it was: the engine feeds it the tokens kept."""
    want = [start + j for start, _, drafts in runs for j in range(len(drafts) + 1)]

    def fill(bitmask: torch.Tensor) -> None:
        row = 0
        for _, matcher, drafts in runs:
            advanced = 0
            for j in range(len(drafts) + 1):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, row + j)
                if j == len(drafts) or not matcher.accept_token(drafts[j]):
                    break
                advanced += 1
            if advanced:
                matcher.rollback(advanced)
            row += len(drafts) + 1

    _mask_rows(logits, want, fill)


def _mask_rows(logits: torch.Tensor, want: list[int], fill) -> None:
    """Apply to the rows ``want`` of logits (in place) the token bitmask that ``fill`` writes, one bitmask row per
    wanted row, all tokens allowed where it writes nothing."""
    if not want:
        return
    xgr = _import_xgrammar()
    vocab = logits.shape[-1]
    bitmask = torch.full(tuple(xgr.get_bitmask_shape(len(want), vocab)), -1, dtype=xgr.bitmask_dtype,
                         pin_memory=logits.is_cuda)
    fill(bitmask)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    report.record("structured_output", "xgrammar token bitmask")
    if len(want) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        return
    idx = torch.tensor(want, device=logits.device)
    part = logits[idx]
    xgr.apply_token_bitmask_inplace(part, bitmask, vocab_size=vocab)
    logits[idx] = part


def advance(matcher, token: int) -> bool:
    """Feed a sampled token to the sequence's matcher; False when the sequence must end here: the constraint is
    complete, or the token breaks it (logged)."""
    if matcher.is_terminated():
        return False
    if not matcher.accept_token(token):
        logger.warning("structured outputs: token %d does not fit the constraint; the "
                       "sequence ends here", token)
        return False
    return not matcher.is_terminated()


def _message(e: BaseException) -> str:
    """xgrammar's error without its C++ log prefix, first line only."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _LOG_PREFIX.sub("", text)
