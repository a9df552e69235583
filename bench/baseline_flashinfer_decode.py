#!/usr/bin/env python3
"""FlashInfer baseline for absorbed-MLA decode over a paged latent cache:
flashinfer.mla.BatchMLAPagedAttentionWrapper (its sm90 "fa3" backend unless
--backend says otherwise), timed like bench/baseline_torch_decode.py and
`mla bench --device cuda` (CUDA events, a 256 MB L2-flushing write before
each run, median of the runs). plan() runs once per shape, outside the timing.

FlashInfer is not a dependency of libmla: on the device it comes from
carried wheels (flashinfer-python, apache-tvm-ffi) and JIT-compiles its
kernels on first use (minutes; FLASHINFER_WORKSPACE_BASE picks the cache).

The cache is one [pages, P, 576] tensor, as libmla keeps it; FlashInfer gets
its latent and rope parts as strided views (no copy). Pages are shuffled.

Prints one line per shape:
  FLASHINFER b=128 sq=1 H=128 sk=8192 P=64 t_us=... tflops=... gbs=...
and, with --check, the max abs error against a float32 torch reference on
the first request.
"""
import argparse

import torch

from baseline_torch_decode import timed  # (same directory) the shared timing: flush, events, median


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--backend", default="fa3")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shapes", default="128,16,1,8192;128,128,1,8192;128,128,2,4096;64,16,1,4096;1,16,1,32768",
                    help="b,H,s_q,s_k;... (page 64, bf16)")
    args = ap.parse_args()
    import flashinfer

    dev = torch.device("cuda")
    P = 64
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ws = torch.empty(128 << 20, dtype=torch.int8, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    for shape in args.shapes.split(";"):
        b, H, sq, sk = (int(x) for x in shape.split(","))
        pages_per = (sk + P - 1) // P
        npages = b * pages_per
        cache = torch.randn(npages, P, 576, device=dev, dtype=torch.bfloat16, generator=gen)
        perm = torch.randperm(npages, device=dev, generator=gen).to(torch.int32)
        q = torch.randn(b * sq, H, 576, device=dev, dtype=torch.bfloat16, generator=gen)
        q_nope, q_pe = q[:, :, :512], q[:, :, 512:]
        ckv, kpe = cache[:, :, :512], cache[:, :, 512:]
        scale = 1.0 / (192 ** 0.5)
        qo_indptr = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * sq
        kv_indptr = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * pages_per
        kv_lens = torch.full((b,), sk, device=dev, dtype=torch.int32)
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=args.backend)
        w.plan(qo_indptr, kv_indptr, perm, kv_lens, H, 512, 64, P, sq > 1, scale, torch.bfloat16, torch.bfloat16)
        out = torch.empty(b * sq, H, 512, device=dev, dtype=torch.bfloat16)

        def run():
            w.run(q_nope, q_pe, ckv, kpe, out=out)

        views = "views"
        try:
            run()
        except Exception as e:  # strided views refused: separate contiguous tensors (the same bytes)
            print(f"# strided cache views refused ({str(e).splitlines()[0][:120]}); contiguous copies", flush=True)
            ckv, kpe, views = ckv.contiguous(), kpe.contiguous(), "copies"
        ms = timed(run, args.runs, flush)
        t = ms * 1e-3
        flops = 2.0 * b * sq * H * sk * (576 + 512)
        nbytes = b * sk * 576 * 2 + b * sq * H * (576 + 512) * 2
        line = (f"FLASHINFER b={b} sq={sq} H={H} sk={sk} P={P} t_us={ms * 1e3:.1f} "
                f"tflops={flops / t / 1e12:.1f} gbs={nbytes / t / 1e9:.0f} cache={views}")
        if args.check:
            kv = cache[perm[:pages_per].long()].reshape(-1, 576)[:sk].float()
            qf = q[:sq].float().reshape(sq * H, 576)
            s = qf @ kv.t() * scale
            if sq > 1:
                tt = torch.arange(sq, device=dev).repeat_interleave(H)
                j = torch.arange(sk, device=dev)
                s.masked_fill_(j[None, :] > (sk - sq + tt)[:, None], float("-inf"))
            ref = torch.softmax(s, dim=-1) @ kv[:, :512]
            err = (out[:sq].float().reshape(sq * H, 512) - ref).abs().max().item()
            line += f" max_abs_err={err:.3g}"
        print(line, flush=True)
        del cache, w


if __name__ == "__main__":
    main()
