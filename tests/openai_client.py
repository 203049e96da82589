"""Drives Kiln's OpenAI-compatible API with the official `openai` client.

Run by tests/tests/openai.rs with OPENAI_BASE_URL, OPENAI_API_KEY and
KILN_MODEL set; prints "all checks passed" or fails with an assertion.
"""

import os

import openai

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

try:
    client.chat.completions.create(model="no-such-model", messages=messages)
    raise AssertionError("an unknown model must fail")
except openai.NotFoundError as e:
    assert e.status_code == 404, e

try:
    client.chat.completions.create(model=model, messages=messages, n=2)
    raise AssertionError("n=2 must fail")
except openai.BadRequestError as e:
    assert e.body["param"] == "n", e.body

print("all checks passed")
