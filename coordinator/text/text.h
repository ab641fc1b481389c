/* text: the coordinator's text room -- everything between bytes and token ids.
 *   tokenizer.h  K3's tiktoken BPE (SPEC §5.1-5.3): encode, decode, the
 *                streaming detokenizer (tokenizer.c, detok.c, tokenizer_ascii.c);
 *   chat.h       the K3 XTML chat encoder: OpenAI messages to prompt ids;
 *   chatparse.h  the incremental parser of generated XTML: reasoning, content,
 *                tool calls;
 *   constrain.h  structured outputs: JSON schema / regex / choice compiled to
 *                a byte-level matcher, the vocabulary trie and per-token masks
 *                (constrain.c, constrain_re.c).
 * May use: common/ only (and PCRE2, jansson). Nothing here knows the model,
 * the engine or the server: a tokenizer and a chat format can be tested, fuzzed
 * and reused alone. Other rooms include this header, not the files behind it;
 * tokenizer_int.h, chatjson.h and constrain_int.h are internal to the room (and its tests). */
#ifndef SHOAL_TEXT_H
#define SHOAL_TEXT_H

#include "coordinator/text/chat.h"
#include "coordinator/text/chatparse.h"
#include "coordinator/text/constrain.h"
#include "coordinator/text/tokenizer.h"

#endif
