"""LLM.chat (vLLM's offline chat): conversations through the tokenizer's chat template give exactly the ids
`tokenizer.apply_chat_template` gives, and a tokenizer without one gets the server's fallback rendering."""

from __future__ import annotations

import shutil

import pytest

from nvllm import SamplingParams
from nvllm.assets import demo_model_path
from nvllm.engine.tokenizer import load_tokenizer
from nvllm.serve.prompts import PromptProcessor
from nvllm.serve.protocol import ChatMessage
from tests.conftest import SHARED_DATA, build_tiny_model, make_llm

GREEDY = SamplingParams(max_tokens=4, temperature=0)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny random model with the Qwen tokenizer (Qwen2.5's BPE, Qwen3's tokenizer_config.json and chat
    template) and a vocabulary to match."""
    if SHARED_DATA is None or not (SHARED_DATA / "tokenizers/qwen3/tokenizer_config.json").is_file():
        pytest.skip("shared tokenizers not present")
    path = build_tiny_model("qwen3", tmp_path_factory.mktemp("chat") / "qwen", vocab_size=151680)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink()
    for name in ("qwen2.5/vocab.json", "qwen2.5/merges.txt", "qwen3/tokenizer_config.json"):
        shutil.copy(SHARED_DATA / "tokenizers" / name, path)
    return make_llm(str(path))


def template_ids(tok, messages, **kw) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)


def test_chat_is_the_tokenizers_template(qwen):
    tok = qwen.get_tokenizer()
    out = qwen.chat(CHAT, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt_token_ids == template_ids(tok, CHAT, add_generation_prompt=True)
    assert out[0].prompt == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\n")
    # then generation exactly as for those token ids
    same = qwen.generate([out[0].prompt_token_ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out[0].outputs[0].token_ids == same


def test_chat_takes_a_list_of_conversations_and_the_templates_options(qwen):
    tok = qwen.get_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    outs = qwen.chat([CHAT, parts], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        template_ids(tok, CHAT, add_generation_prompt=True),
        template_ids(tok, [{"role": "user", "content": "Hi\nthere"}], add_generation_prompt=True)]
    cont = CHAT + [{"role": "assistant", "content": "Hello,"}]
    out = qwen.chat(cont, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == template_ids(tok, cont, continue_final_message=True)
    out = qwen.chat(CHAT, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt_token_ids == template_ids(tok, CHAT, add_generation_prompt=True, enable_thinking=False)
    assert "<think>" in out.prompt
    mine = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    out = qwen.chat(CHAT, GREEDY, use_tqdm=False, chat_template=mine)[0]
    assert out.prompt == "<|im_start|>Be brief.<|im_start|>Hi there"


@pytest.mark.parametrize("messages, kw, message", [
    ([], {}, "messages must not be empty"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "only text content parts are supported"),
    ([{"content": "no role"}], {}, "must be a dict with a string 'role'"),
    (CHAT, {"continue_final_message": True}, "cannot both be true"),
])
def test_bad_conversations_raise_and_queue_nothing(qwen, messages, kw, message):
    with pytest.raises(ValueError, match=message):
        qwen.chat([CHAT, messages] if messages else messages, GREEDY, use_tqdm=False, **kw)
    assert not qwen.engine.has_unfinished_requests()


def test_a_tokenizer_without_a_template_renders_as_the_server_does():
    llm = make_llm(demo_model_path())
    tok = llm.get_tokenizer()
    assert not getattr(tok, "chat_template", None)
    server = PromptProcessor(load_tokenizer(llm.config.tokenizer), llm.engine.vocab_size, llm.engine.max_model_len)
    out = llm.chat(CHAT, use_tqdm=False)[0]
    assert out.prompt_token_ids == server.chat_prompt([ChatMessage(**m) for m in CHAT])
    assert out.prompt == "Be brief.\n\nUser: Hi there\nAssistant:" and out.prompt_token_ids[0] == tok.bos_token_id
    assert len(out.outputs[0].token_ids) <= 16  # no params: the model's defaults (SamplingParams' own here)


PARTS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}{% if c['type'] == 'text' %}"
                  "{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant:"
                  "{% endif %}")


@pytest.mark.parametrize("template, fmt", [
    (PARTS_TEMPLATE, "openai"),
    ("{% for m in messages %}{% for c in m.content | selectattr('type', 'equalto', 'text') %}{{ c.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}", "string"),
    ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}", "string"),
    ("{% for m in messages %}{% generation %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endgeneration %}"
     "{% endfor %}", "openai"),  # HF's own tag, in HF's environment
])
def test_content_format_detected_as_vllm_does(template, fmt):
    from nvllm.chat_template import FALLBACK_CHAT_TEMPLATE, detect_content_format

    assert detect_content_format(template) == fmt
    assert detect_content_format(FALLBACK_CHAT_TEMPLATE) == "string"


def test_a_template_reading_content_parts_gets_them():
    """A template that loops over each message's content parts gets OpenAI's list (what HF's own
    apply_chat_template renders from such messages); "string" joins the parts, as before; a plain string content
    becomes one part."""
    from nvllm.chat_template import render_chat

    llm = make_llm(demo_model_path())
    tok = llm.get_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    hf = tok.apply_chat_template(parts, chat_template=PARTS_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert hf == "user: Hellothereassistant:"  # HF's template environment trims the newline after a block
    out = llm.chat(parts, GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)[0]
    assert out.prompt == hf
    plain = llm.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)
    assert plain[0].prompt == "user: Helloassistant:"
    assert render_chat(tok, PARTS_TEMPLATE, parts, content_format="string") == "user: assistant:"
    from nvllm.chat_template import FALLBACK_CHAT_TEMPLATE

    fallback = render_chat(tok, FALLBACK_CHAT_TEMPLATE, parts, content_format="openai")  # nvllm's own reads strings
    assert fallback == render_chat(tok, FALLBACK_CHAT_TEMPLATE, parts) and "'type'" not in fallback
    with pytest.raises(ValueError, match="unknown chat template content format 'html'"):
        llm.chat(parts, GREEDY, use_tqdm=False, chat_template_content_format="html")


NAMED = [{"name": "default", "template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"},
         {"name": "tool_use", "template": "tools: {{ tools | map(attribute='function.name') | join(',') }}\n"
                                          "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]


def test_named_chat_templates_are_picked_as_transformers_picks_them(tmp_path):
    """A tokenizer_config.json with named templates (Hermes's "default" and "tool_use"): "tool_use" renders when
    tools are given, "default" otherwise, in LLM.chat and on the server, as HF's apply_chat_template does."""
    import json

    from nvllm.chat_template import ChatTemplateError, render_chat

    model = tmp_path / "named"
    shutil.copytree(demo_model_path(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": NAMED}))
    llm = make_llm(str(model))
    tok = llm.get_tokenizer()
    assert isinstance(tok.chat_template, dict)
    user = [{"role": "user", "content": "Hi"}]
    for tools in (None, TOOLS):
        hf = tok.apply_chat_template(user, tokenize=False, tools=tools)
        assert llm.chat(user, GREEDY, use_tqdm=False, add_generation_prompt=False, tools=tools)[0].prompt == hf
        server = PromptProcessor(load_tokenizer(str(model)), llm.engine.vocab_size, llm.engine.max_model_len)
        assert server.render_chat([ChatMessage(**m) for m in user], False, tools=tools) == hf
    assert hf == "tools: weather\nuser: Hi\n"
    with pytest.raises(ChatTemplateError, match="named other, tool_use, none 'default'"):
        render_chat(tok, {"tool_use": "x", "other": "y"}, user)


def test_an_assistant_turns_reasoning_reaches_the_template(tmp_path):
    """Qwen3's template keeps the thinking of the assistant turns after the last user message (a tool loop): the
    reasoning a reply returned (``reasoning_content``, or vLLM's ``reasoning``) is rendered as HF renders a
    ``reasoning_content`` field; tool call arguments may be an object, as in HF's tool-use format."""
    from pathlib import Path

    from nvllm.chat_template import render_chat

    template = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    tok = load_tokenizer(demo_model_path())
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    hf_call = {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    tail = [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    thought = {"role": "assistant", "content": "", "reasoning_content": "I should call the tool",
               "tool_calls": [hf_call]}
    hf = tok.apply_chat_template([{"role": "user", "content": "Weather?"}, thought] + tail, chat_template=template,
                                 tokenize=False, add_generation_prompt=True)
    assert "<think>\nI should call the tool\n</think>" in hf
    for key in ("reasoning_content", "reasoning"):
        turn = {"role": "assistant", "content": "", key: "I should call the tool", "tool_calls": [call]}
        assert render_chat(tok, template, [{"role": "user", "content": "Weather?"}, turn] + tail) == hf
        (tmp_path / "qwen3.jinja").write_text(template)
        server = PromptProcessor(tok, 512, 256, str(tmp_path / "qwen3.jinja"))
        assert server.render_chat([ChatMessage(**m) for m in [{"role": "user", "content": "Weather?"}, turn]
                                   + tail]) == hf
    turn = {"role": "assistant", "content": "", "reasoning": "I should call the tool", "tool_calls": [hf_call]}
    assert render_chat(tok, template, [{"role": "user", "content": "Weather?"}, turn] + tail) == hf


def test_content_parts_read_as_vllm_reads_them():
    """A bare string in a content list is text, and so is an assistant's refusal part (OpenAI's)."""
    from nvllm.chat_template import FALLBACK_CHAT_TEMPLATE, render_chat

    tok = load_tokenizer(demo_model_path())
    messages = [{"role": "user", "content": ["Hello", {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                {"role": "user", "content": "Why?"}]
    expected = "User: Hello\nthere\nAssistant: No.\nUser: Why?\nAssistant:"
    assert render_chat(tok, FALLBACK_CHAT_TEMPLATE, messages) == expected
    server = PromptProcessor(tok, 512, 256)
    assert server.render_chat([ChatMessage(**m) for m in messages]) == expected


def test_chat_template_flag_takes_a_file_or_the_template_itself(tmp_path):
    """--chat-template as vLLM reads it: a file, or Jinja text (its "\\n" escapes decoded); a value that is neither
    is named as a missing file."""
    from nvllm.chat_template import read_chat_template

    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0].content }}")
    assert read_chat_template(str(file)) == "{{ messages[0].content }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}\\n{% endfor %}") == \
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert read_chat_template("{{ x }}" * 200).startswith("{{ x }}")  # too long a name for a file
    with pytest.raises(FileNotFoundError, match="chat template file missing.jinja does not exist"):
        read_chat_template("missing.jinja")
