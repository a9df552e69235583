/* Loader of the golden cases (tests/golden/<case>/meta.txt + raw tensors).
 * Byte order is decoded by hand so the files read the same on any host. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

#define REF_LINE 4096

static int golden_fail(ref_golden *g, const char *dir, const char *what) {
  fprintf(stderr, "ref_golden_load(%s): %s\n", dir, what);
  ref_golden_free(g);
  return -1;
}

/* Parse the rest of the line being tokenized ("q_len 1 2 3"): the count, or
 * -1 on a malformed or too long list. */
static int parse_int_list(int *dst, int cap) {
  int n = 0;
  for (char *tok = strtok(NULL, " \t\r\n"); tok; tok = strtok(NULL, " \t\r\n")) {
    char *end;
    errno = 0;
    long v = strtol(tok, &end, 10);
    if (*end != '\0' || errno || v < 0 || v > INT32_MAX || n >= cap) return -1;
    dst[n++] = (int)v;
  }
  return n;
}

static int parse_int(const char *tok, int *dst) {
  if (!tok) return -1;
  char *end;
  errno = 0;
  long v = strtol(tok, &end, 10);
  if (*end != '\0' || errno || v < INT32_MIN || v > INT32_MAX) return -1;
  *dst = (int)v;
  return 0;
}

static int parse_double(const char *tok, double *dst) {
  if (!tok) return -1;
  char *end;
  errno = 0;
  double v = strtod(tok, &end);
  if (*end != '\0' || errno) return -1;
  *dst = v;
  return 0;
}

/* Read NAME.f32 / NAME.f64 into t->data (double). */
static int load_tensor(const char *dir, ref_tensor *t, int is_f64) {
  char path[1024];
  int len = snprintf(path, sizeof(path), "%s/%s.%s", dir, t->name, is_f64 ? "f64" : "f32");
  if (len < 0 || (size_t)len >= sizeof(path)) {
    fprintf(stderr, "ref_golden_load: path too long for tensor %s\n", t->name);
    return -1;
  }
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "ref_golden_load: cannot open %s\n", path);
    return -1;
  }
  const size_t es = is_f64 ? 8 : 4;
  const size_t numel = (size_t)t->numel;
  unsigned char *raw = malloc(numel * es + 1);
  t->data = malloc(sizeof(double) * (numel ? numel : 1));
  if (!raw || !t->data) {
    free(raw);
    fclose(f);
    fprintf(stderr, "ref_golden_load: out of memory for %s\n", path);
    return -1;
  }
  /* Ask for one byte more than expected to detect a file that is too long. */
  size_t got = fread(raw, 1, numel * es + 1, f);
  fclose(f);
  if (got != numel * es) {
    free(raw);
    fprintf(stderr, "ref_golden_load: %s has %zu%s bytes, expected %zu\n", path, got,
            got > numel * es ? "+" : "", numel * es);
    return -1;
  }
  for (size_t i = 0; i < numel; i++) {
    const unsigned char *b = raw + i * es;
    if (is_f64) {
      uint64_t u = 0;
      for (int k = 7; k >= 0; k--) u = (u << 8) | b[k];
      double d;
      memcpy(&d, &u, sizeof(d));
      t->data[i] = d;
    } else {
      uint32_t u = 0;
      for (int k = 3; k >= 0; k--) u = (u << 8) | b[k];
      float x;
      memcpy(&x, &u, sizeof(x));
      t->data[i] = (double)x;
    }
  }
  free(raw);
  return 0;
}

int ref_golden_load(const char *dir, ref_golden *g) {
  memset(g, 0, sizeof(*g));
  if (!dir) return golden_fail(g, "(null)", "dir is NULL");
  char path[1024];
  int plen = snprintf(path, sizeof(path), "%s/meta.txt", dir);
  if (plen < 0 || (size_t)plen >= sizeof(path)) return golden_fail(g, dir, "path too long");
  FILE *f = fopen(path, "r");
  if (!f) return golden_fail(g, dir, "cannot open meta.txt");

  char line[REF_LINE];
  char bad[REF_LINE + 64];
  int nq = -1, nk = -1, lineno = 0;
  int is_f64[16];
  while (fgets(line, sizeof(line), f)) {
    lineno++;
    char *key = strtok(line, " \t\r\n");
    if (!key || key[0] == '#') continue; /* blank line or comment */
    int err = 0;
    if (!strcmp(key, "kind")) {
      char *v = strtok(NULL, " \t\r\n");
      if (!v || strlen(v) >= sizeof(g->kind)) err = 1;
      else strcpy(g->kind, v);
    } else if (!strcmp(key, "batch")) err = parse_int(strtok(NULL, " \t\r\n"), &g->batch);
    else if (!strcmp(key, "heads")) err = parse_int(strtok(NULL, " \t\r\n"), &g->heads);
    else if (!strcmp(key, "latent")) err = parse_int(strtok(NULL, " \t\r\n"), &g->latent);
    else if (!strcmp(key, "rope")) err = parse_int(strtok(NULL, " \t\r\n"), &g->rope);
    else if (!strcmp(key, "qk_dim")) err = parse_int(strtok(NULL, " \t\r\n"), &g->qk_dim);
    else if (!strcmp(key, "v_dim")) err = parse_int(strtok(NULL, " \t\r\n"), &g->v_dim);
    else if (!strcmp(key, "causal")) err = parse_int(strtok(NULL, " \t\r\n"), &g->causal);
    else if (!strcmp(key, "tokens")) err = parse_int(strtok(NULL, " \t\r\n"), &g->tokens);
    else if (!strcmp(key, "dim")) err = parse_int(strtok(NULL, " \t\r\n"), &g->dim);
    else if (!strcmp(key, "scale")) err = parse_double(strtok(NULL, " \t\r\n"), &g->scale);
    else if (!strcmp(key, "softcap")) err = parse_double(strtok(NULL, " \t\r\n"), &g->softcap);
    else if (!strcmp(key, "q_len")) {
      nq = parse_int_list(g->q_len, 256);
      err = nq < 0;
    } else if (!strcmp(key, "kv_len")) {
      nk = parse_int_list(g->kv_len, 256);
      err = nk < 0;
    } else if (!strcmp(key, "tensor")) {
      char *name = strtok(NULL, " \t\r\n");
      char *type = strtok(NULL, " \t\r\n");
      if (g->num_tensors >= 16 || !name || !type || strlen(name) >= sizeof(g->tensors[0].name) ||
          (strcmp(type, "f32") && strcmp(type, "f64"))) {
        err = 1;
      } else {
        ref_tensor *t = &g->tensors[g->num_tensors];
        strcpy(t->name, name);
        t->numel = 1;
        for (char *tok = strtok(NULL, " \t\r\n"); tok; tok = strtok(NULL, " \t\r\n")) {
          int d;
          if (t->ndim >= 8 || parse_int(tok, &d) || d < 0) {
            err = 1;
            break;
          }
          t->dims[t->ndim++] = d;
          t->numel *= d;
        }
        if (!err && t->ndim == 0) err = 1;
        is_f64[g->num_tensors] = !strcmp(type, "f64");
        g->num_tensors++;
      }
    }
    /* Unknown keys are ignored so that newer cases still load. */
    if (err) {
      fclose(f);
      snprintf(bad, sizeof(bad), "meta.txt line %d: malformed '%s' entry", lineno, key);
      return golden_fail(g, dir, bad);
    }
  }
  fclose(f);

  if (!g->kind[0]) return golden_fail(g, dir, "meta.txt has no 'kind'");
  if (nq >= 0 || nk >= 0) {
    if (nq != g->batch || nk != g->batch)
      return golden_fail(g, dir, "q_len / kv_len counts differ from 'batch'");
  }
  for (int i = 0; i < g->num_tensors; i++) {
    if (load_tensor(dir, &g->tensors[i], is_f64[i])) return golden_fail(g, dir, "bad tensor");
  }
  return 0;
}

const ref_tensor *ref_golden_tensor(const ref_golden *g, const char *name) {
  for (int i = 0; i < g->num_tensors; i++)
    if (!strcmp(g->tensors[i].name, name)) return &g->tensors[i];
  return NULL;
}

void ref_golden_free(ref_golden *g) {
  for (int i = 0; i < g->num_tensors; i++) {
    free(g->tensors[i].data);
    g->tensors[i].data = NULL;
  }
  g->num_tensors = 0;
}
