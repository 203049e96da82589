// Kiln's chat example in JavaScript: `POST {"messages": [{"role",
// "content"}], "model"?, "max_tokens"?, "temperature"?}` and the reply
// streams back as server-sent events, one `data: {"delta": "..."}` per
// chunk as the model decodes it, then `data: {"finish_reason", "usage"}`
// and `data: [DONE]`.

import { AiError, Chat, streamResponse } from "./kiln.js";

const FINISH = { stop: "stop", length: "length", "tool-calls": "tool_calls" };

function error(status, message) {
  return Response.json({ error: { message } }, { status });
}

function* events(stream) {
  try {
    for (const text of stream) {
      yield `data: ${JSON.stringify({ delta: text })}\n\n`;
    }
  } catch (e) {
    yield `data: ${JSON.stringify({ error: String(e.message ?? e) })}\n\n`;
  }
  if (stream.end) {
    const { finishReason, usage } = stream.end;
    const done = {
      finish_reason: FINISH[finishReason] ?? finishReason,
      usage: {
        prompt_tokens: usage.promptTokens,
        completion_tokens: usage.completionTokens,
        cached_tokens: usage.cachedPromptTokens,
      },
    };
    yield `data: ${JSON.stringify(done)}\n\n`;
  }
  yield "data: [DONE]\n\n";
}

export default {
  async fetch(request) {
    if (request.method !== "POST") {
      return error(405, 'POST a JSON body {"messages": [{"role": "user", "content": "..."}]}');
    }
    let body;
    try {
      body = await request.json();
      if (!Array.isArray(body.messages)) throw new Error("`messages` must be an array");
    } catch (e) {
      return error(400, `invalid JSON body: ${e.message}`);
    }
    const chat = new Chat(body.model ?? "smollm2-135m-instruct");
    for (const m of body.messages) {
      const role = ["system", "assistant"].includes(m.role) ? m.role : "user";
      chat.message(role, String(m.content ?? ""));
    }
    if (body.max_tokens != null) chat.maxTokens(body.max_tokens);
    if (body.temperature != null) chat.temperature(body.temperature);
    let stream;
    try {
      stream = chat.stream();
    } catch (e) {
      if (e instanceof AiError) return error(e.httpStatus, e.message);
      throw e;
    }
    return streamResponse(events(stream), {
      headers: {
        "content-type": "text/event-stream",
        "cache-control": "no-cache",
        "x-session-affinity": request.headers.get("x-session-affinity") ?? "",
      },
    });
  },
};
