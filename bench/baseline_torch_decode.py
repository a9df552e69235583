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
then the paged absorbed prefill shapes (EXTEND over a cached prefix):
  TORCH paged-prefill explicit|sdpa b=16 prefix=4096 extend=512 H=128 P=64 t_us=... tflops=...
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


def paged_prefill_fns(cache, block_table, q, b, ext, H, K, scale):
    """EXTEND over a cached prefix: request i's ext tokens (q [b, ext, H, 576]) see the
    K - ext prefix keys and the new ones up to their own (bottom-right causal). Two
    baselines: the explicit gather + matmuls + softmax, one request at a time (a
    [ext * H, K] fp32 score block per request), and SDPA over the gathered keys with K/V
    broadcast to every head (torch picks its backend; none of the fused ones takes 576)."""
    t = torch.arange(ext, device=q.device)
    j = torch.arange(K, device=q.device)
    mask = j[None, :] > (K - ext + t)[:, None]  # [ext, K], True = hidden

    def explicit():
        outs = []
        for i in range(b):
            kv = cache[block_table[i]].view(K, 576)
            s = (q[i].view(ext * H, 576) @ kv.t()).float() * scale
            s = s.view(ext, H, K).masked_fill_(mask[:, None, :], float("-inf"))
            p = torch.softmax(s, dim=-1).to(torch.bfloat16).view(ext * H, K)
            outs.append(p @ kv[:, :512])
        return outs

    def sdpa():
        kv = cache[block_table].view(b, 1, K, 576)
        qh = q.permute(0, 2, 1, 3)  # [b, H, ext, 576]
        return torch.nn.functional.scaled_dot_product_attention(
            qh, kv.expand(b, H, K, 576), kv[..., :512].expand(b, H, K, 512),
            attn_mask=~mask, scale=scale)

    return explicit, sdpa


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

    # Paged absorbed prefill (EXTEND over a cached prefix), the shapes of `mla bench
    # --device cuda`: b x (prefix + extend), H=128, page 64. FLOPs counted once over the
    # visible pairs, as there: 2 H 1088 b (ext * prefix + ext (ext + 1) / 2).
    H = 128
    for b, prefix, ext in ((16, 4096, 512), (1, 16384, 1024), (4, 8192, 256)):
        K = prefix + ext
        per = (K + P - 1) // P
        num_pages = b * per + 1
        cache = (torch.rand(num_pages, P, 576, device=dev, dtype=torch.bfloat16) * 2 - 1)
        block_table = (torch.randperm(num_pages - 1, device=dev)[: b * per] + 1).view(b, per)
        q = torch.rand(b, ext, H, 576, device=dev, dtype=torch.bfloat16) * 2 - 1
        flop = 2.0 * H * 1088 * b * (ext * prefix + ext * (ext + 1) / 2)
        for name, fn in zip(("explicit", "sdpa"), paged_prefill_fns(cache, block_table, q, b, ext, H,
                                                                      K, scale)):
            try:
                ms = timed(fn, max(3, args.runs // 4), flush)
                print(f"TORCH paged-prefill {name} b={b} prefix={prefix} extend={ext} H={H} P={P} "
                      f"t_us={ms * 1e3:.1f} tflops={flop / (ms * 1e-3) * 1e-12:.1f}", flush=True)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                print(f"TORCH paged-prefill {name} b={b} prefix={prefix} extend={ext}: refused "
                      f"({str(e).splitlines()[0][:120]})", flush=True)
            torch.cuda.empty_cache()
        del cache, block_table, q
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
