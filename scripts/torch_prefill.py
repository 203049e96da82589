"""The prefill reference: a plain PyTorch forward of the Llama-3-8B shape on
the same GPU, what `kiln bench --prompt-tokens N --gen-tokens 2` is held
against. Random bf16 weights; per layer F.rms_norm, one cuBLAS `x @ W.T` for
stacked q/k/v, RoPE, F.scaled_dot_product_attention(is_causal=True,
enable_gqa=True), o, stacked gate/up, SiLU-and-multiply, down; the head on
each prompt's last token. CUDA-event timed, median of 5 after two warm-ups.
Prints prompt tokens/s per (prompts x tokens) shape.

    python3 scripts/torch_prefill.py --shapes 1x1024,8x1024,32x1024,1x4096
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 4096, 32, 32, 8, 14336, 128256
HD = HIDDEN // HEADS
THETA, EPS = 500000.0, 1e-5


def weights(dev):
    g = torch.Generator(device=dev).manual_seed(0)

    def w(rows, cols):
        return (torch.rand(rows, cols, device=dev, generator=g, dtype=torch.bfloat16) - 0.5) * 0.07

    layers = [
        {
            "qkv": w((HEADS + 2 * KV_HEADS) * HD, HIDDEN),
            "o": w(HIDDEN, HEADS * HD),
            "gate_up": w(2 * FFN, HIDDEN),
            "down": w(HIDDEN, FFN),
            "n1": torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16),
            "n2": torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16),
        }
        for _ in range(LAYERS)
    ]
    return w(VOCAB, HIDDEN), layers, torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.inference_mode()
def forward(embed, layers, norm, ids, cos, sin):
    b, t = ids.shape
    x = embed[ids]
    for L in layers:
        h = F.rms_norm(x, (HIDDEN,), L["n1"], EPS)
        qkv = h @ L["qkv"].T
        q, k, v = qkv.split([HEADS * HD, KV_HEADS * HD, KV_HEADS * HD], dim=-1)
        q = rope(q.view(b, t, HEADS, HD).transpose(1, 2), cos, sin)
        k = rope(k.view(b, t, KV_HEADS, HD).transpose(1, 2), cos, sin)
        v = v.view(b, t, KV_HEADS, HD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + a.transpose(1, 2).reshape(b, t, HIDDEN) @ L["o"].T
        h = F.rms_norm(x, (HIDDEN,), L["n2"], EPS)
        gate, up = (h @ L["gate_up"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ L["down"].T
    last = F.rms_norm(x[:, -1], (HIDDEN,), norm, EPS)
    return last @ embed.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x1024,8x1024,32x1024,1x4096")
    args = ap.parse_args()
    dev = torch.device("cuda")
    embed, layers, norm = weights(dev)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: prefill, Llama-3-8B shape, bf16")
    print(f"{'shape':>8} {'ms':>9} {'prompt t/s':>11}")
    for shape in args.shapes.split(","):
        b, t = (int(n) for n in shape.split("x"))
        ids = torch.randint(0, VOCAB, (b, t), device=dev)
        pos = torch.arange(t, device=dev, dtype=torch.float32)
        inv = THETA ** (-torch.arange(0, HD, 2, device=dev, dtype=torch.float32) / HD)
        ang = torch.outer(pos, inv)
        cos = torch.cat((ang.cos(), ang.cos()), dim=-1).to(torch.bfloat16)
        sin = torch.cat((ang.sin(), ang.sin()), dim=-1).to(torch.bfloat16)
        times = []
        for i in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward(embed, layers, norm, ids, cos, sin)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        print(f"{shape:>8} {ms:9.2f} {b * t / ms * 1e3:11.0f}")


if __name__ == "__main__":
    main()
