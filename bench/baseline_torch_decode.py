#!/usr/bin/env python3
"""Torch baseline for absorbed-MLA decode over a paged latent cache, timed
the way dev/cuda/decode_harness times the kernels (CUDA events, a 256 MB
L2-flushing write before each run, median of the runs).

The baseline is what a serving engine without a fused kernel would do:
gather the pages (block table -> contiguous [b, s_k, 576]), S = Q K^T
(bf16 matmul, fp32 accumulate), causal mask for s_q > 1, softmax in fp32,
O = P V with V the first 512 columns of the same rows.

Also measures, in the same process, the device's bf16 matmul rate
(8192^3, random data) and its device-to-device copy bandwidth.

Prints one line per shape:
  TORCH b=128 sq=1 H=128 sk=8192 P=64 t_us=... tflops=... gbs=...
"""
import argparse
import statistics

import torch


def timed(fn, runs, flush):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    stop = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for i in range(runs):
        flush.fill_(i & 0xFF)
        start[i].record()
        fn()
        stop[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, stop))  # ms


def decode_fn(cache, block_table, q, b, sq, H, sk, scale):
    P = cache.shape[1]
    causal = None
    if sq > 1:
        # Row (t, h) sees keys j <= sk - sq + t (bottom-right causal).
        t = torch.arange(sq, device=q.device).repeat_interleave(H)
        j = torch.arange(sk, device=q.device)
        causal = j[None, :] > (sk - sq + t)[:, None]

    def run():
        kv = cache[block_table].view(b, sk, 576)  # gather
        qf = q.view(b, sq * H, 576)
        s = torch.bmm(qf, kv.transpose(1, 2)).float() * scale
        if causal is not None:
            s.masked_fill_(causal, float("-inf"))
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        return torch.bmm(p, kv[:, :, :512])

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="only s_k = 8192")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(20261130)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)

    # Device ceilings in the same run.
    a = torch.rand(8192, 8192, device=dev, dtype=torch.bfloat16) * 2 - 1
    bm = torch.rand(8192, 8192, device=dev, dtype=torch.bfloat16) * 2 - 1
    ms = timed(lambda: torch.mm(a, bm), 10, flush)
    print(f"MATMUL bf16 8192^3 random: {2 * 8192**3 / (ms * 1e-3) * 1e-12:.0f} TFLOP/s ({ms:.3f} ms median)", flush=True)
    del a, bm
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 10, flush)
    print(f"COPY torch d2d 1 GiB: {2 * (1 << 30) / (ms * 1e-3) * 1e-9:.0f} GB/s (read + write)", flush=True)
    del src, dst

    b, P, scale = 128, 64, 0.0722
    sks = [8192] if args.quick else [4096, 8192, 16384]
    for sk in sks:
        num_pages = b * sk // P + 1
        cache = (torch.rand(num_pages, P, 576, device=dev, dtype=torch.bfloat16) * 2 - 1)
        perm = torch.randperm(num_pages - 1, device=dev)[: b * sk // P] + 1
        block_table = perm.view(b, sk // P)
        for H in (16, 128):
            for sq in (1, 2):
                q = torch.rand(b, sq, H, 576, device=dev, dtype=torch.bfloat16) * 2 - 1
                fn = decode_fn(cache, block_table, q, b, sq, H, sk, scale)
                ms = timed(fn, args.runs, flush)
                s = ms * 1e-3
                flop = 2.0 * b * sq * H * sk * 1088
                byts = b * sk * 1152 + b * sq * H * 576 * 2 + b * sq * H * 512 * 2
                print(f"TORCH b={b} sq={sq} H={H} sk={sk} P={P} t_us={ms * 1e3:.1f} "
                      f"tflops={flop / s * 1e-12:.1f} gbs={byts / s * 1e-9:.0f}", flush=True)
                del q, fn
                torch.cuda.empty_cache()
        del cache, block_table, perm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
