"""Pydantic schemas of the OpenAI API as the server speaks it: field names and meanings follow OpenAI's
(and vLLM's extensions: top_k, min_p, ignore_eos, stop_token_ids, …). Unknown request fields are ignored."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

_INT64 = 2**63 - 1
_INT32 = 2**31 - 1
MAX_N = 128  # samples per request, OpenAI's cap too


def random_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def response_id(prefix: str, req: "SamplingRequest") -> str:
    """The response's id: the client's request_id (the body's, else its X-Request-Id header) after the prefix, as
    vLLM names it, else a random one. The engine's own request ids stay random, so clients reusing an id never
    collide."""
    return f"{prefix}-{req.request_id}" if req.request_id else random_id(prefix)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN/inf sampling values are refused


# ---- errors ----------------------------------------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- requests --------------------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # usage in every chunk (vLLM's extension)


class SamplingRequest(OpenAIModel):
    """Fields completions and chat share."""

    model: str | None = None
    n: int = Field(1, le=MAX_N)  # null (OpenAI allows it) is taken as 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=_INT32)
    min_p: float | None = None
    seed: int | None = Field(None, ge=-2**63, le=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, le=_INT32)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's semantics (nvllm.sampling_params); logit_bias: token id (a decimal string) → bias, clamped to ±100
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None  # None: the model's default (generation_config.json), else 1
    logit_bias: dict[str, float] | None = None
    # vLLM's (nvllm.layers.token_masks): draw only these ids; never complete these words; keep the prompt's last k
    # tokens (-1: as many as max_model_len allows)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, le=_INT32)
    # vLLM's: each prompt token's log-probability and the top k at its position (not with stream)
    prompt_logprobs: int | None = None
    # structured outputs (nvllm.serve.params.structured_outputs): OpenAI's response_format, vLLM's
    # structured_outputs object, or its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # beam search (vLLM's extension; nvllm.serve.beam): n beams, ranked by cum_logprob / len**length_penalty
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    # vLLM's: blocks of the prefix cache are shared only among requests with the same salt (multi-tenant privacy)
    cache_salt: str | None = Field(None, min_length=1)
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority; must be 0 under fcfs
    request_id: str | None = Field(None, min_length=1, max_length=256)  # vLLM's: names the response (X-Request-Id wins)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:N" (None: the server's)
    return_token_ids: bool | None = False  # vLLM's: the prompt's and the reply's token ids beside the text

    @field_validator("n", mode="before")
    @classmethod
    def _n_null_is_one(cls, value):
        return 1 if value is None else value


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and the like) before a text prompt


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part, read as text


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart | str] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning: str | None = None  # an assistant turn's thinking, as a reply gave it (vLLM's name)
    reasoning_content: str | None = None  # the same, as nvllm's replies name it


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's per-request template: refused, as vLLM refuses an untrusted one
    # vLLM's: the reply's content starts with the last message's when that is the assistant's (continuing it)
    echo: bool = False
    # vLLM's: special tokens added to the rendered conversation by the tokenizer (None: only where no chat
    # template of the model's adds them itself, the fallback's case)
    add_special_tokens: bool | None = None
    # tool calling (nvllm.serve.tools): the default choice is "auto" when tools are given, else "none"
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as in chat: the same tokens as a chat request with these fields
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[Tool] | None = None  # given to the chat template with messages


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1)


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------------------------
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """vLLM's Logprob, as its prompt_logprobs carry one per token id (rank 1: the most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # None at the first prompt token, as vLLM gives it


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids (streamed: in the choice's first chunk)
    token_ids: list[int] | None = None  # return_token_ids (streamed: each chunk's new ones)


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    reasoning_content: str | None = None  # --reasoning-parser: the thinking block (vLLM's field)
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class _Delta(OpenAIModel):
    @model_serializer(mode="wrap")
    def _omit_none(self, handler):  # a delta carries only what changed: no "role": null after the first
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Delta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Delta):
    index: int  # the call's place in the choice's tool_calls; its first delta has the id, type and name
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Delta):
    role: str | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the chunk's new ones


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class ModelPermission(OpenAIModel):
    """The permission object OpenAI's model listing once carried, and vLLM's still does."""

    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nvllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIModel):
    prompt: str
