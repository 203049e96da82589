"""Model calls: builders over `kiln:ai/inference@0.2.0`.

Parameters left unset take the host's defaults (max-tokens 256,
temperature 0.7, top-p 0.9). A request's `x-session-affinity` header is
the session of every model call made for it; `session()` here counts only
for requests without that header.

    reply = Chat("smollm2-135m-instruct").user("Hi!").max_tokens(32).send()
    print(reply.text)
"""

from typing import Iterator, List, Optional

from componentize_py_types import Err
from wit_world.imports import inference as wit
from wit_world.imports.inference import (  # noqa: F401 - re-exported
    Completion, FinishReason, Message, ModelInfo, Role, StreamEnd, ToolCall, Usage)

_STATUS = {
    "ModelNotFound": 404,
    "InvalidInput": 400,
    "QuotaExceeded": 429,
    "Overloaded": 503,
}


class AiError(Exception):
    """A model call failed: `kind` names why (`model-not-found`,
    `invalid-input`, `quota-exceeded`, `overloaded`, `aborted`,
    `runtime-error`) and the message says how to fix it."""

    def __init__(self, error: wit.Error) -> None:
        name = type(error).__name__[len("Error_"):]
        self.kind = "".join("-" + c.lower() if c.isupper() else c for c in name).lstrip("-")
        self.message = error.value
        self.http_status = _STATUS.get(name, 502)
        super().__init__(f"{self.kind}: {self.message}")


def _call(f, *args):
    try:
        return f(*args)
    except Err as e:
        raise AiError(e.value) from None


def models() -> List[ModelInfo]:
    """The models this function's tenant may call."""
    return wit.list_models()


class _Params:
    def __init__(self) -> None:
        self.params = wit.Params(
            max_tokens=None, temperature=None, top_p=None, top_k=None, seed=None,
            stop=[], session=None, format=None, tools=[], tool_choice=None,
            parallel_tool_calls=None, logprobs=None)

    def max_tokens(self, n: int):
        """Most tokens to generate."""
        self.params.max_tokens = n
        return self

    def temperature(self, t: float):
        """Sampling temperature; 0 is greedy."""
        self.params.temperature = t
        return self

    def top_p(self, p: float):
        """Nucleus sampling mass."""
        self.params.top_p = p
        return self

    def top_k(self, k: int):
        """Sample among the `k` most likely tokens."""
        self.params.top_k = k
        return self

    def seed(self, seed: int):
        """Seed of the sampler, for repeatable draws."""
        self.params.seed = seed
        return self

    def stop(self, s: str):
        """Ends the generation before this text (repeatable)."""
        self.params.stop.append(s)
        return self

    def session(self, key: str):
        """The session (prefix-cache affinity) of this call."""
        self.params.session = key
        return self

    def json_object(self):
        """The output is a JSON object."""
        self.params.format = wit.OutputFormat_JsonObject()
        return self

    def json_schema(self, schema: str):
        """The output is JSON that `schema` (JSON Schema text) accepts."""
        self.params.format = wit.OutputFormat_JsonSchema(schema)
        return self

    def grammar(self, lark: str):
        """The output is a sentence of this Lark grammar."""
        self.params.format = wit.OutputFormat_Grammar(lark)
        return self


class Chat(_Params):
    """A chat completion being built."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model
        self.messages: List[Message] = []

    def message(self, role: Role, content: str) -> "Chat":
        """Appends a message."""
        self.messages.append(Message(role=role, content=content, tool_calls=[], tool_call_id=None))
        return self

    def system(self, content: str) -> "Chat":
        """Appends a system message."""
        return self.message(Role.SYSTEM, content)

    def user(self, content: str) -> "Chat":
        """Appends a user message."""
        return self.message(Role.USER, content)

    def assistant(self, content: str) -> "Chat":
        """Appends an assistant message."""
        return self.message(Role.ASSISTANT, content)

    def send(self) -> Completion:
        """Generates the whole reply."""
        return _call(wit.chat, self.model, self.messages, self.params)

    def stream(self) -> "TextStream":
        """Starts generating; iterate the result for text as it is decoded."""
        return TextStream(_call(wit.stream_chat, self.model, self.messages, self.params))


class Complete(_Params):
    """A raw-prompt completion being built."""

    def __init__(self, model: str, prompt: str) -> None:
        super().__init__()
        self.model = model
        self.prompt = prompt

    def send(self) -> Completion:
        """Generates the continuation."""
        return _call(wit.complete, self.model, self.prompt, self.params)


class TextStream:
    """Text of a streaming chat, chunk by chunk. Leaving its `with` block
    (or `close()`) cancels the generation."""

    def __init__(self, inner: wit.ChatStream) -> None:
        self._inner: Optional[wit.ChatStream] = inner
        self.end: Optional[StreamEnd] = None

    def __iter__(self) -> Iterator[str]:
        while self._inner is not None:
            event = _call(self._inner.next)
            if isinstance(event, wit.StreamEvent_Done):
                self.end = event.value
                self.close()
                return
            yield event.value.text

    def close(self) -> None:
        """Cancels the generation, if it is still running."""
        if self._inner is not None:
            self._inner.__exit__(None, None, None)
            self._inner = None

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
