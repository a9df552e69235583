/* Replays fuzz inputs through the fuzz target's code without libFuzzer, so
 * that the seed corpus and every input that once crashed (fuzz/regressions/)
 * run as an ordinary ctest test, under the sanitizers when the tree has them.
 *
 * usage: fuzz_replay PATH...   (a path is a file or a directory of files)
 * Exits non-zero if no input was found; an input that breaks an invariant
 * aborts inside the target (the file name is printed first). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern long fz_stats[8];
extern const char *const fz_stat_names[8];

static int replay_file(const char *path) {
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    fprintf(stderr, "fuzz_replay: cannot open %s\n", path);
    return -1;
  }
  size_t cap = 4096, n = 0;
  uint8_t *buf = malloc(cap);
  for (;;) {
    if (!buf) break;
    size_t got = fread(buf + n, 1, cap - n, fp);
    n += got;
    if (n < cap) break;
    uint8_t *nb = realloc(buf, cap * 2);
    if (!nb) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = nb;
    cap *= 2;
  }
  fclose(fp);
  if (!buf) {
    fprintf(stderr, "fuzz_replay: out of memory reading %s\n", path);
    return -1;
  }
  printf("replay %s (%zu bytes)\n", path, n);
  fflush(stdout);
  LLVMFuzzerTestOneInput(buf, n);
  free(buf);
  return 0;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Files of a directory in name order (a stable replay order). */
static int replay_dir(const char *dir, int *count) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue; /* ., .., .gitkeep */
    if (n == cap) {
      cap = cap ? cap * 2 : 64;
      char **nn = realloc(names, cap * sizeof *names);
      if (!nn) break;
      names = nn;
    }
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    names[n] = malloc(len);
    if (!names[n]) break;
    snprintf(names[n], len, "%s/%s", dir, e->d_name);
    n++;
  }
  closedir(d);
  if (n) qsort(names, n, sizeof *names, cmp_str);
  int rc = 0;
  for (size_t i = 0; i < n; i++) {
    struct stat st;
    if (stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
      if (replay_file(names[i]) != 0) rc = -1;
      else (*count)++;
    }
    free(names[i]);
  }
  free(names);
  return rc;
}

int main(int argc, char **argv) {
  int count = 0, rc = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "fuzz_replay: no such file or directory: %s\n", argv[i]);
      rc = 1;
    } else if (S_ISDIR(st.st_mode)) {
      if (replay_dir(argv[i], &count) != 0) rc = 1;
    } else if (replay_file(argv[i]) != 0) {
      rc = 1;
    } else {
      count++;
    }
  }
  if (count == 0) {
    fprintf(stderr, "fuzz_replay: no input replayed\n");
    return 1;
  }
  const char *stats = getenv("FZ_STATS");
  if (stats && stats[0] == '1')
    for (int k = 0; k < 8; k++) printf("  %-14s %ld\n", fz_stat_names[k], fz_stats[k]);
  printf("%d passed, %d failed\n", count, rc ? 1 : 0);
  return rc;
}
