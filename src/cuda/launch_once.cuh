// Host-side state the CUDA launchers keep across calls (decode_sm90.cu,
// prefill_sm90.cu): per-device facts found once, so that a launch does no
// attribute query or set on the hot path.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

// Per-device facts as bits of a mask (device ordinals 0..63; a larger
// ordinal is checked on every call). A bit is set only after the fact was
// established on that device, with release ordering: a thread that sees it
// set may skip the work; two threads racing both do it (it is idempotent),
// so no lock is needed.
constexpr int kMaskDevices = 64;

static inline bool device_bit_set(const uint64_t *mask, int dev) {
  return dev >= 0 && dev < kMaskDevices && ((__atomic_load_n(mask, __ATOMIC_ACQUIRE) >> dev) & 1u);
}
static inline void device_bit_mark(uint64_t *mask, int dev) {
  if (dev >= 0 && dev < kMaskDevices) __atomic_fetch_or(mask, (uint64_t)1 << dev, __ATOMIC_RELEASE);
}

// Opts a kernel into its dynamic shared memory once per device: the
// attribute belongs to the function as loaded on the current device, so a
// process-wide "done" flag would be wrong with several devices.
template <typename Kernel>
cudaError_t set_smem_once(Kernel kernel, int bytes, uint64_t *done) {
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (device_bit_set(done, dev)) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  device_bit_mark(done, dev);
  return cudaSuccess;
}

// Whether the build holds sm_90a code for the current device (without it the
// kernel bodies are compiled out and the functions report an older binary
// version), found once per device through `probe`, any kernel of the file.
template <typename Kernel>
cudaError_t check_sm90_once(Kernel probe, uint64_t *ok) {
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (device_bit_set(ok, dev)) return cudaSuccess;
  cudaFuncAttributes fa;
  e = cudaFuncGetAttributes(&fa, probe);
  if (e != cudaSuccess) return e;
  if (fa.binaryVersion < 90) return cudaErrorNotSupported;
  device_bit_mark(ok, dev);
  return cudaSuccess;
}
