#!/usr/bin/env python3
"""Baseline for dev/cuda/prefill/bench: torch scaled_dot_product_attention,
causal, q/k 192 wide and v 128 wide, bf16, H = 128, on the shapes of the
benchmark (one 8K sequence, one 16K sequence, a batch of 16 x 1K; dense
[B, H, N, D] tensors), with every backend that accepts the shape. Same
timing rule: CUDA events around each call, L2 flushed before it, median of
the runs; TFLOP/s with causal FLOPs counted once. Arguments: backend names
to run (cudnn, efficient, flash; default all)."""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, DQK, DV, RUNS = 128, 192, 128, 20
shapes = [(1, 8192), (1, 16384), (16, 1024)]


def bench(backend, name, b, n):
    q = torch.randn(b, H, n, DQK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, H, n, DQK, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, H, n, DV, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    try:
        with sdpa_kernel([backend]):
            for r in range(RUNS + 3):
                flush.zero_()
                e0.record()
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DQK ** -0.5)
                e1.record()
                torch.cuda.synchronize()
                if r >= 3:
                    ms.append(e0.elapsed_time(e1))
    except RuntimeError as ex:
        print(f"torch {name:9s} bs={b} len={n}: refused ({str(ex).splitlines()[0][:80]})")
        return
    ms.sort()
    med = ms[len(ms) // 2]
    flops = 2.0 * n * (n + 1) / 2 * (DQK + DV) * H * b
    print(f"torch {name:9s} causal=1 bs={b} len={n} H={H} 192/128 bf16: median {med:.3f} ms "
          f"(min {ms[0]:.3f}) {flops / (med * 1e-3) / 1e12:.1f} TFLOP/s")


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    backends = [(SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.EFFICIENT_ATTENTION, "efficient"),
                (SDPBackend.FLASH_ATTENTION, "flash")]
    if len(sys.argv) > 1:  # a subset by name, e.g. "cudnn"
        backends = [b for b in backends if b[1] in sys.argv[1:]]
    for b, n in shapes:
        for be, name in backends:
            bench(be, name, b, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
