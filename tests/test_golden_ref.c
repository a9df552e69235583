/* The float64 oracle against the golden cases computed outside the project
 * (numpy, float64): every case folder under the golden dir is run, so a new
 * case is picked up without touching this file. Tolerance: 1e-10 absolute +
 * 1e-10 relative, nonfinite positions exact. */
#define _POSIX_C_SOURCE 200809L /* opendir / readdir under -std=c11 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ref.h"
#include "test_util.h"

#define TOL 1e-10

static int cmp_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Tensor `name` with numel `want`, or NULL (with a failed check). */
static const ref_tensor *need(const ref_golden *g, const char *cas, const char *name, int64_t want) {
  const ref_tensor *t = ref_golden_tensor(g, name);
  TU_CHECK(t != NULL, "%s: tensor %s missing", cas, name);
  if (!t) return NULL;
  TU_CHECK(t->numel == want, "%s: tensor %s has %lld elements, expected %lld", cas, name,
           (long long)t->numel, (long long)want);
  return t->numel == want ? t : NULL;
}

static int64_t sum_len(const int *len, int n) {
  int64_t s = 0;
  for (int i = 0; i < n; i++) s += len[i];
  return s;
}

/* Run one case through the oracle; returns 1 when it was checked. */
static int run_case(const char *dir, const char *cas) {
  ref_golden g;
  if (ref_golden_load(dir, &g) != 0) {
    TU_CHECK(0, "%s: cannot load", cas);
    return 0;
  }
  const int64_t tq = sum_len(g.q_len, g.batch), tk = sum_len(g.kv_len, g.batch);
  int64_t rows = 0, dim = 0; /* output shape [rows, dim] and lse [rows] */
  double *o = NULL, *lse = NULL;
  const ref_tensor *o_ref = NULL, *lse_ref = NULL;
  int ok = 0;

  if (!strcmp(g.kind, "absorbed")) {
    TU_CHECK(g.latent == 512 && g.rope == 64, "%s: latent %d rope %d", cas, g.latent, g.rope);
    const int H = g.heads;
    rows = tq * H;
    dim = 512;
    const ref_tensor *qn = need(&g, cas, "q_nope", rows * 512), *qr = need(&g, cas, "q_rope", rows * 64);
    const ref_tensor *c = need(&g, cas, "c", tk * 512), *r = need(&g, cas, "r", tk * 64);
    o_ref = need(&g, cas, "o", rows * 512);
    lse_ref = need(&g, cas, "lse", rows);
    if (qn && qr && c && r && o_ref && lse_ref && g.latent == 512 && g.rope == 64) {
      o = malloc(sizeof(double) * (size_t)(rows * dim));
      lse = malloc(sizeof(double) * (size_t)rows);
      ref_absorbed(g.batch, g.q_len, g.kv_len, H, g.scale, g.causal, qn->data, qr->data, c->data,
                   r->data, o, lse);
      ok = 1;
    }
  } else if (!strcmp(g.kind, "mha")) {
    const int H = g.heads;
    rows = tq * H;
    dim = g.v_dim;
    const ref_tensor *k = ref_golden_tensor(&g, "k");
    /* kv heads are not in meta.txt: read them off k [Tk, Hkv, qk_dim]. */
    const int hkv = (k && k->ndim == 3) ? (int)k->dims[1] : H;
    TU_CHECK(hkv > 0 && H % hkv == 0, "%s: kv heads %d vs heads %d", cas, hkv, H);
    const ref_tensor *q = need(&g, cas, "q", rows * g.qk_dim);
    k = need(&g, cas, "k", tk * hkv * g.qk_dim);
    const ref_tensor *v = need(&g, cas, "v", tk * hkv * g.v_dim);
    o_ref = need(&g, cas, "o", rows * g.v_dim);
    lse_ref = need(&g, cas, "lse", rows);
    if (q && k && v && o_ref && lse_ref && hkv > 0 && H % hkv == 0) {
      o = malloc(sizeof(double) * (size_t)(rows * dim));
      lse = malloc(sizeof(double) * (size_t)rows);
      ref_mha(g.batch, g.q_len, g.kv_len, H, hkv, g.qk_dim, g.v_dim, g.scale, g.softcap,
              g.causal, q->data, k->data, v->data, o, lse);
      ok = 1;
    }
  } else if (!strcmp(g.kind, "merge")) {
    rows = (int64_t)g.tokens * g.heads;
    dim = g.dim;
    const ref_tensor *oa = need(&g, cas, "o_a", rows * dim), *ob = need(&g, cas, "o_b", rows * dim);
    const ref_tensor *la = need(&g, cas, "lse_a", rows), *lb = need(&g, cas, "lse_b", rows);
    o_ref = need(&g, cas, "o", rows * dim);
    lse_ref = need(&g, cas, "lse", rows);
    if (oa && ob && la && lb && o_ref && lse_ref) {
      const double *op[2] = {oa->data, ob->data};
      const double *lp[2] = {la->data, lb->data};
      o = malloc(sizeof(double) * (size_t)(rows * dim));
      lse = malloc(sizeof(double) * (size_t)rows);
      ref_merge(2, g.tokens, g.heads, g.dim, op, lp, o, lse);
      ok = 1;
    }
  } else {
    TU_CHECK(0, "%s: unknown kind '%s'", cas, g.kind);
  }

  if (ok) {
    TU_CHECK(o && lse, "%s: out of memory", cas);
    ref_cmp co = ref_compare(o, o_ref->data, rows * dim, TOL, TOL);
    ref_cmp cl = ref_compare(lse, lse_ref->data, rows, TOL, TOL);
    printf("%-24s %-8s o: max abs err %.3e (bad %lld, nonfinite mismatch %lld)  "
           "lse: max abs err %.3e (bad %lld, nonfinite mismatch %lld)\n",
           cas, g.kind, co.max_abs_err, (long long)co.bad, (long long)co.nonfinite_mismatch,
           cl.max_abs_err, (long long)cl.bad, (long long)cl.nonfinite_mismatch);
    TU_CHECK(ref_cmp_ok(&co, 1e-12), "%s: o differs from golden (first bad index %lld)", cas,
             (long long)co.first_bad);
    TU_CHECK(ref_cmp_ok(&cl, 1e-12), "%s: lse differs from golden (first bad index %lld)", cas,
             (long long)cl.first_bad);
  }
  free(o);
  free(lse);
  ref_golden_free(&g);
  return ok;
}

int main(void) {
  char root[1024];
  tu_golden_path(NULL, root, sizeof(root));
  printf("golden dir: %s\n", root);

  /* The loader must reject what is not a case. */
  ref_golden bad;
  char missing[1100];
  snprintf(missing, sizeof(missing), "%s/__no_such_case__", root);
  fprintf(stderr, "(an expected loader error follows)\n");
  TU_CHECK(ref_golden_load(missing, &bad) == -1, "loading a missing case must fail");

  DIR *d = opendir(root);
  TU_CHECK(d != NULL, "cannot open golden dir %s", root);
  if (!d) return tu_finish("test_golden_ref");
  char **names = NULL;
  int n = 0, cap = 0;
  for (struct dirent *e = readdir(d); e; e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char meta[2048];
    struct stat st;
    snprintf(meta, sizeof(meta), "%s/%s/meta.txt", root, e->d_name);
    if (stat(meta, &st) != 0) continue; /* README.md and other non-case entries */
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      char **grown = realloc(names, sizeof(char *) * (size_t)cap);
      if (!grown) break;
      names = grown;
    }
    names[n] = malloc(strlen(e->d_name) + 1);
    if (!names[n]) break;
    strcpy(names[n++], e->d_name);
  }
  closedir(d);
  qsort(names, (size_t)n, sizeof(char *), cmp_names); /* stable output order */

  int checked = 0;
  for (int i = 0; i < n; i++) {
    char dir[2048];
    snprintf(dir, sizeof(dir), "%s/%s", root, names[i]);
    checked += run_case(dir, names[i]);
    free(names[i]);
  }
  free(names);
  printf("%d of %d golden cases checked\n", checked, n);
  TU_CHECK(n > 0, "no golden case found under %s", root);
  TU_CHECK(checked == n, "%d golden cases could not be run", n - checked);
  return tu_finish("test_golden_ref");
}
