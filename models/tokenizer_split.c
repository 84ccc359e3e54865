/* Text before BPE: strict UTF-8 check, NFC (tokenizer_nfc.c), and the Qwen2
 * pre-tokenizer split (transformers models/qwen2/tokenization_qwen2.py
 * PRETOKENIZE_REGEX):
 *
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}
 *   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *
 * The regex is matched by hand rather than through PCRE2: the reference runs
 * it in Oniguruma with Unicode 16 tables (tokenizer_unicode.c), while
 * Debian's PCRE2 10.42 has Unicode 14 ones (9,272 letters, e.g. CJK
 * Extension H, and 120 numbers fewer) and its caseless 's also matches 'ſ',
 * which Oniguruma's does not.  Each alternative is short enough to follow its
 * backtracking exactly; the comments in match_at() derive what each matches.
 * The regex matches at every position, so the split (behaviour Isolated)
 * leaves no gaps. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

/* Classes of the split: \s is divided into CR/LF and the rest. */
enum { C_OTHER, C_LETTER, C_NUMBER, C_SPACE, C_NEWLINE };

kiln_status kiln_tok_utf8_check(const char *text, size_t len, kiln_err *err)
{
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0;
    while (i < len) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
        const char *why = NULL;
        if (c < 0xC0)
            why = "a continuation byte without a lead byte";
        else if (c < 0xC2 || c > 0xF4)
            why = c < 0xC2 ? "an overlong encoding" : "a byte that never occurs in UTF-8";
        else if (len - i < n)
            why = "a truncated sequence";
        for (size_t k = 1; !why && k < n; k++)
            if ((s[i + k] & 0xC0) != 0x80)
                why = "a truncated sequence";
        if (!why && n == 3 && c == 0xE0 && s[i + 1] < 0xA0)
            why = "an overlong encoding";
        if (!why && n == 3 && c == 0xED && s[i + 1] >= 0xA0)
            why = "a UTF-16 surrogate";
        if (!why && n == 4 && c == 0xF0 && s[i + 1] < 0x90)
            why = "an overlong encoding";
        if (!why && n == 4 && c == 0xF4 && s[i + 1] >= 0x90)
            why = "a code point above U+10FFFF";
        if (why)
            return kiln_err_set(err, KILN_ERR_INVALID, "text is not valid UTF-8: %s at byte %zu",
                                why, i);
        i += n;
    }
    return KILN_OK;
}

/* Decodes trusted UTF-8 into code point offsets and classes; returns the count. */
static kiln_status classify(const uint8_t *b, size_t len, tok_scratch *s, size_t *count,
                            kiln_err *err)
{
    if (len + 1 > s->cp_cap) {
        if (len >= UINT32_MAX)
            return kiln_err_set(err, KILN_ERR_TOO_LARGE, "text of %zu bytes is too long", len);
        uint32_t *off = realloc(s->cp_off, (len + 1) * sizeof *off);
        if (off)
            s->cp_off = off;
        uint8_t *cls = realloc(s->cp_cls, len + 1);
        if (cls)
            s->cp_cls = cls;
        if (!off || !cls)
            return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
        s->cp_cap = len + 1;
    }
    size_t n = 0;
    for (size_t i = 0; i < len; n++) {
        uint32_t cp = b[i];
        size_t k = cp < 0x80 ? 1 : cp < 0xE0 ? 2 : cp < 0xF0 ? 3 : 4;
        if (k > 1)
            cp &= 0x3F >> (k - 1);
        for (size_t j = 1; j < k; j++)
            cp = cp << 6 | (b[i + j] & 0x3F);
        s->cp_off[n] = (uint32_t)i;
        if (cp == '\r' || cp == '\n') {
            s->cp_cls[n] = C_NEWLINE;
        } else {
            int u = kiln_tok_uclass(cp);
            s->cp_cls[n] = u == TOK_U_LETTER   ? C_LETTER
                           : u == TOK_U_NUMBER ? C_NUMBER
                           : u == TOK_U_SPACE  ? C_SPACE
                                               : C_OTHER;
        }
        i += k;
    }
    s->cp_off[n] = (uint32_t)len;
    *count = n;
    return KILN_OK;
}

static int ascii_lower(uint8_t c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

static int is_space(uint8_t cls)
{
    return cls == C_SPACE || cls == C_NEWLINE;
}

/* End (exclusive, in code points) of the regex match that starts at i < n. */
static size_t match_at(const uint8_t *b, const uint32_t *off, const uint8_t *cls, size_t i,
                       size_t n)
{
    /* (?i:'s|'t|'re|'ve|'m|'ll|'d): Oniguruma folds only ASCII case here
     * ("'ſ" is no contraction), so compare ASCII-lowered lead bytes. */
    if (b[off[i]] == '\'' && i + 1 < n) {
        int c1 = ascii_lower(b[off[i + 1]]);
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
            return i + 2;
        int c2 = i + 2 < n ? ascii_lower(b[off[i + 2]]) : 0;
        if (((c1 == 'r' || c1 == 'v') && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
            return i + 3;
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+: the optional char is taken only when a letter
     * follows; the letter run is maximal (nothing after it can fail). */
    size_t j = i;
    if (cls[i] != C_LETTER && cls[i] != C_NUMBER && cls[i] != C_NEWLINE && i + 1 < n &&
        cls[i + 1] == C_LETTER)
        j = i + 1;
    if (cls[j] == C_LETTER) {
        while (j < n && cls[j] == C_LETTER)
            j++;
        return j;
    }
    /* \p{N}: one digit at a time. */
    if (cls[i] == C_NUMBER)
        return i + 1;
    /*  ?[^\s\p{L}\p{N}]+[\r\n]*: an optional U+0020, a maximal run of
     * symbols, then every CR/LF that follows. */
    j = i;
    if (b[off[i]] == ' ' && i + 1 < n && cls[i + 1] == C_OTHER)
        j = i + 1;
    if (cls[j] == C_OTHER) {
        while (j < n && cls[j] == C_OTHER)
            j++;
        while (j < n && cls[j] == C_NEWLINE)
            j++;
        return j;
    }
    /* Only whitespace starts here.  \s*[\r\n]+: \s* backs off from the whole
     * run to its last CR/LF, so the match ends just after that CR/LF. */
    size_t end = i, last_newline = 0;
    for (; end < n && is_space(cls[end]); end++)
        if (cls[end] == C_NEWLINE)
            last_newline = end + 1;
    if (last_newline)
        return last_newline;
    /* \s+(?!\S): the whole run at the end of the text, else all of it but the
     * last space (which then prefixes the next word); \s+: a single space. */
    if (end == n)
        return n;
    return end - i >= 2 ? end - 1 : end;
}

kiln_status kiln_tok_encode_segment(const kiln_tokenizer *tok, const char *text, size_t len,
                                    tok_scratch *s, tok_ids *out, kiln_err *err)
{
    if (len == 0)
        return KILN_OK;
    const uint8_t *b = (const uint8_t *)text;
    uint8_t *nfc = NULL;
    size_t i = 0;
    while (i < len && b[i] < 0x80)
        i++;
    kiln_status st = KILN_OK;
    if (i < len) { /* ASCII is its own NFC form; only other text is normalised */
        if ((st = kiln_tok_nfc(b, len, &nfc, &len, err)))
            return st;
        b = nfc;
    }
    size_t count = 0;
    st = classify(b, len, s, &count, err);
    for (size_t p = 0; !st && p < count;) {
        size_t q = match_at(b, s->cp_off, s->cp_cls, p, count);
        st = kiln_tok_bpe(tok, b + s->cp_off[p], s->cp_off[q] - s->cp_off[p], s, out, err);
        p = q;
    }
    free(nfc);
    return st;
}

void kiln_tok_scratch_free(tok_scratch *s)
{
    free(s->sym);
    free(s->prev);
    free(s->next);
    free(s->heap);
    free(s->cp_off);
    free(s->cp_cls);
}
