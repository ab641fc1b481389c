/* constrain internals shared by constrain.c and constrain_re.c. */
#ifndef SHOAL_CONSTRAIN_INT_H
#define SHOAL_CONSTRAIN_INT_H

#include <stddef.h>
#include <stdint.h>

/* All regex DFAs of one constraint live in one pool; a DFA is named by its
 * start state. next[s*256 + b] is the next state or -1 (dead: no accepting
 * state is reachable). dist[s] is the fewest bytes from s to an accepting
 * state. */
typedef struct {
    int32_t *next;
    uint8_t *acc;
    int32_t *dist;
    int n, cap;
} shoal__cons_dfa;

/* Compile re[0..len) into d; *start is its start state.
 * json_str: the regex applies inside a JSON string (a schema's "pattern" or
 * "format"): '"', '\\' and bytes < 0x20 are removed from every class (the
 * string carries no escapes when a pattern applies, docs/API.md).
 * search: Python re.search semantics (jsonschema's): without a leading '^' the
 * regex is preceded by .*, without a trailing '$' followed by .* .
 * Otherwise the whole text must match (vLLM's guided_regex). */
int shoal__cons_re_compile(shoal__cons_dfa *d, const char *re, size_t len, int json_str, int search, int *start,
                           char *err, size_t errlen);
void shoal__cons_dfa_free(shoal__cons_dfa *d);

/* A GBNF grammar (rule "root") as one regex (*out, NUL-terminated, the
 * caller frees): rules inlined, each rule expanded at most 3 times along a
 * path (recursion bounded: a subset of the grammar's language), classes
 * keeping their ASCII members. */
int shoal__cons_gbnf_to_regex(const char *text, size_t len, char **out, char *err, size_t errlen);

#endif
