/* The cluster snapshot (coordinator/cmd/webui.c) from hand-written
 * expositions, and the "did you mean" suggestions (common/suggest.c). */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "common/suggest.h"
#include "coordinator/cmd/webui.h"
#include "test.h"

static const char EXPO[] =
    "# TYPE shoal_sched_running gauge\n"
    "shoal_sched_running 2\n"
    "shoal_completion_tokens_total 40\n"
    "shoal_build_info{version=\"0.1.0\",commit=\"abc\",isa=\"avx2\",kernels=\"avx2\"} 1\n"
    "shoal_request_ttft_seconds_bucket{le=\"0.5\"} 1\n"
    "shoal_request_ttft_seconds_bucket{le=\"1\"} 3\n"
    "shoal_request_ttft_seconds_bucket{le=\"+Inf\"} 4\n"
    "shoal_worker_info{worker=\"a\",endpoint=\"tcp://h:1\"} 1\n"
    "shoal_worker_up{worker=\"a\"} 0\n"
    "shoal_worker_up{worker=\"b\"} 1\n"
    "shoal_worker_pairs_total{worker=\"b\"} 12\n"
    "shoal_worker_rtt_seconds_bucket{worker=\"b\",le=\"0.001\"} 5\n"
    "shoal_worker_rtt_seconds_bucket{worker=\"b\",le=\"+Inf\"} 6\n"
    "shoal_worker_layer_pairs_total{worker=\"b\",layer=\"3\"} 7\n"
    "shoal_worker_layer_rtt_seconds{worker=\"b\",layer=\"3\",quantile=\"0.5\"} 0.1\n"
    "shoal_failover_takeover_pairs_total{from=\"a\",to=\"b\"} 9\n"
    "shoal_layer_imbalance{layer=\"3\"} 1.5\n"
    "shoal_worker_up{worker=\"e\\\\\\\"\xff\x1b[2J\"} 1\n";

static void t_snapshot(void)
{
    char err[256];
    json_t *health = json_pack("{s:s,s:[{s:s,s:b,s:s}]}", "status", "degraded", "workers", "endpoint",
                               "a (tcp://h:1)", "up", 0, "state", "down: backing off, next try in 4 s");
    char *s = shoal_webui_cluster_json(EXPO, sizeof EXPO - 1, health, err, sizeof err);
    json_decref(health);
    CHECK_MSG(s != NULL, "%s", err);
    if (!s)
        return;
    json_error_t je;
    json_t *j = json_loads(s, 0, &je); /* valid JSON, hence valid UTF-8, whatever the labels held */
    CHECK_MSG(j != NULL, "%s: %s", je.text, s);
    free(s);
    if (!j)
        return;
    json_t *c = json_object_get(j, "coordinator");
    CHECK(json_number_value(json_object_get(c, "sched_running")) == 2);
    CHECK(json_number_value(json_object_get(c, "completion_tokens_total")) == 40);
    CHECK(!strcmp(json_string_value(json_object_get(json_object_get(c, "build"), "kernels")), "avx2"));
    json_t *tt = json_object_get(c, "request_ttft_seconds");
    CHECK(json_array_size(json_object_get(tt, "le")) == 3 && json_array_size(json_object_get(tt, "count")) == 3);
    CHECK(!strcmp(json_string_value(json_array_get(json_object_get(tt, "le"), 2)), "+Inf"));
    CHECK(json_number_value(json_array_get(json_object_get(tt, "count"), 1)) == 3);
    CHECK(!strcmp(json_string_value(json_object_get(j, "status")), "degraded"));
    json_t *ws = json_object_get(j, "workers");
    CHECK(json_array_size(ws) == 3);
    json_t *a = json_array_get(ws, 0), *b = json_array_get(ws, 1), *e = json_array_get(ws, 2);
    CHECK(!strcmp(json_string_value(json_object_get(a, "id")), "a"));
    CHECK(!strcmp(json_string_value(json_object_get(a, "endpoint")), "tcp://h:1"));
    CHECK(json_number_value(json_object_get(a, "up")) == 0);
    CHECK(json_number_value(json_object_get(json_object_get(a, "taken_by"), "b")) == 9);
    json_t *ah = json_object_get(a, "health");
    CHECK(ah && json_is_false(json_object_get(ah, "up")) &&
          strstr(json_string_value(json_object_get(ah, "state")), "backing off"));
    CHECK(json_number_value(json_object_get(b, "pairs_total")) == 12);
    CHECK(json_number_value(json_object_get(json_object_get(b, "layer_pairs"), "3")) == 7);
    CHECK(json_array_size(json_object_get(json_object_get(b, "rtt_seconds"), "le")) == 2);
    CHECK(!json_object_get(b, "layer_rtt_seconds")); /* a per-layer summary: not a plain series */
    CHECK(json_number_value(json_object_get(json_object_get(j, "layers"), "3")) == 1.5);
    const char *eid = json_string_value(json_object_get(e, "id"));
    CHECK(eid && !strchr(eid, 0x1b)); /* control bytes do not reach the page */
    json_decref(j);
    CHECK(shoal_webui_cluster_json("bad{ 1\n", 7, NULL, err, sizeof err) == NULL);
}

static void t_suggest(void)
{
    const char *cmds[] = {"version", "inspect", "run", "serve", "top", "expert"};
    CHECK(!strcmp(shoal_suggest("serv", cmds, 6), "serve"));
    CHECK(!strcmp(shoal_suggest("exprt", cmds, 6), "expert"));
    CHECK(!strcmp(shoal_suggest("tpo", cmds, 6), "top")); /* a transposition */
    CHECK(shoal_suggest("zzzzzz", cmds, 6) == NULL);
    CHECK(shoal_suggest("", cmds, 6) == NULL);
}

static void usage(FILE *f)
{
    fprintf(f, "  --max-context N   tokens\n  --max-connections N\n  --model DIR, --port N\n");
}

static void t_suggest_flag(void)
{
    CHECK(!strcmp(shoal_suggest_flag("--max-contxt", usage), "--max-context"));
    CHECK(!strcmp(shoal_suggest_flag("--prot", usage), "--port"));
    CHECK(shoal_suggest_flag("--entirely-else", usage) == NULL);
}

int main(void)
{
    test_binary = "test_webui";
    RUN(t_snapshot);
    RUN(t_suggest);
    RUN(t_suggest_flag);
    return test_finish();
}
