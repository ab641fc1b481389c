/* chatjson: JSON the way K3's Python chat encoder sees it, for the chat encoder
 * (coordinator/text/chat.c) and the output parser (coordinator/text/chatparse.c).
 *
 * Why not jansson alone: the official encoder (encoding_k3.py) parses tool-call
 * argument strings with Python's json.loads and writes values back, and the ids
 * depend on the exact text: number literals keep their source spelling (the
 * official output for {"days":1e2} is the argument text "1e2"; ATLAS
 * official-xtml.json "typed_tools"), duplicate keys keep the first position with
 * the last value, NaN/Infinity are accepted, control characters inside strings
 * are refused, and written JSON is compact with Python's escaping
 * (ensure_ascii=False). jansson keeps neither literals nor Python's float repr.
 * Containers inside an argument are re-written compactly (separators "," ":");
 * that equals the source when the source is compact, as in the official case.
 *
 * All functions are pure; buffers are caller-owned. Not thread-hostile. */
#ifndef SHOAL_CHATJSON_H
#define SHOAL_CHATJSON_H

#include <jansson.h>
#include <stddef.h>

/* A growable NUL-terminated byte buffer; zero-initialise, free(b.p) when done. */
typedef struct {
    char *p;
    size_t n, cap;
} shoal_chatjson_buf;

void shoal_chatjson_put(shoal_chatjson_buf *b, const char *s, size_t n);
void shoal_chatjson_puts(shoal_chatjson_buf *b, const char *s);

/* Appends s[0..n) as a JSON string literal, escaped as Python's json.dumps with
 * ensure_ascii=False: \" \\ \n \r \t \b \f, other controls as \u00xx, the rest raw. */
void shoal_chatjson_put_string(shoal_chatjson_buf *b, const char *s, size_t n);

/* Appends v as compact JSON (separators "," and ":"), Python-style: integers as
 * decimal, reals as Python's repr (100.0, 1e+16, 1.5e-05), strings as above;
 * sort_keys: object keys in code point order at every level (deep_sort_dict). */
void shoal_chatjson_dump(shoal_chatjson_buf *b, const json_t *v, int sort_keys);

/* The members of a JSON object text parsed with Python json.loads semantics. */
typedef enum {
    SHOAL_CHATJSON_NULL,
    SHOAL_CHATJSON_BOOLEAN,
    SHOAL_CHATJSON_NUMBER,
    SHOAL_CHATJSON_STRING,
    SHOAL_CHATJSON_OBJECT,
    SHOAL_CHATJSON_ARRAY,
} shoal_chatjson_type;

typedef struct {
    char *key;          /* decoded, NUL-terminated (may contain NUL: use key_len) */
    size_t key_len;
    shoal_chatjson_type type;
    char *text;         /* a string's decoded value; any other value compact JSON */
    size_t text_len;
} shoal_chatjson_member;

typedef struct {
    shoal_chatjson_member *m;
    size_t n;
} shoal_chatjson_members;

/* Parses s[0..n) like json.loads. Returns 0 and fills *out when it is an object
 * (members in first-occurrence order, duplicates resolved to the last value);
 * SHOAL_EFORMAT when json.loads would fail (err says where); SHOAL_EINVAL when
 * it parses but is not an object (*type_out says what it is). Nesting deeper
 * than 256 is refused with SHOAL_EFORMAT. Lone \u surrogates decode to U+FFFD
 * (what tiktoken does with them). */
int shoal_chatjson_parse_object(const char *s, size_t n, shoal_chatjson_members *out,
                                shoal_chatjson_type *type_out, char *err, size_t errlen);
void shoal_chatjson_members_free(shoal_chatjson_members *m);

/* 1 if s[0..n) parses (json.loads) to a value of the given type, else 0. */
int shoal_chatjson_is_type(const char *s, size_t n, shoal_chatjson_type type);

/* The type name used in XTML argument elements ("string", "number", ...). */
const char *shoal_chatjson_type_name(shoal_chatjson_type t);

#endif
