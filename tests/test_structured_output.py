"""Structured outputs on the engine (xgrammar masks): every constrained output is checked by a parser no one here
wrote (``json``, pydantic, Python's ``re``), the constraint beats a +100 logit bias, unconstrained rows of the same
batch are untouched, asynchronous scheduling gives the same tokens, and bad constraints are one clear ValueError."""

from __future__ import annotations

import json
import math
import re

import pydantic
import pytest

from nvllm import SamplingParams, StructuredOutputsParams as S
from nvllm.assets import demo_model_path
from nvllm.engine.structured_output import choice_grammar, is_lark
from nvllm.kernels import report
from tests.conftest import make_llm

PROMPT = "Once upon a time"
CHOICES = ['a"b', "x\\y", "new\nline", "émoji ✓"]


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    age: int = pydantic.Field(ge=0, le=9)
    happy: bool


PET_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "age", "happy"],
              "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 9},
                             "happy": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def llm():
    return make_llm(demo_model_path())


def gen(llm, constraint: S, n: int = 1, **kw) -> list:
    kw.setdefault("temperature", 0)
    params = SamplingParams(n=n, max_tokens=kw.pop("max_tokens", 80), structured_outputs=constraint, **kw)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs


def test_json_schema_outputs_validate(llm):
    outs = gen(llm, S(json=PET_SCHEMA, disable_any_whitespace=True))
    outs += gen(llm, S(json=json.dumps(PET_SCHEMA), disable_any_whitespace=True), n=4, temperature=1.0, seed=7)
    for c in outs:
        assert c.finish_reason == "stop", c.text
        pet = Pet.model_validate_json(c.text)
        assert json.loads(c.text) == pet.model_dump()


def test_regex_choice_and_grammar_outputs_match(llm):
    report.reset()
    for c in gen(llm, S(regex=r"[ab]{3}-\d{2}"), n=3, temperature=1.0, seed=1):
        assert re.fullmatch(r"[ab]{3}-\d{2}", c.text) and c.finish_reason == "stop"
    for c in gen(llm, S(choice=CHOICES), n=4, temperature=1.5, seed=2):
        assert c.text in CHOICES and c.finish_reason == "stop"
    for c in gen(llm, S(grammar='root ::= ("yes" | "no") ", " [0-9] [0-9]'), n=2, temperature=1.0, seed=3):
        assert re.fullmatch(r"(yes|no), \d\d", c.text)
    assert report.snapshot()["structured_output"]["xgrammar token bitmask"] > 0


LARK = '''
start: answer ", " DIGIT DIGIT
answer: "yes" | "no"
%import common.DIGIT
'''


def test_lark_grammars_constrain_as_vllm_takes_them(llm):
    for c in gen(llm, S(grammar=LARK), n=3, temperature=1.0, seed=4):
        assert re.fullmatch(r"(yes|no), \d\d", c.text) and c.finish_reason == "stop", c.text
    assert is_lark(LARK) and is_lark("?start: x\nx: /[a-z]+/") and is_lark("%import common.WS\nstart: WS")
    for ebnf in ('root ::= ("yes" | "no")', 'root ::= "a:b" rest\nrest ::= [0-9]', "root ::= [a-z]+ # note: x"):
        assert not is_lark(ebnf)
    with pytest.raises(ValueError, match="invalid structured outputs grammar: Lark error at line 2"):
        gen(llm, S(grammar="start: answer\nanswer: : 'x'"))


def test_choice_grammar_escapes_every_literal():
    assert choice_grammar(['a"b', "x\\y"]) == 'root ::= "a\\"b" | "x\\\\y"'


def test_json_object_is_an_object(llm):
    tok = llm.get_tokenizer()
    close = tok.encode("}", add_special_tokens=False)[-1]
    # the story model would write a long string key; a bias towards "}" lets the object close where it may
    c = gen(llm, S(json_object=True, disable_any_whitespace=True), logit_bias={close: 30.0})[0]
    assert isinstance(json.loads(c.text), dict) and c.finish_reason == "stop"


def test_the_mask_beats_the_bias_and_spares_other_rows(llm):
    tok = llm.get_tokenizer()
    dog = tok.encode(" dog", add_special_tokens=False)[-1]
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0]
    boxed = SamplingParams(max_tokens=12, temperature=0, logit_bias={dog: 100.0},
                           structured_outputs=S(regex="[0-9]{4}"))
    outs = llm.generate([PROMPT, PROMPT, PROMPT], [plain, boxed, plain], use_tqdm=False)
    assert re.fullmatch("[0-9]{4}", outs[1].outputs[0].text)
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == alone.token_ids


def test_async_scheduling_gives_the_same_tokens(llm):
    prompts = [PROMPT, "The cat", PROMPT, "Tom"]
    params = [SamplingParams(max_tokens=30, temperature=0),
              SamplingParams(max_tokens=40, temperature=0, structured_outputs=S(json=PET_SCHEMA)),
              SamplingParams(max_tokens=30, temperature=0.9, seed=4, structured_outputs=S(choice=CHOICES)),
              SamplingParams(max_tokens=30, temperature=0.9, seed=5)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    async_llm = make_llm(demo_model_path(), async_scheduling=True)
    got = [o.outputs[0].token_ids for o in async_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_a_complete_constraint_ends_the_sequence_even_with_ignore_eos(llm):
    c = gen(llm, S(choice=["yes", "no"]), ignore_eos=True, max_tokens=20)[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop" and len(c.token_ids) < 20


def test_a_cut_constraint_finishes_on_length(llm):
    c = gen(llm, S(regex="[a-z]{40}"), max_tokens=5)[0]
    assert c.finish_reason == "length" and re.fullmatch("[a-z]+", c.text)


@pytest.mark.parametrize("constraint, message", [
    (dict(regex="[a-"), "invalid structured outputs regex: Regex parsing error"),
    (dict(json="{bad"), "invalid structured outputs json: Failed to parse JSON"),
    (dict(json={"type": "nonsense"}), "invalid structured outputs json"),
    (dict(grammar="root ::= foo"), 'invalid structured outputs grammar: EBNF parser error at line 1, column 10: '
                                   'Rule "foo" is not defined'),
    # keywords xgrammar compiles but does not enforce: refused, not answered with JSON that breaks them
    (dict(json={"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True}),
     "invalid structured outputs json: the schema uses 'uniqueItems', which the grammar cannot enforce"),
    (dict(json={"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]+$", "maxLength": 4}}}),
     "invalid structured outputs json: the schema uses 'pattern' together with 'minLength'/'maxLength'"),
    (dict(json='{"$defs": {"x": {"enum": ["a", "b"], "not": {"const": "a"}}}, "$ref": "#/$defs/x"}'),
     "invalid structured outputs json: the schema uses 'not'"),
    (dict(json={"allOf": [{"type": "integer"}, {"minimum": 5}]}),
     "invalid structured outputs json: the schema uses 'allOf' with more than one schema"),
    (dict(json={"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}, "maxItems": 3}),
     "invalid structured outputs json: the schema uses 'contains'"),
    (dict(json={"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}),
     "invalid structured outputs json: the schema uses 'multipleOf' on a number"),
    (dict(json={"type": "integer", "multipleOf": 2.5}),   # xgrammar ignores a multiple that is not whole
     "invalid structured outputs json: the schema uses 'multipleOf' on a number"),
    (dict(json={"type": ["integer", "number"], "multipleOf": 3}),
     "invalid structured outputs json: the schema uses 'multipleOf' on a number"),
    (dict(json={"$ref": "https://example.com/schema.json"}),
     "invalid structured outputs json: the schema uses '$ref' to 'https://example.com/schema.json'"),
])
def test_bad_constraints_are_one_clear_error(llm, constraint, message):
    with pytest.raises(ValueError) as e:
        llm.generate([PROMPT], SamplingParams(structured_outputs=S(**constraint)), use_tqdm=False)
    assert str(e.value).startswith(message) and "\n" not in str(e.value) and "/project" not in str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice="ab"), "non-empty list"),
    (dict(regex=""), "non-empty string"),
    (dict(json=3), "JSON schema"),
])
def test_bad_params_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        S(**kw)


def test_params_take_a_dict_as_vllm_does():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == S(regex="a+")
    with pytest.raises(ValueError, match="unknown structured_outputs field 'regexp'"):
        SamplingParams(structured_outputs={"regexp": "a+"})
    with pytest.raises(ValueError, match="unknown structured_outputs field 'compiled'"):  # the engine's, not an input
        SamplingParams(structured_outputs={"regex": "a+", "compiled": 1})


def test_engine_wide_whitespace_setting(llm):
    from nvllm.config import ConfigError, EngineConfig

    assert EngineConfig(structured_outputs_config='{"disable_any_whitespace": true}').structured_outputs_config == {
        "backend": "auto", "disable_any_whitespace": True}
    for bad, message in (('{"backend": "outlines"}', "backend 'outlines' is not available"),
                         ('{"whitespace": 1}', "unknown structured_outputs_config field 'whitespace'"),
                         ("[1]", "must be a JSON object"), ("{", "is not valid JSON")):
        with pytest.raises(ConfigError, match=message):
            EngineConfig(structured_outputs_config=bad)
    tight = make_llm(demo_model_path(), structured_outputs_config={"disable_any_whitespace": True})
    want = gen(llm, S(json=PET_SCHEMA, disable_any_whitespace=True))[0].text
    assert gen(tight, S(json=PET_SCHEMA))[0].text == want != gen(llm, S(json=PET_SCHEMA))[0].text


def test_min_tokens_yields_to_a_complete_constraint(llm):
    c = gen(llm, S(choice=["yes"]), min_tokens=6, max_tokens=10, logprobs=0)[0]
    assert c.text == "yes" and c.finish_reason == "stop"
    tok = llm.get_tokenizer()  # nothing outside the constraint: its tokens, then EOS (not a masked row's argmax)
    assert tok.decode(c.token_ids[:-1]) == "yes" and c.token_ids[-1] in llm.engine.eos_token_ids


def test_logprobs_are_those_of_the_constrained_distribution(llm):
    c = gen(llm, S(choice=["yes", "no"]), logprobs=3)[0]
    first = c.logprobs[0]
    tok = llm.get_tokenizer()
    assert {tok.decode([t]) for t, lp in first.items() if lp.logprob > -1e9} <= {"y", "n", "ye", "no", "yes"}
    assert sum(math.exp(lp.logprob) for lp in first.values() if lp.logprob > -1e9) == pytest.approx(1.0, abs=1e-4)


def test_generate_command_takes_constraints(tmp_path):
    from typer.testing import CliRunner

    from nvllm.cli import app

    schema = tmp_path / "pet.json"
    schema.write_text(json.dumps(PET_SCHEMA))
    env = {"COLUMNS": "200"}
    res = CliRunner().invoke(app, ["generate", "--device", "cpu", "--json-schema", str(schema),
                                   "--structured-outputs-config", '{"disable_any_whitespace": true}', PROMPT], env=env)
    assert res.exit_code == 0, res.output
    printed = [line for line in res.output.splitlines() if line.startswith(PROMPT)]  # the log shares the output
    Pet.model_validate_json(printed[0].removeprefix(PROMPT))
    res = CliRunner().invoke(app, ["generate", "--device", "cpu", "--choice", "yes", "--choice", "no", PROMPT],
                             env=env)
    assert [line for line in res.output.splitlines() if line.startswith(PROMPT)][0] in (PROMPT + "yes", PROMPT + "no")
    for args, message in ((["--regex", "[a-"], "invalid structured outputs regex"),
                          (["--json-schema", "missing.json"], "neither a JSON object nor a file"),
                          (["--regex", "a", "--choice", "a"], "exactly one of")):
        res = CliRunner().invoke(app, ["generate", "--device", "cpu", *args], env=env)
        assert res.exit_code == 2 and message in res.output


def test_one_params_object_serves_models_of_different_vocabularies(llm, tmp_path):
    from tests.conftest import build_tiny_model

    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=S(choice=["yes", "no"]))
    other = make_llm(str(build_tiny_model("qwen2", tmp_path / "v1024", vocab_size=1024)))
    for engine in (llm, other, llm):  # each compiles the constraint for its own vocabulary (a grammar compiled for
        out = engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]  # another vocabulary would crash)
        assert out.finish_reason == "stop" and len(out.token_ids) <= 4


def test_keywords_as_names_and_values_are_not_refused(llm):
    """Only schema keywords count: a property called "not", or "uniqueItems" inside an enum, is fine."""
    from nvllm.engine.structured_output import unenforced_keyword

    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": ["uniqueItems"]}},
              "required": ["not"], "allOf": [{"type": "object"}], "description": "if not then"}
    assert unenforced_keyword(schema) is None
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, structured_outputs=S(json=schema)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason in ("stop", "length")


def test_an_integers_multiple_and_local_references_are_enforced_not_refused(llm):
    from nvllm.engine.structured_output import unenforced_keyword

    schema = {"$defs": {"n": {"type": "integer", "multipleOf": 3}}, "type": "object",
              "properties": {"n": {"$ref": "#/$defs/n"}, "m": {"type": ["integer", "null"], "multipleOf": 4}},
              "required": ["n"]}
    assert unenforced_keyword(schema) is None
    out = gen(llm, S(json=schema), max_tokens=40)[0]
    assert out.finish_reason == "length" or json.loads(out.text)["n"] % 3 == 0


def test_a_length_bounded_string_holds_no_raw_control_character(llm):
    """xgrammar 0.2 lets a string with minLength/maxLength hold raw control characters, which JSON forbids (a reply
    json.loads refused); the compiled grammar refuses them, and still takes other characters."""
    import xgrammar as xgr

    compiled = llm.engine.structured.compile(S(json={"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 4}}, "required": ["s"]}))
    for text, accepted in (('{"s": "d1\x1ch"}', False), ('{"s": "a\x00"}', False), ('{"s": "d1 h"}', True),
                           ('{"s": "\u00e9t\u00e9"}', True), ('{"s": "abcde"}', False), ('{"s": "abcd"}', True)):
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == accepted, text
    out = gen(llm, S(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}},
                           "required": ["s"]}), temperature=1.0, seed=1, max_tokens=30)[0]
    assert out.finish_reason == "length" or len(json.loads(out.text)["s"]) <= 5


def test_vllms_former_guided_decoding_name_is_taken(llm):
    """Scripts for vLLM before 0.11: SamplingParams(guided_decoding=GuidedDecodingParams(...)) is structured_outputs."""
    from nvllm.sampling_params import GuidedDecodingParams

    sp = SamplingParams(temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert sp.structured_outputs.choice == ["yes", "no"]
    assert llm.generate(["Once"], sp, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding={"regex": "a+"}, structured_outputs={"regex": "b+"})


def test_a_constraint_changed_after_use_is_the_one_enforced(llm):
    """vLLM's idiom: clone the params, change one request's constraint. The grammar compiled for the first values
    must not be reused for the new ones (the cached grammar is keyed by what the constraint says)."""
    sp = SamplingParams(temperature=0, max_tokens=20, structured_outputs=S(choice=["yes", "no"]))
    assert llm.generate(["Once"], sp, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    other = sp.clone()
    other.structured_outputs.choice = ["alpha", "beta"]
    assert llm.generate(["Once"], other, use_tqdm=False)[0].outputs[0].text in ("alpha", "beta")
    assert llm.generate(["Once"], sp, use_tqdm=False)[0].outputs[0].text in ("yes", "no")  # the original intact
    so = S(regex=r"[0-9]{3}")
    assert re.fullmatch(r"[0-9]{3}", llm.generate(["Once"], SamplingParams(temperature=0, structured_outputs=so),
                                                  use_tqdm=False)[0].outputs[0].text)
    so.regex = r"[a-z]{2}!"
    assert re.fullmatch(r"[a-z]{2}!", llm.generate(["Once"], SamplingParams(temperature=0, structured_outputs=so),
                                                   use_tqdm=False)[0].outputs[0].text)
    # the same properties in another order: the grammar writes them in the schema's order, so it is another grammar
    props = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    so = S(json={"type": "object", "properties": props, "required": ["a", "b"], "additionalProperties": False},
           disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    assert llm.generate(["Once"], params, use_tqdm=False)[0].outputs[0].text.startswith('{"a":')
    so.json = {**so.json, "properties": {"b": props["b"], "a": props["a"]}}
    assert llm.generate(["Once"], params, use_tqdm=False)[0].outputs[0].text.startswith('{"b":')
