/* Status names, version, last-error recording. */
#include <stdio.h>

#include "internal.h"

const char *mla_status_string(mla_status s) {
  switch (s) {
    case MLA_OK: return "MLA_OK";
    case MLA_ERR_INVALID_ARGUMENT: return "MLA_ERR_INVALID_ARGUMENT";
    case MLA_ERR_OUT_OF_RANGE: return "MLA_ERR_OUT_OF_RANGE";
    case MLA_ERR_UNSUPPORTED: return "MLA_ERR_UNSUPPORTED";
    case MLA_ERR_OUT_OF_MEMORY: return "MLA_ERR_OUT_OF_MEMORY";
    case MLA_ERR_CACHE_FULL: return "MLA_ERR_CACHE_FULL";
    case MLA_ERR_WORKSPACE_TOO_SMALL: return "MLA_ERR_WORKSPACE_TOO_SMALL";
    case MLA_ERR_CAPACITY: return "MLA_ERR_CAPACITY";
    case MLA_ERR_BAD_STATE: return "MLA_ERR_BAD_STATE";
    case MLA_ERR_DEVICE: return "MLA_ERR_DEVICE";
    case MLA_ERR_INTERNAL: return "MLA_ERR_INTERNAL";
  }
  return "MLA_ERR_UNKNOWN";
}

#define MLA_STR2(x) #x
#define MLA_STR(x) MLA_STR2(x)

unsigned mla_version(void) { return MLA_VERSION_NUMBER; }

const char *mla_version_string(void) {
  return MLA_STR(MLA_VERSION_MAJOR) "." MLA_STR(MLA_VERSION_MINOR) "." MLA_STR(MLA_VERSION_PATCH);
}

mla_status mla_fail(mla_errbuf *eb, mla_status st, const char *fn, const char *fmt, ...) {
  if (!eb) return st;
  int n = snprintf(eb->msg, sizeof eb->msg, "%s: ", fn ? fn : "mla");
  if (n < 0 || (size_t)n >= sizeof eb->msg) return st;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(eb->msg + n, sizeof eb->msg - (size_t)n, fmt, ap);
  va_end(ap);
  return st;
}
