/* Kernel trace of a CUDA process through CUPTI's activity API, loaded by
 * the driver itself (CUDA_INJECTION64_PATH=/path/libkiln_trace.so): every
 * kernel's start, duration, grid width, stream and name, graph-replayed
 * kernels included, with their real overlaps, written as CSV to
 * $KILN_TRACE_OUT (default /tmp/kiln-trace.csv) when the process exits.
 * Nsight Systems would give the same, but the device machines have no
 * working nsys; Nsight Compute serializes kernels and needs graphs off.
 * Built there by scripts/step_trace.sh; KREC names the kernel record
 * type of the installed CUPTI. */
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef KREC
#define KREC CUpti_ActivityKernel9
#endif

#define BUFFER_BYTES (16u << 20)

static FILE *out;
/* CUPTI completes buffers on a thread of its own, which may still be at it
 * while the process exits. */
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                               size_t valid) {
    CUpti_Activity *rec = NULL;
    (void)ctx;
    (void)stream;
    (void)size;
    pthread_mutex_lock(&out_lock);
    while (out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
            rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const KREC *k = (const KREC *)rec;
            fprintf(out, "%llu,%llu,%d,%u,%s\n", (unsigned long long)k->start,
                    (unsigned long long)(k->end - k->start), k->gridX, k->streamId,
                    k->name ? k->name : "?");
        }
    }
    pthread_mutex_unlock(&out_lock);
    free(buffer);
}

static void finish(void) {
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityFlushAll(1);
    pthread_mutex_lock(&out_lock);
    if (out) {
        fclose(out);
        out = NULL;
    }
    pthread_mutex_unlock(&out_lock);
}

/* Called by the driver at cuInit. */
int InitializeInjection(void) {
    const char *path = getenv("KILN_TRACE_OUT");
    out = fopen(path ? path : "/tmp/kiln-trace.csv", "w");
    if (!out) return 0;
    fprintf(out, "Start (ns),Duration (ns),GrdX,Strm,Name\n");
    if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "kiln_trace: CUPTI refused kernel tracing\n");
        return 0;
    }
    atexit(finish);
    return 1;
}
