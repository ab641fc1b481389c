/* common/: error table and bf16 conversions. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "common/err.h"
#include "common/st.h"
#include "test.h"

static void t_err_table(void)
{
    CHECK(!strcmp(shoal_err_name(SHOAL_EFORMAT), "E_FORMAT"));
    CHECK(!strcmp(shoal_strerror(SHOAL_ETIMEOUT), "deadline exceeded"));
    CHECK(!strcmp(shoal_strerror(-ENOENT), strerror(ENOENT)));
    char buf[64];
    CHECK_EQ_INT(shoal_err_set(buf, sizeof buf, SHOAL_ERANGE, "x=%d", 7), SHOAL_ERANGE);
    CHECK(!strcmp(buf, "x=7"));
}

static void t_bf16_round_trip(void)
{
    /* bf16 -> f32 -> bf16 is the identity for every non-NaN pattern */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = shoal_bf16_to_f32((uint16_t)h);
        if (isnan(f)) {
            CHECK(isnan(shoal_bf16_to_f32(shoal_f32_to_bf16(f))));
            continue;
        }
        CHECK(shoal_f32_to_bf16(f) == h);
    }
    /* round to nearest even at the halfway point: 1 + 2^-8 is halfway between
     * 1 and 1 + 2^-7 -> 1 (even); 1 + 3*2^-8 -> 1 + 2^-6 */
    CHECK(shoal_round_bf16(1.0f + 0x1p-8f) == 1.0f);
    CHECK(shoal_round_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);
    CHECK(shoal_round_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);
}

int main(void)
{
    test_binary = "test_common";
    RUN(t_err_table);
    RUN(t_bf16_round_trip);
    return test_finish();
}
