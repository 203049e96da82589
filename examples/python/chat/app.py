"""Kiln's chat example in Python: `POST {"messages": [{"role", "content"}],
"model"?, "max_tokens"?, "temperature"?}` and the reply streams back as
server-sent events, one `data: {"delta": "..."}` per chunk as the model
decodes it, then `data: {"finish_reason", "usage"}` and `data: [DONE]`."""

import json

from kiln_guest import Handler, Request, Response, ai

ROLES = {"system": ai.Role.SYSTEM, "assistant": ai.Role.ASSISTANT}
FINISH = {ai.FinishReason.STOP: "stop", ai.FinishReason.LENGTH: "length",
          ai.FinishReason.TOOL_CALLS: "tool_calls"}


def error(status: int, message: str) -> Response:
    return Response.json(status, {"error": {"message": message}})


def events(stream: ai.TextStream):
    # Leaving the `with` block (the client went away) cancels the generation.
    with stream:
        try:
            for text in stream:
                yield f"data: {json.dumps({'delta': text})}\n\n"
        except ai.AiError as e:
            yield f"data: {json.dumps({'error': str(e)})}\n\n"
    if stream.end is not None:
        usage = stream.end.usage
        done = {
            "finish_reason": FINISH[stream.end.finish_reason],
            "usage": {"prompt_tokens": usage.prompt_tokens,
                      "completion_tokens": usage.completion_tokens,
                      "cached_tokens": usage.cached_prompt_tokens},
        }
        yield f"data: {json.dumps(done)}\n\n"
    yield "data: [DONE]\n\n"


class IncomingHandler(Handler):
    def handle_request(self, req: Request) -> Response:
        if req.method != "POST":
            return error(405, 'POST a JSON body {"messages": [{"role": "user", "content": "..."}]}')
        try:
            body = json.loads(req.body())
            messages = body["messages"]
        except (ValueError, KeyError, TypeError) as e:
            return error(400, f"invalid JSON body: {e!r}")
        chat = ai.Chat(body.get("model") or "smollm2-135m-instruct")
        for m in messages:
            chat.message(ROLES.get(m.get("role"), ai.Role.USER), str(m.get("content", "")))
        if body.get("max_tokens") is not None:
            chat.max_tokens(int(body["max_tokens"]))
        if body.get("temperature") is not None:
            chat.temperature(float(body["temperature"]))
        try:
            stream = chat.stream()
        except ai.AiError as e:
            return error(e.http_status, str(e))
        return (Response.stream(200, events(stream))
                .header("content-type", "text/event-stream")
                .header("cache-control", "no-cache")
                .header("x-session-affinity", req.session() or ""))
