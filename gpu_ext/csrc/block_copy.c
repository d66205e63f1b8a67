/* Whole-block copies between a paged KV cache and contiguous chunk buffers, on CPU.
 *
 * torch has no CPU kernel that copies whole slices to indexed destinations: its
 * index_put_/index_copy_ move one element at a time, and every torch call costs
 * microseconds of dispatch. copy_slots checks a slot mapping, finds its leading whole
 * blocks and memcpys each block's contiguous runs, spread over a few threads, with the
 * GIL released.
 *
 * The caller (gpu_ext/native_copy.py) describes both sides in bytes: the cache by one
 * base address per layer and a block stride, the chunk by a base, a layer stride and a
 * token stride; inside a block, up to three outer dimensions with each side's strides
 * and the length of the innermost contiguous run. It has checked the buffers' shapes;
 * this code checks the slots.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 64

typedef struct {
    const int64_t *cache_layers; /* base address of each layer moved */
    char *chunk;                 /* the chunk's first token of the first layer moved */
    Py_ssize_t chunk_layer;      /* bytes between layers in the chunk */
    const int64_t *blocks;       /* cache block of each chunk block */
    Py_ssize_t n_layers, n_blocks;
    int to_cache;                /* 1: chunk -> cache (scatter); 0: cache -> chunk (gather) */
    Py_ssize_t cache_block, chunk_block; /* bytes between blocks */
    Py_ssize_t dims[3];
    Py_ssize_t cache_strides[3], chunk_strides[3];
    Py_ssize_t run; /* bytes of the innermost contiguous run */
    int stream;     /* non-temporal stores (see copy_run) */
} copy_plan;

typedef struct {
    const copy_plan *plan;
    Py_ssize_t first, last; /* work items [first, last): item = layer * n_blocks + j */
} copy_share;

/* A copy far larger than the caches gains nothing from caching its destination, and
 * ordinary stores first read every destination line (read for ownership): three memory
 * transfers per byte where plain copy_ of a large tensor, whose memcpy switches to
 * non-temporal stores, pays two. Streaming stores skip that read. */
static inline void copy_run(char *dst, const char *src, Py_ssize_t n, int stream)
{
#if defined(__SSE2__)
    if (stream && ((uintptr_t)dst & 15) == 0 && (n & 63) == 0) {
        for (Py_ssize_t i = 0; i < n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, (size_t)n);
}

static void copy_block(const copy_plan *p, char *dst, const char *src, const Py_ssize_t *ds,
                       const Py_ssize_t *ss)
{
    for (Py_ssize_t a = 0; a < p->dims[0]; a++) {
        char *d0 = dst + a * ds[0];
        const char *s0 = src + a * ss[0];
        for (Py_ssize_t b = 0; b < p->dims[1]; b++) {
            char *d1 = d0 + b * ds[1];
            const char *s1 = s0 + b * ss[1];
            for (Py_ssize_t c = 0; c < p->dims[2]; c++)
                copy_run(d1 + c * ds[2], s1 + c * ss[2], p->run, p->stream);
        }
    }
}

static void *copy_items(void *arg)
{
    const copy_share *share = (const copy_share *)arg;
    const copy_plan *p = share->plan;
    for (Py_ssize_t item = share->first; item < share->last; item++) {
        Py_ssize_t layer = item / p->n_blocks, j = item % p->n_blocks;
        char *cache = (char *)(intptr_t)p->cache_layers[layer] + p->blocks[j] * p->cache_block;
        char *chunk = p->chunk + layer * p->chunk_layer + j * p->chunk_block;
        if (p->to_cache)
            copy_block(p, cache, chunk, p->cache_strides, p->chunk_strides);
        else
            copy_block(p, chunk, cache, p->chunk_strides, p->cache_strides);
    }
#if defined(__SSE2__)
    if (p->stream)
        _mm_sfence(); /* streamed stores visible before the caller reads the memory */
#endif
    return NULL;
}

static void run_plan(const copy_plan *p, int threads)
{
    Py_ssize_t items = p->n_layers * p->n_blocks;
    copy_share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > items)
        threads = (int)(items > 0 ? items : 1);
    for (int t = 0; t < threads; t++) {
        shares[t].plan = p;
        shares[t].first = items * t / threads;
        shares[t].last = items * (t + 1) / threads;
    }
    /* Share 0 runs on this thread; a thread that cannot start runs its share here too. */
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, copy_items, &shares[t]) == 0;
    copy_items(&shares[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            copy_items(&shares[t]);
    }
}

/* copy_slots(cache_layers, chunk, chunk_layer, n_layers, slots, n_slots, block_size,
 *            num_slots, to_cache, cache_block, chunk_token, (d0, d1, d2),
 *            (cache strides), (chunk strides), run, threads, parallel_bytes, stream_bytes)
 *
 * Checks that every slot lies in [0, num_slots) (ValueError otherwise, nothing copied),
 * then copies the longest leading run of whole blocks -- groups of block_size slots
 * b*block_size + 0, 1, ... -- between the cache and the chunk, and returns how many
 * tokens that covered; the caller moves the rest another way. Addresses are ints
 * (data_ptr()); cache_layers and slots point at int64 arrays. */
static PyObject *copy_slots(PyObject *self, PyObject *args)
{
    unsigned long long cache_layers, chunk, slots_addr;
    Py_ssize_t n_slots, block_size, num_slots, chunk_token, parallel_bytes, stream_bytes;
    copy_plan p;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnnKnnnpnn(nnn)(nnn)(nnn)ninn", &cache_layers, &chunk,
                          &p.chunk_layer, &p.n_layers, &slots_addr, &n_slots, &block_size,
                          &num_slots, &p.to_cache, &p.cache_block, &chunk_token, &p.dims[0],
                          &p.dims[1], &p.dims[2], &p.cache_strides[0], &p.cache_strides[1],
                          &p.cache_strides[2], &p.chunk_strides[0], &p.chunk_strides[1],
                          &p.chunk_strides[2], &p.run, &threads, &parallel_bytes,
                          &stream_bytes))
        return NULL;
    if (p.n_layers < 0 || n_slots < 0 || block_size < 1 || p.run < 0 || p.dims[0] < 0 ||
        p.dims[1] < 0 || p.dims[2] < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_slots: negative size");
        return NULL;
    }
    const int64_t *slots = (const int64_t *)(intptr_t)slots_addr;
    int64_t low = 0, high = 0;
    for (Py_ssize_t i = 0; i < n_slots; i++) {
        int64_t v = slots[i];
        if (i == 0 || v < low)
            low = v;
        if (i == 0 || v > high)
            high = v;
    }
    if (n_slots && (low < 0 || high >= num_slots)) {
        PyErr_Format(PyExc_ValueError, "slot_mapping holds %lld..%lld, outside [0, %zd)",
                     (long long)low, (long long)high, num_slots);
        return NULL;
    }
    Py_ssize_t groups = n_slots / block_size, count = 0;
    int64_t *blocks = PyMem_Malloc((size_t)(groups > 0 ? groups : 1) * sizeof(int64_t));
    if (blocks == NULL)
        return PyErr_NoMemory();
    for (; count < groups; count++) {
        const int64_t *g = slots + count * block_size;
        if (g[0] % block_size)
            break;
        Py_ssize_t k = 1;
        while (k < block_size && g[k] == g[0] + k)
            k++;
        if (k < block_size)
            break;
        blocks[count] = g[0] / block_size;
    }
    p.cache_layers = (const int64_t *)(intptr_t)cache_layers;
    p.chunk = (char *)(intptr_t)chunk;
    p.blocks = blocks;
    p.n_blocks = count;
    p.chunk_block = chunk_token * block_size;
    Py_ssize_t nbytes = p.n_layers * count * p.dims[0] * p.dims[1] * p.dims[2] * p.run;
    p.stream = nbytes >= stream_bytes;
    if (nbytes < parallel_bytes || threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (count && p.n_layers) {
        Py_BEGIN_ALLOW_THREADS
        run_plan(&p, threads);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(blocks);
    return PyLong_FromSsize_t(count * block_size);
}

static PyMethodDef methods[] = {
    {"copy_slots", copy_slots, METH_VARARGS,
     "Check slots, copy the leading whole blocks between a paged cache and a chunk."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_block_copy", "Whole-block KV copies (CPU).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__block_copy(void) { return PyModule_Create(&module); }
