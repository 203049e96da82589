// Kiln's hello-world function in JavaScript: a greeting that echoes the
// request's method, path and `x-session-affinity` header.

export default {
  async fetch(request) {
    const url = new URL(request.url);
    const session = request.headers.get("x-session-affinity") ?? "none";
    return new Response(
      `Hello from Kiln (JavaScript)!\nmethod: ${request.method}\npath: ${url.pathname}${url.search}\nsession: ${session}\n`,
      { headers: { "content-type": "text/plain; charset=utf-8" } },
    );
  },
};
