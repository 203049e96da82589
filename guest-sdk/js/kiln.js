// Write Kiln functions in JavaScript: model calls over Kiln's
// `kiln:ai/inference@0.2.0`, and a streamed `Response` from a generator.
//
// A function is a module with a Workers-style default export:
//
//     import { Chat } from "./kiln.js";
//     export default {
//       async fetch(request) {
//         const reply = new Chat("smollm2-135m-instruct").user("Hi!").send();
//         return new Response(reply.text);
//       },
//     };
//
// `kiln build` compiles it with componentize-js (StarlingMonkey), whose
// fetch event serves `wasi:http/incoming-handler`.

import * as wit from "kiln:ai/inference@0.2.0";

// The bindings name a resource's destructor by this symbol (the engine
// may predate `Symbol.dispose`).
const DISPOSE = Symbol.dispose ?? Symbol.for("dispose");

const STATUS = {
  "model-not-found": 404,
  "invalid-input": 400,
  "quota-exceeded": 429,
  overloaded: 503,
};

/** A model call failed: `kind` names why, the message says how to fix it. */
export class AiError extends Error {
  constructor(error) {
    const payload = error?.payload ?? error;
    const kind = payload?.tag ?? "runtime-error";
    super(`${kind}: ${payload?.val ?? String(error)}`);
    this.kind = kind;
    /** The HTTP status a function would answer this error with. */
    this.httpStatus = STATUS[kind] ?? 502;
  }
}

function call(f) {
  try {
    return f();
  } catch (e) {
    throw new AiError(e);
  }
}

/** The models this function's tenant may call. */
export function models() {
  return wit.listModels();
}

class Params {
  constructor() {
    this.params = { stop: [], tools: [] };
  }
  /** Most tokens to generate. */
  maxTokens(n) {
    this.params.maxTokens = n;
    return this;
  }
  /** Sampling temperature; 0 is greedy. */
  temperature(t) {
    this.params.temperature = t;
    return this;
  }
  /** Nucleus sampling mass. */
  topP(p) {
    this.params.topP = p;
    return this;
  }
  /** Sample among the `k` most likely tokens. */
  topK(k) {
    this.params.topK = k;
    return this;
  }
  /** Seed of the sampler, for repeatable draws (a BigInt or a number). */
  seed(s) {
    this.params.seed = BigInt(s);
    return this;
  }
  /** Ends the generation before this text (repeatable). */
  stop(s) {
    this.params.stop.push(s);
    return this;
  }
  /** The session (prefix-cache affinity) of this call. */
  session(key) {
    this.params.session = key;
    return this;
  }
  /** The output is a JSON object. */
  jsonObject() {
    this.params.format = { tag: "json-object" };
    return this;
  }
  /** The output is JSON that `schema` (an object or JSON Schema text) accepts. */
  jsonSchema(schema) {
    const text = typeof schema === "string" ? schema : JSON.stringify(schema);
    this.params.format = { tag: "json-schema", val: text };
    return this;
  }
  /** The output is a sentence of this Lark grammar. */
  grammar(lark) {
    this.params.format = { tag: "grammar", val: lark };
    return this;
  }
}

/** A chat completion being built. */
export class Chat extends Params {
  constructor(model) {
    super();
    this.model = model;
    this.messages = [];
  }
  /** Appends a message; `role` is "system", "user", "assistant" or "tool". */
  message(role, content) {
    this.messages.push({ role, content, toolCalls: [] });
    return this;
  }
  /** Appends a system message. */
  system(content) {
    return this.message("system", content);
  }
  /** Appends a user message. */
  user(content) {
    return this.message("user", content);
  }
  /** Appends an assistant message. */
  assistant(content) {
    return this.message("assistant", content);
  }
  /** Generates the whole reply: `{text, finishReason, usage, toolCalls}`. */
  send() {
    return call(() => wit.chat(this.model, this.messages, this.params));
  }
  /** Starts generating; iterate the result for text as it is decoded. */
  stream() {
    return new TextStream(call(() => wit.streamChat(this.model, this.messages, this.params)));
  }
}

/** A raw-prompt completion being built. */
export class Complete extends Params {
  constructor(model, prompt) {
    super();
    this.model = model;
    this.prompt = prompt;
  }
  /** Generates the continuation. */
  send() {
    return call(() => wit.complete(this.model, this.prompt, this.params));
  }
}

/** Text of a streaming chat, chunk by chunk; `end` holds why it ended and
 * what it consumed. `close()` (or leaving a `for` loop early) cancels it. */
export class TextStream {
  constructor(inner) {
    this.inner = inner;
    this.end = undefined;
  }
  *[Symbol.iterator]() {
    try {
      while (this.inner) {
        const event = call(() => this.inner.next());
        if (event.tag === "done") {
          this.end = event.val;
          return;
        }
        yield event.val.text;
      }
    } finally {
      this.close();
    }
  }
  /** Cancels the generation, if it is still running. */
  close() {
    const inner = this.inner;
    this.inner = undefined;
    inner?.[DISPOSE]?.();
  }
}

/** A response whose body is the chunks (strings or bytes) a generator
 * yields, sent as they come. If the client goes away the generator is
 * returned early, so its `finally` blocks (and a model stream it
 * iterates) are cancelled. */
export function streamResponse(chunks, init) {
  const encoder = new TextEncoder();
  const body = new ReadableStream({
    pull(controller) {
      const { value, done } = chunks.next();
      if (done) {
        controller.close();
      } else {
        controller.enqueue(typeof value === "string" ? encoder.encode(value) : value);
      }
    },
    cancel() {
      chunks.return();
    },
  });
  return new Response(body, init);
}
