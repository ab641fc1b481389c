/* The measurement behind docs/DEPENDENCIES.md's JSON choice for safetensors
 * headers: time for jansson (JSON_REJECT_DUPLICATES) to parse every shard
 * header of a model and walk its tensors, and to parse the index, without any
 * of the checks common/st.c makes. One line per run:
 *   bench_jansson_index MODEL_DIR [REPS]
 * "run=<i> tensors=<n> headers_seconds=<s> index_seconds=<s> total_seconds=<s>" */
#include <dirent.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL_DIR [REPS]\n", argv[0]);
        return 2;
    }
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        size_t n = 0;
        DIR *d = opendir(argv[1]);
        if (!d)
            return 1;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            size_t l = strlen(e->d_name);
            if (l < 12 || strcmp(e->d_name + l - 12, ".safetensors"))
                continue;
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", argv[1], e->d_name);
            FILE *f = fopen(p, "rb");
            uint64_t h = 0;
            if (!f || fread(&h, 8, 1, f) != 1)
                return 1;
            char *b = malloc(h);
            if (fread(b, 1, h, f) != h)
                return 1;
            fclose(f);
            json_error_t je;
            json_t *j = json_loadb(b, h, JSON_REJECT_DUPLICATES, &je);
            if (!j) {
                fprintf(stderr, "%s: %s\n", p, je.text);
                return 1;
            }
            const char *k;
            json_t *v;
            json_object_foreach(j, k, v) {
                if (json_object_get(v, "shape"))
                    n++;
            }
            json_decref(j);
            free(b);
        }
        closedir(d);
        double t1 = now();
        char p[4096];
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", argv[1]);
        json_error_t je;
        json_t *idx = json_load_file(p, JSON_REJECT_DUPLICATES, &je);
        if (!idx)
            return 1;
        json_decref(idx);
        double t2 = now();
        printf("run=%d tensors=%zu headers_seconds=%.4f index_seconds=%.4f total_seconds=%.4f\n", r, n, t1 - t0,
               t2 - t1, t2 - t0);
        fflush(stdout);
    }
    return 0;
}
