/* libFuzzer target for the safetensors reader (common/st.c).
 * Byte 0 selects the mode; the rest is the file:
 *   bit 0 = 0: a .safetensors file (bit 1: map it read-only, else headers only);
 *   bit 0 = 1: a model.safetensors.index.json beside two small valid shards
 *              (s1.safetensors: a, b; s2.safetensors: c).
 * On success every tensor is looked up by name and the float ones converted,
 * touching every byte the store hands out. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/st.h"

static char dir[64];

static void put(const char *name, const void *p, size_t n)
{
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f)
        abort();
    if (n)
        fwrite(p, 1, n, f);
    fclose(f);
}

static void put_shard(const char *name, const char *hdr, size_t data)
{
    size_t h = strlen(hdr);
    unsigned char *b = calloc(1, 8 + h + data);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, hdr, h);
    put(name, b, 8 + h + data);
    free(b);
}

static void cleanup(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "fuzz_st: could not remove %s\n", dir);
}

static void setup(void)
{
    if (dir[0])
        return;
    snprintf(dir, sizeof dir, "/tmp/shoal_fuzz_st_%d", (int)getpid());
    char cmd[128];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
    if (system(cmd) != 0)
        abort();
    atexit(cleanup);
    put_shard("s1.safetensors",
              "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[8,16]}}",
              16);
    put_shard("s2.safetensors", "{\"c\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,6]}}", 6);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    setup();
    int mode = data[0];
    const char *name = (mode & 1) ? "model.safetensors.index.json" : "x.safetensors";
    put(name, data + 1, size - 1);
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    shoal_st_opts o = {.map = (mode & 1) || (mode & 2)};
    shoal_st *st = NULL;
    char err[512];
    if (shoal_st_open(&st, path, &o, err, sizeof err) == 0) {
        for (size_t i = 0; i < shoal_st_count(st); i++) {
            const shoal_tensor *t = shoal_st_at(st, i);
            if (shoal_st_find(st, t->name) != t)
                abort();
            if (t->file < 0 || t->file >= shoal_st_nfiles(st))
                abort();
            size_t es = shoal_dtype_size(t->dtype);
            if (o.map && es && t->nbytes / es <= 4096 &&
                (t->dtype == SHOAL_DT_F32 || t->dtype == SHOAL_DT_BF16 || t->dtype == SHOAL_DT_F16)) {
                float buf[4096];
                if (shoal_tensor_to_f32(t, buf, t->nbytes / es) != 0)
                    abort();
            } else if (o.map && t->nbytes) {
                /* read the first and last byte of the view */
                volatile unsigned char x = ((const unsigned char *)t->data)[0];
                x = ((const unsigned char *)t->data)[t->nbytes - 1];
                (void)x;
            }
        }
        shoal_st_close(st);
    } else if (!err[0]) {
        abort(); /* every refusal carries a message */
    }
    return 0;
}
