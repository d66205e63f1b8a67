/* The chained xxh3-128 chunk hashes of common/tokendb.py, in one call per prompt.
 *
 * hash(chunk i) = xxh3_128(hash(chunk i-1) || tokens of chunk i as little-endian uint32),
 * the digest in xxhash's canonical (big-endian) form. The Python loop pays an object
 * slice, a concatenation and a call per chunk, and a list of ids is first converted by
 * array.array at ~5 ns a token; here each chunk is encoded straight into one buffer
 * behind the previous digest and hashed in place.
 *
 * xxh3 comes from the system's libxxhash (libxxhash0, which apt itself depends on), its
 * entry point declared here from the library's documented ABI, so no header package is
 * needed. common/tokendb.py then hands over, through use_xxh3_128, the same function from
 * the xxhash module's newer build when that one agrees on a probe: on the project's AMD
 * VM it hashes a chunk in 93 ns against 146-173 ns (common/xxh3_native.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t low64;
    uint64_t high64;
} XXH128_hash_t;

extern XXH128_hash_t XXH3_128bits(const void *data, size_t len);
typedef XXH128_hash_t (*xxh3_128_fn)(const void *data, size_t len);
static xxh3_128_fn xxh3_128 = XXH3_128bits;

#define DIGEST 16
#define MAX_TOKEN 0xFFFFFFFFull

static void canonical(unsigned char *out, XXH128_hash_t h)
{
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
    }
}

static inline void put_u32(unsigned char *p, uint32_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 4); /* one store */
#else
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
#endif
}

/* One token id from an exact int: 0 and *out set; -1 with ValueError set (out of
 * range); -2 with nothing set (not an exact int: the caller lets Python handle the whole
 * input). Nothing here runs Python code, so the caller's list cannot change under it. */
#define NOT_EXACT (-2)
static inline int token_of(PyObject *item, uint32_t *out)
{
    if (!PyLong_CheckExact(item))
        return NOT_EXACT;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (v >= 0 && (unsigned long long)v <= MAX_TOKEN) {
            *out = (uint32_t)v;
            return 0;
        }
    }
#else
    Py_ssize_t size = Py_SIZE(item);
    const digit *d = ((PyLongObject *)item)->ob_digit;
    if (size == 0) {
        *out = 0;
        return 0;
    }
    if (size == 1) { /* one 30-bit digit: every id below 2**30 */
        *out = (uint32_t)d[0];
        return 0;
    }
    if (size == 2) {
        unsigned long long v = (unsigned long long)d[0] | (unsigned long long)d[1] << PyLong_SHIFT;
        if (v <= MAX_TOKEN) {
            *out = (uint32_t)v;
            return 0;
        }
    }
#endif
    PyErr_Format(PyExc_ValueError, "token ids must be in [0, %llu]", MAX_TOKEN);
    return -1;
}

/* Encodes `count` tokens from `first` on as little-endian uint32 at dst: 0, or -1 with an
 * exception set, or NOT_EXACT. */
typedef int (*fill_fn)(void *src, Py_ssize_t first, Py_ssize_t count, unsigned char *dst);

/* The digests of every chunk, as a list of bytes. One buffer holds the previous digest
 * and then the current chunk's tokens, which `fill` writes in place. */

static PyObject *chain(fill_fn fill, void *src, Py_ssize_t n_tokens, Py_ssize_t chunk_size,
                       int unfull, Py_buffer *seed)
{
    if (chunk_size < 1) {
        PyErr_SetString(PyExc_ValueError, "chunk_size must be positive");
        return NULL;
    }
    if (seed->len != DIGEST) {
        PyErr_SetString(PyExc_ValueError, "seed must be 16 bytes");
        return NULL;
    }
    Py_ssize_t n_chunks = n_tokens / chunk_size + (unfull && n_tokens % chunk_size ? 1 : 0);
    /* No chunk holds more than the input's tokens: sizing by chunk_size alone would
     * ask for terabytes for a huge chunk_size, or wrap 4 * chunk_size to a few bytes
     * (chunk_size >= 2**62) that the tokens then overrun. */
    Py_ssize_t room = chunk_size < n_tokens ? chunk_size : n_tokens;
    if ((size_t)room > (PY_SSIZE_T_MAX - DIGEST) / 4) {
        PyErr_SetString(PyExc_OverflowError, "too many tokens to hash");
        return NULL;
    }
    unsigned char *buf = PyMem_Malloc(DIGEST + 4 * (size_t)room);
    if (buf == NULL)
        return PyErr_NoMemory();
    PyObject *out = PyList_New(n_chunks);
    if (out == NULL) {
        PyMem_Free(buf);
        return NULL;
    }
    memcpy(buf, seed->buf, DIGEST);
    for (Py_ssize_t c = 0; c < n_chunks; c++) {
        Py_ssize_t first = c * chunk_size;
        Py_ssize_t count = n_tokens - first < chunk_size ? n_tokens - first : chunk_size;
        int filled = fill(src, first, count, buf + DIGEST);
        if (filled < 0) {
            Py_DECREF(out);
            PyMem_Free(buf);
            if (filled == NOT_EXACT)
                Py_RETURN_NONE;
            return NULL;
        }
        canonical(buf, xxh3_128(buf, DIGEST + 4 * (size_t)count));
        PyObject *digest = PyBytes_FromStringAndSize((const char *)buf, DIGEST);
        if (digest == NULL) {
            Py_DECREF(out);
            PyMem_Free(buf);
            return NULL;
        }
        PyList_SET_ITEM(out, c, digest);
    }
    /* A trailing partial chunk that gets no hash is still checked, as Python checks
     * every token. */
    Py_ssize_t tail = n_tokens - n_chunks * chunk_size;
    int filled = tail > 0 ? fill(src, n_chunks * chunk_size, tail, buf + DIGEST) : 0;
    PyMem_Free(buf);
    if (filled < 0) {
        Py_DECREF(out);
        if (filled == NOT_EXACT)
            Py_RETURN_NONE;
        return NULL;
    }
    return out;
}

static int fill_items_checked(PyObject **items, Py_ssize_t count, unsigned char *dst)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t v;
        int got = token_of(items[i], &v);
        if (got < 0)
            return got;
        put_u32(dst + 4 * i, v);
    }
    return 0;
}

static int fill_items(void *src, Py_ssize_t first, Py_ssize_t count, unsigned char *dst)
{
    PyObject **items = (PyObject **)src + first;
#if PY_VERSION_HEX < 0x030C0000 && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* Every id below 2**30 is an exact int of at most one digit. Read them all with no
     * branch, note whether any was something else, and only then take the careful
     * path: the branches per id cost more than the reading (AMD VM, 2026-11-26, 8192
     * ids: 2.8-3.3 against 4.2-4.3 ns a token; checking every type in a first pass,
     * 3.1-3.5). */
    static PyLongObject not_an_int; /* size 0: what is read in place of another object */
    uint32_t *out = (uint32_t *)(void *)dst; /* 4-byte aligned: after the digest */
    size_t bad = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *o = items[i];
        int exact = Py_IS_TYPE(o, &PyLong_Type);
        /* Only an int's own fields are read: another object may be too small. */
        PyLongObject *n = exact ? (PyLongObject *)o : &not_an_int;
        Py_ssize_t size = Py_SIZE(n);
        bad |= (size_t)!exact | ((size_t)size > 1);
        out[i] = size ? (uint32_t)n->ob_digit[0] : 0; /* a zero has no digit to trust */
    }
    if (!bad)
        return 0;
#endif
    return fill_items_checked(items, count, dst);
}

static int fill_u32(void *src, Py_ssize_t first, Py_ssize_t count, unsigned char *dst)
{
    const uint32_t *ids = (const uint32_t *)src + first;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(dst, ids, 4 * (size_t)count);
#else
    for (Py_ssize_t i = 0; i < count; i++)
        put_u32(dst + 4 * i, ids[i]);
#endif
    return 0;
}

static int fill_i32(void *src, Py_ssize_t first, Py_ssize_t count, unsigned char *dst)
{
    const int32_t *ids = (const int32_t *)src + first;
    int32_t any = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        any |= ids[i];
    if (any < 0) {
        PyErr_Format(PyExc_ValueError, "token ids must be in [0, %llu]", MAX_TOKEN);
        return -1;
    }
    return fill_u32(src, first, count, dst);
}

static int fill_i64(void *src, Py_ssize_t first, Py_ssize_t count, unsigned char *dst)
{
    const int64_t *ids = (const int64_t *)src + first;
    uint64_t bad = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        bad |= (uint64_t)ids[i] >> 32; /* negative ids have high bits set too */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint32_t *out = (uint32_t *)(void *)dst; /* dst is 4-byte aligned (after the digest) */
    for (Py_ssize_t i = 0; i < count; i++)
        out[i] = (uint32_t)ids[i]; /* a narrowing the compiler vectorises */
#else
    for (Py_ssize_t i = 0; i < count; i++)
        put_u32(dst + 4 * i, (uint32_t)ids[i]);
#endif
    if (bad) {
        PyErr_Format(PyExc_ValueError, "token ids must be in [0, %llu]", MAX_TOKEN);
        return -1;
    }
    return 0;
}

/* chain_sequence(list_or_tuple, chunk_size, save_unfull, seed) -> list[bytes], or None
 * when an item is not an exact int (bools, numpy ints...: the caller's Python path
 * converts those). */
static PyObject *chain_sequence(PyObject *self, PyObject *args)
{
    PyObject *seq;
    Py_ssize_t chunk_size;
    int unfull;
    Py_buffer seed;
    (void)self;
    if (!PyArg_ParseTuple(args, "Onpy*", &seq, &chunk_size, &unfull, &seed))
        return NULL;
    PyObject *out = NULL;
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
        PyErr_SetString(PyExc_TypeError, "chain_sequence takes a list or a tuple");
    else
        out = chain(fill_items, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq),
                    chunk_size, unfull, &seed);
    PyBuffer_Release(&seed);
    return out;
}

/* chain_memory(address, n_tokens, kind, chunk_size, save_unfull, seed) -> list[bytes]
 * kind: "u32" (any value), "i32" or "i64" (values outside [0, 2**32) are a ValueError). */
static PyObject *chain_memory(PyObject *self, PyObject *args)
{
    unsigned long long address;
    Py_ssize_t n_tokens, chunk_size;
    const char *kind;
    int unfull;
    Py_buffer seed;
    (void)self;
    if (!PyArg_ParseTuple(args, "Knsnpy*", &address, &n_tokens, &kind, &chunk_size, &unfull,
                          &seed))
        return NULL;
    fill_fn fill = strcmp(kind, "u32") == 0   ? fill_u32
                   : strcmp(kind, "i32") == 0 ? fill_i32
                   : strcmp(kind, "i64") == 0 ? fill_i64
                                              : NULL;
    PyObject *out = NULL;
    if (n_tokens < 0 || fill == NULL)
        PyErr_SetString(PyExc_ValueError, "chain_memory: bad token count or kind");
    else if (address == 0 && n_tokens > 0) /* a tensor with no storage (ZeroTensor) */
        PyErr_SetString(PyExc_ValueError, "token tensor has no allocated storage");
    else
        out = chain(fill, (void *)(intptr_t)address, n_tokens, chunk_size, unfull, &seed);
    PyBuffer_Release(&seed);
    return out;
}

/* use_xxh3_128(address, probe, expected) -> bool: hash with the XXH3_128bits at address
 * from now on if its canonical digest of probe is expected (else keep the current one). */
static PyObject *use_xxh3_128(PyObject *self, PyObject *args)
{
    unsigned long long address;
    Py_buffer probe, expected;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ky*y*", &address, &probe, &expected))
        return NULL;
    int ok = 0;
    if (address != 0 && expected.len == DIGEST) {
        xxh3_128_fn fn = (xxh3_128_fn)(intptr_t)address;
        unsigned char got[DIGEST];
        canonical(got, fn(probe.buf, (size_t)probe.len));
        ok = memcmp(got, expected.buf, DIGEST) == 0;
        if (ok)
            xxh3_128 = fn;
    }
    PyBuffer_Release(&probe);
    PyBuffer_Release(&expected);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"use_xxh3_128", use_xxh3_128, METH_VARARGS,
     "Hash with the XXH3_128bits at an address if it agrees on a probe."},
    {"chain_sequence", chain_sequence, METH_VARARGS,
     "Chained xxh3-128 chunk hashes of a list or tuple of token ids."},
    {"chain_memory", chain_memory, METH_VARARGS,
     "Chained xxh3-128 chunk hashes of token ids in memory (uint32 or int64)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chain_hash", "Chained xxh3-128 token hashes.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__chain_hash(void) { return PyModule_Create(&module); }
