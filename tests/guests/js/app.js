// A JavaScript function that breaks Kiln's limits on purpose: `/loop`
// spins until the CPU-time limit stops it, `/grow` allocates until the
// memory limit refuses more; anything else answers 200.

export default {
  async fetch(request) {
    const path = new URL(request.url).pathname;
    if (path === "/loop") {
      for (;;) {}
    }
    if (path === "/grow") {
      const hoard = [];
      for (;;) hoard.push(new Uint8Array(16 << 20));
    }
    return new Response("ok");
  },
};
