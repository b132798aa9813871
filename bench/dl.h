// dl.h: a symbol of a dlopen'ed build of libkrafla, or exit naming what is missing, for the C
// benchmarks of this folder that load several builds side by side (ab_generate.c,
// cold_attention.c), each built by one gcc command that finds this file beside it.
#ifndef KRAFLA_BENCH_DL_H
#define KRAFLA_BENCH_DL_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

static void *symbol(void *library, const char *path, const char *name) {
    void *found = dlsym(library, name);
    if (!found) {
        fprintf(stderr, "%s has no %s\n", path, name);
        exit(1);
    }
    return found;
}

#endif
