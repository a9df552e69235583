#!/usr/bin/env python3
"""Prints the m64n128k16 wgmma wrappers of the prefill kernel (pasted into
src/cuda/prefill_sm90.cu): S = Q K^T with both operands from shared memory
(K-major), and O += P V with P from registers and V MN-major (trans-b)."""

def regs(n):
    return ", ".join("%%%d" % i for i in range(n))

def outs(n):
    return ", ".join('"+f"(d[%d])' % i for i in range(n))

N = 128
NR = N // 2
for ty, tn in (("bf16", "bf16"), ("f16", "f16")):
    # SS: A, B descriptors, scale-d predicate
    print("// D[64x%d] (+)= A[64x16] (smem, K-major) * B[16x%d] (smem, K-major), %s." % (N, N, ty))
    print("static __device__ __forceinline__ void wgmma_ss_%s(float (&d)[%d], uint64_t da, uint64_t db, int accum) {" % (tn, NR))
    print('  asm volatile(')
    print('      "{\\n.reg .pred p;\\nsetp.ne.b32 p, %%%d, 0;\\n"' % (NR + 2))
    print('      "wgmma.mma_async.sync.aligned.m64n%dk16.f32.%s.%s {%s}, %%%d, %%%d, p, 1, 1, 0, 0;\\n}\\n"' % (N, ty, ty, regs(NR), NR, NR + 1))
    print('      : %s' % outs(NR))
    print('      : "l"(da), "l"(db), "r"(accum));')
    print("}")
    print("// D[64x%d] (+)= A[64x16] (registers) * B[16x%d] (smem, MN-major), %s." % (N, N, ty))
    print("static __device__ __forceinline__ void wgmma_rs_%s(float (&d)[%d], const uint32_t (&a)[4], uint64_t db, int accum) {" % (tn, NR))
    print('  asm volatile(')
    print('      "{\\n.reg .pred p;\\nsetp.ne.b32 p, %%%d, 0;\\n"' % (NR + 5))
    print('      "wgmma.mma_async.sync.aligned.m64n%dk16.f32.%s.%s {%s}, {%%%d, %%%d, %%%d, %%%d}, %%%d, p, 1, 1, 1;\\n}\\n"' % (N, ty, ty, regs(NR), NR, NR + 1, NR + 2, NR + 3, NR + 4))
    print('      : %s' % outs(NR))
    print('      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accum));')
    print("}")
