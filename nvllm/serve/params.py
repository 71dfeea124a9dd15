"""Request fields → SamplingParams (with OpenAI's token-limit rules), usage accounting, and the per-choice
bookkeeping that turns the engine's cumulative outputs into stream deltas."""

from __future__ import annotations

from dataclasses import dataclass

from nvllm.engine.output_stream import EngineRequest
from nvllm.engine.generation_defaults import NEUTRAL, with_defaults
from nvllm.engine.structured_output import InvalidConstraint
from nvllm.outputs import CompletionOutput, RequestOutput
from nvllm.sampling_params import CONSTRAINT_KINDS, SamplingParams, StructuredOutputsParams
from nvllm.serve.errors import APIError, bad_request, from_value_error
from nvllm.serve.protocol import PromptLogprob, PromptLogprobs, PromptTokensDetails, SamplingRequest, UsageInfo

MAX_LOGPROBS = 20


async def submit(engine, requests: list[EngineRequest], constraint: str | None = None):
    """Open one output stream and add the requests to it in one engine command: bad input becomes the 400 and
    nothing is queued; the stream is closed on any failure. ``constraint``: the field the requests' output
    constraint came from (``constraint_param``), named by the 400 when it does not compile."""
    stream = engine.open_stream()
    try:
        await stream.add_many(requests)
    except ValueError as e:
        stream.close()
        raise request_error(e, constraint) from None
    except BaseException:
        stream.close()
        raise
    return stream


def request_error(e: ValueError, constraint: str | None) -> APIError:
    """The 400 for a request the engine refused to add: a constraint that does not compile names ``constraint``
    (``constraint_param``), anything else the field from_value_error finds."""
    return bad_request(str(e), constraint) if isinstance(e, InvalidConstraint) else from_value_error(e)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str,
                       default: int | None = None) -> int:
    """OpenAI's rule: the prompt plus the completion must fit max_model_len; None takes the model's default
    (generation_config.json's max_new_tokens) where it fits, else all that is left."""
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(room, default)
    if requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    if requested > room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                          f"completion). Please reduce the prompt or {param}.", param,
                          code="context_length_exceeded")
    return requested


def logprobs_limit(engine) -> int:
    """The most logprobs a request may ask of ``engine`` (an LLMEngine): its max_logprobs (vLLM's --max-logprobs;
    -1: the whole vocabulary), else MAX_LOGPROBS."""
    cap = engine.config.max_logprobs
    return MAX_LOGPROBS if cap is None else engine.vocab_size if cap == -1 else cap


def check_logprobs(value: int | None, param: str, limit: int = MAX_LOGPROBS,
                   vocab_size: int | None = None) -> int | None:
    """A logprobs count checked against the server's limit (--max-logprobs); with ``vocab_size``, -1 (vLLM's: the
    whole vocabulary, for the fields vLLM takes it in) is that size. Returns the count."""
    if value == -1 and vocab_size is not None:
        if vocab_size > limit:
            raise bad_request(f"{param} -1 asks for the whole vocabulary ({vocab_size}), more than the server's "
                              f"limit {limit} (--max-logprobs -1 allows it)", param)
        return vocab_size
    if value is not None and not 0 <= value <= limit:
        whole = " or -1 (the whole vocabulary)" if vocab_size is not None else ""
        raise bad_request(f"{param} must be in [0, {limit}]{whole}, got {value}", param)
    return value


def requested_prompt_logprobs(req: SamplingRequest, limit: int, vocab_size: int) -> int | None:
    """vLLM's prompt_logprobs of a request, checked: None when not asked for, or asked for 0 on a stream (vLLM
    accepts and drops that); a stream that asks for more is a 400, as in vLLM (a chunk has no place for them).
    -1 is the whole vocabulary (``check_logprobs``)."""
    if req.stream and req.prompt_logprobs:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    req.prompt_logprobs = check_logprobs(req.prompt_logprobs, "prompt_logprobs", limit, vocab_size)
    return None if req.stream else req.prompt_logprobs


def prompt_logprobs_json(prompt_ids: list[int], dicts: list, k: int, token_text) -> PromptLogprobs:
    """vLLM's prompt_logprobs: for each prompt token after the first, the token itself and the top k at its position
    (the engine may have computed more, for echo), by token id."""
    out: PromptLogprobs = [None]
    for tok, d in zip(prompt_ids[1:], dicts[1:]):
        out.append({str(t): PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank, decoded_token=token_text(t))
                    for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank) if lp.rank <= k or t == tok})
    return out


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings: up to 10 decimal digits ("-1", "1.0", " 1" are
    refused); the bias itself is checked and clamped by SamplingParams, the ids against the vocabulary by the
    engine."""
    if not bias:
        return None
    bad = next((k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= 10)), None)
    if bad is not None:
        raise bad_request(f"logit_bias keys must be token ids (decimal integers), got {bad!r}", "logit_bias")
    return {int(k): v for k, v in bias.items()}


_CONSTRAINT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constraint_param(req: SamplingRequest) -> str | None:
    """The field a request's output constraint comes from: ``tools`` for a chat's named or required tool_choice,
    else the one field ``structured_outputs`` takes it from."""
    choice = getattr(req, "tool_choice", None)
    if choice is not None and choice not in ("none", "auto"):
        return "tools"
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        return "response_format"
    given = [f for f in _CONSTRAINT_FIELDS if getattr(req, f) is not None]
    if given[:1] == ["structured_outputs"] and not set(req.structured_outputs) & set(CONSTRAINT_KINDS):
        given.pop(0)  # only options for another field's constraint
    return given[0] if given else None


def constrains_reply(req: SamplingRequest) -> bool:
    """Whether the request asks for structured outputs (a response_format other than text, or a constraint field)."""
    fmt = req.response_format
    return (fmt is not None and fmt.get("type") != "text") or any(
        getattr(req, f) is not None for f in _CONSTRAINT_FIELDS)


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever one of its fields gives it: OpenAI's ``response_format``
    (json_object, json_schema), vLLM's ``structured_outputs`` object, or vLLM's older ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. The constraint itself is compiled (and a bad one
    refused) when the request is added."""
    given: list[tuple[str, StructuredOutputsParams]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, str)):
                raise bad_request("response_format of type json_schema needs json_schema.schema (a JSON schema)",
                                  "response_format")
            given.append(("response_format", StructuredOutputsParams(json=schema)))
        elif kind != "text":
            raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              "response_format")
    options = None  # a structured_outputs object that gives no constraint, only options for another field's
    if req.structured_outputs is not None and not set(req.structured_outputs) & set(CONSTRAINT_KINDS):
        options = req.structured_outputs
    elif req.structured_outputs is not None:
        try:
            given.append(("structured_outputs", SamplingParams(structured_outputs=req.structured_outputs)
                          .structured_outputs))
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), "structured_outputs") from None
    for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            try:
                given.append((name, StructuredOutputsParams(**{field: value})))
            except ValueError as e:
                raise bad_request(str(e), name) from None
    if len(given) > 1:
        raise bad_request(f"give one output constraint, not {' and '.join(name for name, _ in given)}", given[1][0])
    if options is not None:  # as vLLM fills the request's structured_outputs with response_format's schema
        # (an object with neither a constraint nor another field's is refused, as vLLM refuses it)
        try:
            constraint = {k: getattr(given[0][1], k) for k in CONSTRAINT_KINDS} if given else {}
            return SamplingParams(structured_outputs={**constraint, **options}).structured_outputs
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), "structured_outputs") from None
    return given[0][1] if given else None


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
    """A field the request leaves null (or out) takes the model's default (``defaults``: the engine's
    generation_defaults), else the neutral value; a value the request sets wins."""
    if req.stream_options is not None and not req.stream:  # as vLLM answers; OpenAI's too
        raise bad_request("stream_options can only be given when stream is true", "stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = logit_bias(req.logit_bias)
    sampling = with_defaults({name: getattr(req, name) for name in NEUTRAL}, defaults or {})
    try:
        return SamplingParams(
            n=req.n, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=stop, stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            logit_bias=bias, structured_outputs=structured_outputs(req), allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words, truncate_prompt_tokens=req.truncate_prompt_tokens, **sampling)
    except ValueError as e:
        raise from_value_error(e) from None


def usage(final: list[RequestOutput | None], prompt_lens: list[int]) -> UsageInfo:
    """Prompt tokens count once per prompt (not per sample); cached ones are the prefix-cache hits."""
    completion = sum(len(c.token_ids) for o in final if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in final if o is not None)
    prompt = sum(prompt_lens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def choice_usage(prompt_len: int, completion_tokens: int) -> UsageInfo:
    """A streamed chunk's usage under vLLM's continuous_usage_stats: its choice's prompt and its output so far."""
    return UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                     total_tokens=prompt_len + completion_tokens)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list | None  # the engine's per-token dicts for token_ids
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class ChoiceProgress:
    """What one choice has sent so far; `advance` returns what a new cumulative output adds, or None."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False

    def advance(self, c: CompletionOutput, want_logprobs: bool) -> Delta | None:
        if self.finished:
            return None
        text = c.text[self.text_len:]
        token_ids = c.token_ids[self.num_tokens:]
        finish = c.finish_reason
        if not text and finish is None and not (want_logprobs and token_ids):
            return None  # nothing a client could see yet (held-back stop prefix, half a character)
        logprobs = c.logprobs[self.num_tokens:len(c.token_ids)] if want_logprobs and c.logprobs is not None else None
        self.text_len, self.num_tokens = len(c.text), len(c.token_ids)
        self.finished = finish is not None
        return Delta(text, token_ids, logprobs, finish, c.stop_reason)
