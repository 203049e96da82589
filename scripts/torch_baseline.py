"""The baseline a user would otherwise pick: the same Llama-3-8B shape in
PyTorch + transformers on the same GPU, bf16, greedy `generate` with a
static KV cache. Random weights (as `kiln bench --model synthetic:llama-3-8b`);
random prompt ids. Prints decode tokens/s per batch size.

    python3 scripts/torch_baseline.py --batches 1,8,32,64 --prompt 1024 --gen 256
"""

import argparse
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM


def llama3_8b() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def timed_generate(model, ids, new_tokens):
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    t = time.perf_counter()
    with torch.device("cuda"):
        model = LlamaForCausalLM(llama3_8b()).eval()
    # Recent transformers compile the forward pass when the cache is static,
    # which takes minutes; the baseline is eager with a static cache.
    model.generation_config.disable_compile = True
    print(f"torch {torch.__version__} | transformers {transformers.__version__} | "
          f"{torch.cuda.get_device_name()} | "
          f"model built in {time.perf_counter() - t:.1f} s", flush=True)
    print(f"{'batch':>5} {'prefill s':>9} {'total s':>8} {'decode t/s':>11} {'ITL ms':>7}", flush=True)
    with torch.inference_mode():
        for b in [int(x) for x in args.batches.split(",")]:
            ids = torch.randint(16000, 64000, (b, args.prompt), device="cuda")
            timed_generate(model, ids[:, :32], 4)  # warm-up for this batch size
            prefill = timed_generate(model, ids, 1)
            total = timed_generate(model, ids, args.gen)
            decode = total - prefill
            steps = args.gen - 1
            print(f"{b:>5} {prefill:>9.2f} {total:>8.2f} {b * steps / decode:>11.1f} "
                  f"{decode / steps * 1e3:>7.2f}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
