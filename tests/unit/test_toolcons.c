/* toolcons unit tests (issue 36, tool_choice auto): the state machine over
 * K3's reply structure on k3-nano's tokenizer. Expected ids come from K3's
 * format as chatparse.h documents it (the text encoded here), never from
 * toolcons: the content is free but for <|open|>; after <|close|> the
 * element names are forced; the model picks a tools section or the end;
 * a call header names a declared tool; the arguments follow the schema;
 * parallel_tool_calls false allows one call; required needs one. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/api/toolcons.h"
#include "test.h"

static shoal_tok *tok;
static shoal_cons_vocab *voc;
static uint8_t *mask;
static int32_t OPEN, CLOSE, SEP, EOM;

static const char *tools_json =
    "[{\"type\":\"function\",\"function\":{\"name\":\"lookup\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"q\":{\"type\":\"string\",\"maxLength\":8},\"where\":{\"enum\":[\"en\",\"de\"]}},"
    "\"required\":[\"q\",\"where\"],\"additionalProperties\":false}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"now\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"tz\":{\"type\":\"integer\",\"minimum\":0}}}}}]";

/* the ids of text as K3's encoder writes it (ordinary text, no specials) */
static int enc(const char *text, int32_t *out, int cap)
{
    shoal_tok_ids ids = {0};
    char err[200];
    if (shoal_tok_encode(tok, text, strlen(text), 0, &ids, err, sizeof err) || (int)ids.n > cap) {
        shoal_tok_ids_free(&ids);
        return -1;
    }
    memcpy(out, ids.v, sizeof(int32_t) * ids.n);
    int n = (int)ids.n;
    shoal_tok_ids_free(&ids);
    return n;
}

/* the ids taken by take / expect_forced while rec is set (t_lookahead) */
#define REC_CAP 512
static int32_t rec_ids[REC_CAP];
static int nrec, rec;

static void accept_rec(shoal_toolcons *tc, int32_t id)
{
    if (rec && nrec < REC_CAP)
        rec_ids[nrec++] = id;
    shoal_toolcons_accept(tc, id);
}

/* take id: it must be allowed (free step: anything but the banned id) */
static int take(shoal_toolcons *tc, int32_t id)
{
    int32_t ban;
    int n = shoal_toolcons_mask(tc, mask, &ban);
    int ok = n < 0 ? id != ban : n > 0 && mask[id];
    if (ok)
        accept_rec(tc, id);
    return ok;
}

/* the text's ids, each allowed; returns 1 when all were */
static int take_text(shoal_toolcons *tc, const char *text)
{
    int32_t ids[256];
    int n = enc(text, ids, 256);
    if (n < 0)
        return 0;
    for (int i = 0; i < n; i++)
        if (!take(tc, ids[i]))
            return 0;
    return 1;
}

/* the one id the mask forces now, -1 when it is not exactly one */
static int32_t forced(shoal_toolcons *tc)
{
    int32_t ban;
    int n = shoal_toolcons_mask(tc, mask, &ban);
    if (n != 1)
        return -1;
    for (int32_t i = 0; i < shoal_cons_vocab_size(voc); i++)
        if (mask[i])
            return i;
    return -1;
}

/* the forced ids equal the pieces' ids (K3's format), taken */
static int expect_forced(shoal_toolcons *tc, const char *const *pieces, int n)
{
    int32_t want[64];
    char err[200];
    int k = shoal_toolcons_ids(tok, pieces, n, want, 64, err, sizeof err);
    if (k <= 0)
        return 0;
    for (int i = 0; i < k; i++) {
        int32_t f = forced(tc);
        if (f != want[i])
            return 0;
        accept_rec(tc, f);
    }
    return 1;
}

static shoal_toolcons *open_tc(json_t *tools, int required, int max_calls, int thinking)
{
    shoal_toolcons *tc;
    char err[200];
    shoal_toolcons_opts o = {.tools = tools, .required = required, .max_calls = max_calls, .thinking = thinking};
    CHECK_MSG(shoal_toolcons_open(&tc, tok, voc, &o, err, sizeof err) == 0, "%s", err);
    return tc;
}

static const char *const after_content[] = {"response", "<|sep|>"};
static const char *const tools_open[] = {"tools", "<|sep|>"};
static const char *const args_open[] = {"<|open|>", "json", " type", "=\"", "object", "\"", "<|sep|>"};
/* after the arguments' text is complete <|close|> is offered next to its
 * continuations (whitespace), then the rest is forced */
static const char *const call_close[] = {"json", "<|sep|>", "<|close|>", "call", "<|sep|>"};
static const char *const section_close[] = {"tools", "<|sep|>", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"};
static const char *const msg_close[] = {"message", "<|sep|>", "<|end_of_msg|>"};

/* a whole call from the section's <|open|>: the header, the forced json
 * opening, the arguments, <|close|> and the forced closers */
static int call(shoal_toolcons *tc, const char *header, const char *args)
{
    return take_text(tc, header) && take(tc, SEP) && expect_forced(tc, args_open, 7) && take_text(tc, args) &&
           take(tc, CLOSE) && expect_forced(tc, call_close, 5);
}

static void t_one_call(void)
{
    json_t *tools = json_loads(tools_json, 0, NULL);
    shoal_toolcons *tc = open_tc(tools, 0, 1, 0);
    int32_t ban;
    CHECK(shoal_toolcons_mask(tc, mask, &ban) < 0 && ban == OPEN); /* content: free but <|open|> */
    CHECK(take_text(tc, "Let me look."));
    CHECK(take(tc, CLOSE));
    CHECK(expect_forced(tc, after_content, 2));
    CHECK(shoal_toolcons_mask(tc, mask, &ban) == 2 && mask[OPEN] && mask[CLOSE]); /* call or end */
    CHECK(take(tc, OPEN));
    CHECK(expect_forced(tc, tools_open, 2));
    CHECK(shoal_toolcons_mask(tc, mask, &ban) == 1 && mask[OPEN]); /* a section holds a call */
    CHECK(take(tc, OPEN));
    /* the header: an undeclared tool is refused, a declared one taken */
    {
        shoal_toolcons *probe = open_tc(tools, 0, 1, 0); /* the same state reached again */
        take_text(probe, "x");
        take(probe, CLOSE);
        expect_forced(probe, after_content, 2);
        take(probe, OPEN);
        expect_forced(probe, tools_open, 2);
        take(probe, OPEN);
        CHECK(!take_text(probe, "call tool=\"other\""));
        shoal_toolcons_close(probe);
    }
    CHECK(call(tc, "call tool=\"lookup\" index=\"1\"", "{\"q\": \"cats\", \"where\": \"en\"}"));
    CHECK_EQ_INT(shoal_toolcons_calls(tc), 1);
    /* parallel_tool_calls false: only the section's end is left */
    CHECK(shoal_toolcons_mask(tc, mask, &ban) == 1 && mask[CLOSE] && !mask[OPEN]);
    CHECK(take(tc, CLOSE));
    CHECK(expect_forced(tc, section_close, 6));
    CHECK(shoal_toolcons_mask(tc, mask, &ban) < 0 && ban < 0); /* after the end: nothing held */
    shoal_toolcons_close(tc);
    json_decref(tools);
}

static void t_args_schema(void)
{
    json_t *tools = json_loads(tools_json, 0, NULL);
    const char *bad[] = {"{\"q\": \"cats\", \"where\": \"fr\"}", "{\"where\": \"en\"}", "{\"q\": \"123456789\"",
                         "{\"q\": 1", "[", "{\"q\": \"a\", \"where\": \"en\", \"x\": 1}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        shoal_toolcons *tc = open_tc(tools, 1, 0, 0); /* required: the section opens at once */
        static const char *const req[] = {"<|close|>", "response", "<|sep|>"};
        CHECK(expect_forced(tc, req, 3));
        CHECK(forced(tc) == OPEN); /* required: no end before a call */
        shoal_toolcons_accept(tc, OPEN);
        CHECK(expect_forced(tc, tools_open, 2));
        CHECK(take(tc, OPEN));
        CHECK(take_text(tc, "call tool=\"lookup\" index=\"1\""));
        CHECK(take(tc, SEP));
        CHECK(expect_forced(tc, args_open, 7));
        CHECK_MSG(!take_text(tc, bad[i]), "accepted %s", bad[i]);
        shoal_toolcons_close(tc);
    }
    json_decref(tools);
}

static void t_refused_schema_and_thinking(void)
{
    /* "now" has minimum (refused by the compiler): any JSON object; thinking on */
    json_t *tools = json_loads(tools_json, 0, NULL);
    shoal_toolcons *tc = open_tc(tools, 0, 0, 1);
    int32_t ban;
    CHECK(take_text(tc, "thinking"));
    CHECK(shoal_toolcons_mask(tc, mask, &ban) < 0 && ban == OPEN);
    CHECK(take(tc, CLOSE));
    static const char *const think[] = {"think", "<|sep|>", "<|open|>", "response", "<|sep|>"};
    CHECK(expect_forced(tc, think, 5));
    CHECK(take(tc, CLOSE)); /* empty content */
    CHECK(expect_forced(tc, after_content, 2));
    CHECK(take(tc, OPEN));
    CHECK(expect_forced(tc, tools_open, 2));
    CHECK(take(tc, OPEN));
    CHECK(call(tc, "call tool=\"now\" index=\"1\"", "{\"tz\": -5, \"other\": [true]}"));
    /* parallel calls: a second one, index 2 */
    CHECK(shoal_toolcons_mask(tc, mask, &ban) == 2);
    CHECK(take(tc, OPEN));
    CHECK(take_text(tc, "call tool=\"lookup\" index=\"2\""));
    shoal_toolcons_close(tc);
    /* no call: the reply ends */
    tc = open_tc(tools, 0, 0, 0);
    CHECK(take(tc, CLOSE));
    CHECK(expect_forced(tc, after_content, 2));
    CHECK(take(tc, CLOSE));
    CHECK(expect_forced(tc, msg_close, 3));
    shoal_toolcons_close(tc);
    json_decref(tools);
}

/* One state of a toolcons: the mask's result, the banned id and (for a
 * constrained step) the mask itself. */
typedef struct {
    int n;
    int32_t ban;
    uint8_t *m;
} snap;

static void snap_take(shoal_toolcons *tc, snap *sn)
{
    sn->n = shoal_toolcons_mask(tc, mask, &sn->ban);
    if (sn->n >= 0)
        memcpy(sn->m, mask, (size_t)shoal_cons_vocab_size(voc));
}

static int snap_same(const snap *a, const snap *b)
{
    return a->n == b->n && a->ban == b->ban &&
           (a->n < 0 || !memcmp(a->m, b->m, (size_t)shoal_cons_vocab_size(voc)));
}

static snap got;

/* la (at position p of rec_ids) advanced by the next `depth` ids: the
 * number of masks that differ from ref (an id refused counts as one) */
static int lookahead_check(shoal_toolcons *la, const snap *ref, int p, int n, int depth)
{
    int bad = 0;
    for (int j = 1; j <= depth && p + j <= n; j++) {
        if (shoal_toolcons_accept(la, rec_ids[p + j - 1]))
            bad++;
        snap_take(la, &got);
        bad += !snap_same(&got, &ref[p + j]);
    }
    return bad;
}

/* The look-ahead copy the scheduler uses for drafted verify rows: one clone,
 * copied from the original at every position of a whole reply (reasoning,
 * content, a call to lookup, a second call to now -- whose schema the
 * compiler refuses -- and the section's end), then advanced by the next
 * SHOAL_DRAFT_MAX_K (8) ids: each of its masks equals the original's at
 * that position (from a separate walk), and the original is untouched by
 * it (its mask and call count after the clone moved). A clone never
 * compiles: without shoal_toolcons_prepare it stops (SHOAL_EBUSY) where the
 * reply opens a call. */
static void t_lookahead(void)
{
    json_t *tools = json_loads(tools_json, 0, NULL);
    shoal_toolcons *tc = open_tc(tools, 0, 0, 1);
    rec = 1;
    nrec = 0;
    CHECK(take_text(tc, "plan"));
    CHECK(take(tc, CLOSE));
    static const char *const think[] = {"think", "<|sep|>", "<|open|>", "response", "<|sep|>"};
    CHECK(expect_forced(tc, think, 5));
    CHECK(take_text(tc, "Let me look."));
    CHECK(take(tc, CLOSE));
    CHECK(expect_forced(tc, after_content, 2));
    CHECK(take(tc, OPEN));
    CHECK(expect_forced(tc, tools_open, 2));
    CHECK(take(tc, OPEN));
    CHECK(call(tc, "call tool=\"lookup\" index=\"1\"", "{\"q\": \"cats\", \"where\": \"de\"}"));
    CHECK(take(tc, OPEN));
    CHECK(call(tc, "call tool=\"now\" index=\"2\"", "{\"tz\": -3}"));
    CHECK(take(tc, CLOSE));
    CHECK(expect_forced(tc, section_close, 6));
    rec = 0;
    shoal_toolcons_close(tc);
    int n = nrec;
    CHECK(n > 60 && n < REC_CAP);
    size_t V = (size_t)shoal_cons_vocab_size(voc);
    /* the reference: the masks of a fresh toolcons walking the ids */
    snap *ref = calloc((size_t)n + 1, sizeof *ref);
    uint8_t *mem = malloc(V * (size_t)(n + 2));
    tc = open_tc(tools, 0, 0, 1);
    for (int i = 0; i <= n; i++) {
        ref[i].m = mem + V * (size_t)i;
        snap_take(tc, &ref[i]);
        if (i < n)
            CHECK_EQ_INT(shoal_toolcons_accept(tc, rec_ids[i]), 0);
    }
    shoal_toolcons_close(tc);
    got.m = mem + V * (size_t)(n + 1);
    /* a clone that was not prepared meets call 1's header uncompiled */
    tc = open_tc(tools, 0, 0, 1);
    shoal_toolcons *la = shoal_toolcons_clone(tc);
    int busy_at = -1;
    for (int i = 0; i < n && busy_at < 0; i++)
        if (shoal_toolcons_accept(la, rec_ids[i]) == SHOAL_EBUSY)
            busy_at = i;
    CHECK(busy_at > 0 && rec_ids[busy_at] == OPEN);
    shoal_toolcons_close(la);
    /* prepared: the clone follows every stretch of 8 ids (q: the end of call
     * 2's header, the last <|sep|> followed by the json opening) */
    int q = -1;
    for (int i = 0; i + 1 < n; i++)
        if (rec_ids[i] == SEP && rec_ids[i + 1] == OPEN)
            q = i;
    CHECK(q > 0);
    la = shoal_toolcons_clone(tc);
    shoal_toolcons *start = shoal_toolcons_clone(tc), *far = shoal_toolcons_clone(tc);
    int bad = 0, moved_calls = 0;
    for (int p = 0; p <= n; p++) {
        shoal_toolcons_prepare(tc);
        shoal_toolcons_copy(la, tc);
        if (p == q)
            shoal_toolcons_copy(far, tc);
        bad += lookahead_check(la, ref, p, n, 8);
        moved_calls += shoal_toolcons_calls(la) != shoal_toolcons_calls(tc);
        snap_take(tc, &got); /* the original is where it was */
        CHECK_MSG(snap_same(&got, &ref[p]), "the original moved with its copy at %d", p);
        if (p < n)
            shoal_toolcons_accept(tc, rec_ids[p]);
    }
    CHECK_MSG(!bad, "%d look-ahead masks differ from the original's", bad);
    CHECK(moved_calls > 0); /* some stretches crossed a call's end */
    CHECK_EQ_INT(shoal_toolcons_calls(tc), 2);
    /* a copy overwrites all of the clone's state: each one below lands on a
     * clone that held call 2's whole header (bytes and run) and then looks
     * ahead to the reply's end; the source is a clone too (copied from the
     * start, every constraint compiled by now) */
    shoal_toolcons *walker = shoal_toolcons_clone(tc);
    shoal_toolcons_copy(walker, start);
    for (int p = 0; p <= n; p++) {
        shoal_toolcons_copy(la, far);
        CHECK(shoal_toolcons_accept(la, SEP) == 0);
        shoal_toolcons_copy(la, walker);
        bad += lookahead_check(la, ref, p, n, n); /* to the end: a header's bytes decide later masks */
        if (p < n)
            shoal_toolcons_accept(walker, rec_ids[p]);
    }
    CHECK_MSG(!bad, "%d look-ahead masks differ after a copy over another state", bad);
    /* clones are closed before or after their original */
    shoal_toolcons_close(start);
    shoal_toolcons_close(tc);
    shoal_toolcons_close(la);
    shoal_toolcons_close(far);
    shoal_toolcons_close(walker);
    free(mem);
    free(ref);
    json_decref(tools);
}

int main(void)
{
    test_binary = "test_toolcons";
    char err[300];
    if (shoal_tok_open(&tok, test_src_path("tests/models/k3-nano"), NULL, err, sizeof err) ||
        shoal_cons_vocab_build(&voc, tok, err, sizeof err)) {
        fprintf(stderr, "k3-nano: %s\n", err);
        return 1;
    }
    mask = malloc((size_t)shoal_cons_vocab_size(voc));
    OPEN = shoal_tok_special_id(tok, "<|open|>");
    CLOSE = shoal_tok_special_id(tok, "<|close|>");
    SEP = shoal_tok_special_id(tok, "<|sep|>");
    EOM = shoal_tok_special_id(tok, "<|end_of_msg|>");
    RUN(t_one_call);
    RUN(t_args_schema);
    RUN(t_refused_schema_and_thinking);
    RUN(t_lookahead);
    free(mask);
    shoal_cons_vocab_free(voc);
    shoal_tok_close(tok);
    return test_finish();
}
