#!/usr/bin/env python3
"""Causal ragged MHA prefill (192/128, H = 128, bf16): libmla against torch's
scaled_dot_product_attention backends, interleaved call by call in one process.

Why interleaved: at this load the H200 runs at its 700 W cap and its clock moves
with temperature by several percent within a run, so two libraries timed one
after the other (each its own median of 20) can differ by the GPU's state rather
than by their kernels. Here every round times each contestant once, in a rotating
order, and the report gives each one's median and the median over rounds of the
per-round ratio to libmla (both calls of a round see nearly the same clock).

Timing rule (as `mla bench` and dev/cuda/prefill/torch_sdpa.py): CUDA events
around the one call, the L2 flushed (a 256 MB memset) before it; a spin kernel
before the flush keeps the GPU busy while Python prepares the call, so host
overhead never shows in the event time. TFLOP/s with causal FLOPs counted once:
2 H (192 + 128) n (n + 1) / 2 per sequence.

Contestants: libmla (its workspace: the dynamic item order), libmla-static (no
workspace: the fixed snake order), and the torch kernels given by --torch
(default cudnn,efficient,flex: the SDPA backends that accept 192/128 (flash
refuses it) and torch.compile'd flex_attention with a causal block mask). torch
gets its dense [B, H, N, D] layout (contiguous copies of the same values, made
outside the timing); libmla its ragged [T, H, D] one. Neither computes an LSE.

Usage: PYTHONPATH=python python3 bench/prefill_vs_torch.py [--runs 30]
       [--torch cudnn,efficient,flex] [--shapes 1x8192,1x16384,16x1024]
       [--also NAME:VAR=VALUE]... (a libmla variant selected by an environment variable,
       e.g. --also pp:MLA_PREFILL_VARIANT=overlap232-tma-pp)
"""
import argparse
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import libmla

H, DQK, DV = 128, 192, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION}


def sm_clock():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def contestants(ctx, b, n, torch_names, extra):
    """(name, callable) pairs on the same values."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + n)
    T = b * n
    q = torch.randn(T, H, DQK, generator=gen, device="cuda").bfloat16()
    k = torch.randn(T, H, DQK, generator=gen, device="cuda").bfloat16()
    v = torch.randn(T, H, DV, generator=gen, device="cuda").bfloat16()
    ind = torch.arange(0, T + 1, n, dtype=torch.int32, device="cuda")
    out = torch.empty(T, H, DV, dtype=torch.bfloat16, device="cuda")
    ws = torch.zeros(libmla.ragged_workspace_size(ctx), dtype=torch.uint8, device="cuda")
    scale = DQK ** -0.5
    # torch's layout: [B, H, N, D], contiguous
    qt = q.view(b, n, H, DQK).transpose(1, 2).contiguous()
    kt = k.view(b, n, H, DQK).transpose(1, 2).contiguous()
    vt = v.view(b, n, H, DV).transpose(1, 2).contiguous()

    def ours(workspace):
        return lambda: libmla.attention_ragged(ctx, q, k, v, ind, ind, scale=scale, causal=True,
                                               out=out, workspace=workspace)

    def sdpa(be):
        def call():
            with sdpa_kernel([be]):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
        return call


    def flex():
        # torch.compile'd flex_attention with a causal block mask (built once, outside the timing)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        bm = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, B=None, H=None, Q_LEN=n, KV_LEN=n,
                               device="cuda")
        fa = torch.compile(flex_attention, dynamic=False)
        return lambda: fa(qt, kt, vt, block_mask=bm, scale=scale)

    def ours_env(var, value):
        # libmla with one environment variable set for its calls only (the library reads its
        # MLA_PREFILL_* tuning variables at every launch): a variant timed in the same rounds
        def call():
            old = os.environ.get(var)
            os.environ[var] = value
            try:
                ours(ws)()
            finally:
                if old is None:
                    del os.environ[var]
                else:
                    os.environ[var] = old
        return call

    c = [("libmla", ours(ws)), ("libmla-static", ours(None))]
    for name, var, value in extra:
        c.append(("libmla-" + name, ours_env(var, value)))
    # a first call of each, and a check that every contestant computes the same thing
    ours(ws)()
    ref = out.clone()
    ours(None)()
    torch.cuda.synchronize()
    same = torch.equal(out, ref)
    for name in torch_names:
        try:
            call = flex() if name == "flex" else sdpa(BACKENDS[name])
            o = call()
            if o is None:  # (the SDPA wrapper returns nothing: one call for the check)
                with sdpa_kernel([BACKENDS[name]]):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
            torch.cuda.synchronize()
            err = (o.transpose(1, 2).reshape(T, H, DV).float() - ref.float()).abs().max().item()
            print(f"  torch-{name}: max |diff| to libmla {err:.3g}")
            c.append(("torch-" + name, call))
        except Exception as ex:  # a backend that refuses the shape (or flex failing to compile)
            print(f"  torch-{name}: refused ({type(ex).__name__}: {str(ex).splitlines()[0][:100] if str(ex) else ''})")
    return c, same


def run_shape(ctx, b, n, runs, torch_names, extra):
    flops = 2.0 * H * (DQK + DV) * b * n * (n + 1) / 2
    print(f"\n## {b} x {n}, H={H}, 192/128, bf16, causal ({flops / 1e12:.3f} TFLOP)")
    c, same = contestants(ctx, b, n, torch_names, extra)
    print(f"  libmla dynamic and static orders give the same bits: {same}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in c]
    ms = {name: [] for name, _ in c}
    warm = 3
    for r in range(warm + runs):
        order = list(range(len(c)))
        rot = r % len(c)
        order = order[rot:] + order[:rot]
        if (r // len(c)) & 1:
            order.reverse()
        for i in order:
            torch.cuda._sleep(2_000_000)  # ~1 ms: the GPU stays busy while the host prepares the call
            flush.zero_()
            ev[i][0].record()
            c[i][1]()
            ev[i][1].record()
        torch.cuda.synchronize()
        if r >= warm:
            for i, (name, _) in enumerate(c):
                ms[name].append(ev[i][0].elapsed_time(ev[i][1]))
    base = ms["libmla"]
    print(f"  {'contestant':16s} {'median us':>10s} {'min us':>9s} {'TFLOP/s':>8s} {'vs libmla (median of per-round ratios)':>40s}")
    rows = []
    for name, _ in c:
        t = ms[name]
        med = statistics.median(t)
        ratio = statistics.median([x / y for x, y in zip(t, base)])
        tf = flops / (med * 1e-3) / 1e12
        rows.append((name, med, tf, ratio))
        print(f"  {name:16s} {med * 1e3:10.1f} {min(t) * 1e3:9.1f} {tf:8.1f} {ratio:14.4f}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--torch", default="cudnn,efficient,flex")
    ap.add_argument("--shapes", default="1x8192,1x16384,16x1024")
    ap.add_argument("--also", action="append", default=[], metavar="NAME:VAR=VALUE",
                    help="one more libmla contestant, with VAR=VALUE in the environment for its calls")
    o = ap.parse_args()
    extra = []
    for a in o.also:
        name, _, kv = a.partition(":")
        var, _, value = kv.partition("=")
        if not name or not var:
            print(f"--also {a!r}: expected NAME:VAR=VALUE")
            return 2
        extra.append((name, var, value))
    names = [x for x in o.torch.split(",") if x]
    for x in names:
        if x not in BACKENDS and x != "flex":
            print(f"unknown torch backend {x!r} (cudnn, efficient, flash, flex)")
            return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in o.shapes.split(",")]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, libmla {libmla.library_version}")
    print(f"nvidia-smi (sm clock, power, temperature) at start: {sm_clock()}")
    ctx = libmla.Context("cuda")
    summary = []
    for b, n in shapes:
        rows = run_shape(ctx, b, n, o.runs, names, extra)
        summary.append(((b, n), rows))
        print(f"  nvidia-smi after: {sm_clock()}")
    print("\n# summary: shape | contestant median us (TFLOP/s) | best torch / libmla (per-round median ratio)")
    for (b, n), rows in summary:
        cells = " | ".join(f"{name} {med * 1e3:.1f} ({tf:.1f})" for name, med, tf, _ in rows)
        tor = [r for r in rows if r[0].startswith("torch-")]
        best = min(tor, key=lambda r: r[3])[3] if tor else float("nan")
        print(f"{b}x{n} | {cells} | speedup vs best torch {best:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
