/* Bump allocator over a caller-owned workspace. */
#include "internal.h"

void *mla_ws_take(mla_ws *w, size_t bytes) {
  size_t off = (w->used + (MLA_WS_ALIGN - 1)) & ~(size_t)(MLA_WS_ALIGN - 1);
  w->used = off + bytes;
  if (!w->base) return NULL;
  /* Align the base up once; mla_ws_total() reserves MLA_WS_ALIGN for this. */
  uintptr_t b = ((uintptr_t)w->base + (MLA_WS_ALIGN - 1)) & ~(uintptr_t)(MLA_WS_ALIGN - 1);
  size_t pad = (size_t)(b - (uintptr_t)w->base);
  if (pad + w->used > w->cap) {
    w->overflow = 1;
    return NULL;
  }
  return (void *)(b + off);
}
