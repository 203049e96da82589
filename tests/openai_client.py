"""Drives Kiln's OpenAI-compatible API with the official `openai` client.

Run by tests/tests/openai.rs with OPENAI_BASE_URL, OPENAI_API_KEY and
KILN_MODEL set; prints "all checks passed" or fails with an assertion.
"""

import json
import math
import os

import openai
import pydantic

client = openai.OpenAI()
model = os.environ["KILN_MODEL"]

ids = [m.id for m in client.models.list()]
assert model in ids, ids

messages = [{"role": "user", "content": "What is the capital of France?"}]
reply = client.chat.completions.create(
    model=model, messages=messages, max_completion_tokens=8, temperature=0, seed=1, user="u-1"
)
assert reply.object == "chat.completion", reply
text = reply.choices[0].message.content
assert isinstance(text, str) and text, reply
assert reply.choices[0].finish_reason in ("stop", "length"), reply
assert reply.usage.prompt_tokens_details.cached_tokens is not None, reply.usage

stream = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=8,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
pieces, usage = [], None
for chunk in stream:
    if chunk.choices:
        pieces.append(chunk.choices[0].delta.content or "")
    if chunk.usage is not None:
        usage = chunk.usage
assert "".join(pieces) == text, (pieces, text)
assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens, usage
assert usage.prompt_tokens_details.cached_tokens > 0, usage

done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
assert done.object == "text_completion" and done.choices[0].text, done

# Log-probabilities: one entry per generated token, each with its bytes and
# the most likely tokens, most likely first; greedy picks the first; the
# alternatives' probabilities make at most a whole distribution.
lp = client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
)
entries = lp.choices[0].logprobs.content
assert len(entries) == lp.usage.completion_tokens, (entries, lp.usage)
assert lp.choices[0].message.content == text, (lp.choices[0].message.content, text)
for e in entries:
    assert e.logprob <= 0 and len(e.top_logprobs) == 5, e
    assert e.token == e.top_logprobs[0].token, e
    # A token ending inside a character reads as U+FFFD; its bytes are real.
    assert "\ufffd" in e.token or bytes(e.bytes) == e.token.encode(), e
    figures = [t.logprob for t in e.top_logprobs]
    assert figures == sorted(figures, reverse=True), figures
    assert sum(math.exp(f) for f in figures) <= 1 + 1e-5, figures
assert "".join(e.token for e in entries).strip() == text.strip(), (entries, text)

streamed = client.chat.completions.create(
    model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, stream=True
)
tokens = []
for chunk in streamed:
    if chunk.choices and chunk.choices[0].logprobs is not None:
        tokens += [e.token for e in chunk.choices[0].logprobs.content]
assert tokens == [e.token for e in entries], (tokens, entries)

legacy = client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3
)
lps = legacy.choices[0].logprobs
assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == 6, lps
assert all(len(t) <= 3 for t in lps.top_logprobs), lps
assert lps.text_offset[0] == 0 and lps.text_offset == sorted(lps.text_offset), lps

try:
    client.chat.completions.create(model=model, messages=messages, top_logprobs=2)
    raise AssertionError("top_logprobs without logprobs must fail")
except openai.BadRequestError as e:
    assert e.body["param"] == "top_logprobs", e.body

try:
    client.chat.completions.create(model="no-such-model", messages=messages)
    raise AssertionError("an unknown model must fail")
except openai.NotFoundError as e:
    assert e.status_code == 404, e

# n samples: one choice each, sample 0 as the lone call with the same seed.
story = [{"role": "user", "content": "Tell me a story about a cat."}]
many = client.chat.completions.create(
    model=model, messages=story, max_tokens=8, temperature=1.0, seed=5, n=3
)
assert [c.index for c in many.choices] == [0, 1, 2], many
lone = client.chat.completions.create(model=model, messages=story, max_tokens=8, temperature=1.0, seed=5)
assert many.choices[0].message.content == lone.choices[0].message.content, (many, lone)
assert many.usage.prompt_tokens == lone.usage.prompt_tokens, many.usage
# Every sample's tokens count (8 each unless one ended early).
assert lone.usage.completion_tokens < many.usage.completion_tokens <= 24, many.usage
streamed = client.chat.completions.create(
    model=model, messages=story, max_tokens=8, temperature=1.0, seed=5, n=3, stream=True
)
texts = ["", "", ""]
for chunk in streamed:
    for c in chunk.choices:
        texts[c.index] += c.delta.content or ""
assert texts == [c.message.content for c in many.choices], (texts, many.choices)

try:
    client.chat.completions.create(model=model, messages=messages, n=17)
    raise AssertionError("n=17 must fail")
except openai.BadRequestError as e:
    assert e.body["param"] == "n", e.body

# Structured outputs: the client's parse() with a pydantic model.
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=32)
    country: str = pydantic.Field(max_length=32)


chat_api = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
parsed = chat_api(model=model, messages=messages, response_format=City, max_tokens=64, temperature=0)
city = parsed.choices[0].message.parsed
assert isinstance(city, City), parsed

# A tool-calling round trip: the model calls the tool, gets its result,
# answers in text.
weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
called = client.chat.completions.create(
    model=model, messages=ask, tools=[weather], tool_choice="required",
    parallel_tool_calls=False, max_tokens=48, temperature=0,
)
choice = called.choices[0]
assert choice.finish_reason == "tool_calls", called
(call,) = choice.message.tool_calls
assert call.function.name == "get_weather", call
assert isinstance(json.loads(call.function.arguments)["city"], str), call
ask.append(choice.message.model_dump(exclude_none=True))
ask.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
answered = client.chat.completions.create(
    model=model, messages=ask, tools=[weather], tool_choice="none", max_tokens=16, temperature=0
)
assert answered.choices[0].message.content and not answered.choices[0].message.tool_calls, answered

print("all checks passed")
