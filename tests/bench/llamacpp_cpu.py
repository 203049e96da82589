"""llama.cpp's prompt and decode throughput on the same model and machine as
`kiln bench`, for docs/perf.md.

Run: python3 tests/bench/llamacpp_cpu.py ~/.cache/kiln/SmolLM2-135M-Instruct.Q4_1.gguf [prompt_tokens] [gen_tokens]
(needs `pip install llama-cpp-python==0.3.16`). Concurrency 1 only: the
Python binding runs one sequence at a time.
"""

import random
import sys
import time

import llama_cpp


def main():
    path = sys.argv[1]
    n_prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    n_gen = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=512, verbose=False, n_threads=2, seed=0)
    rng = random.Random(1)
    vocab = llm.n_vocab()
    best_p, best_d = 0.0, 0.0
    for _ in range(3):
        prompt = [rng.randrange(vocab // 8, vocab // 2) for _ in range(n_prompt)]
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        tp = time.perf_counter() - t
        tok = 1000
        t = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([tok])
        td = time.perf_counter() - t
        best_p = max(best_p, n_prompt / tp)
        best_d = max(best_d, n_gen / td)
    print(f"llama.cpp {llama_cpp.__version__}: prompt {best_p:.1f} tok/s, decode {best_d:.1f} tok/s (concurrency 1, best of 3)")


if __name__ == "__main__":
    main()
