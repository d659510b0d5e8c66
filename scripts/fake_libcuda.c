/*
 * A stand-in for the NVIDIA driver library (libcuda.so.1), in host memory, for testing
 * the logic of multiproc's `cuda` feature on machines without a GPU: the wire form of
 * CUDA handles, leases and the pool, identity across processes, views and copies.
 * It is NOT CUDA: "device memory" is a memfd mapped into the process, and "device
 * addresses" are host addresses. It implements only the calls multiproc makes, with
 * the same contracts where a test can tell (allocations are whole 2 MiB granules,
 * exports are fds that keep the memory alive, an fd that is not an export is refused,
 * mapping more than the allocation fails).
 *
 *     cc -shared -fPIC -o target/fake-cuda/libcuda.so.1 scripts/fake_libcuda.c
 *     LD_LIBRARY_PATH=target/fake-cuda cargo test -p multiproc --features cuda \
 *       --test cuda_tensors --test cuda_sharing --test cuda_loader -- --include-ignored
 *
 * See scripts/cuda_fake_check.sh, which does both. "Free memory" is 64 GiB less every
 * fake allocation that some process still holds (an fd or a mapping), so a test that
 * watches memory come back when its last holder dies means something here too.
 *
 * Page-locked host memory (cuMemHostRegister) is a table of registered ranges with the
 * driver's refusals: pages registered twice are CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
 * unregistering an address that is not a registration's start is
 * CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, a range that is not mapped is
 * CUDA_ERROR_INVALID_VALUE. Tests read its counters with fake_cuda_host_counts (a symbol
 * the real driver lacks), including registrations whose memory was unmapped before they
 * were undone (a leak the real driver would keep pinned).
 *
 * Streams are queues: an asynchronous copy on a stream other than the default one runs
 * only when the stream, an event recorded on it, or the context is synchronised. So a
 * caller that reads the destination, or lets the source go, before waiting sees the
 * wrong bytes or crashes here — stricter than a GPU, which may well have finished.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SUCCESS 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define INVALID_DEVICE 101
#define INVALID_HANDLE 400
#define HOST_MEMORY_ALREADY_REGISTERED 712
#define HOST_MEMORY_NOT_REGISTERED 713

#define GRANULE (2ull << 20)
#define TOTAL (64ull << 30)
#define MAX_HANDLES 4096

typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUhandle;

/* CUmemAllocationProp as laid out by the driver's headers. */
typedef struct {
    unsigned type;
    unsigned requested_handle_types;
    struct {
        unsigned type;
        int id;
    } location;
    void *win32_handle_metadata;
    unsigned char alloc_flags[8];
} Prop;

static int handles[MAX_HANDLES]; /* fd + 1 of each live handle, 0 when free */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int device_count(void) {
    const char *n = getenv("FAKE_CUDA_DEVICES");
    return n ? atoi(n) : 1;
}

static CUhandle put_handle(int fd) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_HANDLES; i++) {
        if (handles[i] == 0) {
            handles[i] = fd + 1;
            pthread_mutex_unlock(&lock);
            return (CUhandle)i + 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

static int handle_fd(CUhandle h) {
    if (h == 0 || h > MAX_HANDLES) return -1;
    return handles[h - 1] - 1;
}

/* The device an export belongs to, from its memfd name ("fake-cuda-<device>"); -1
 * when the fd is not one of ours. */
static int export_device(int fd) {
    char path[64], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0) return -1;
    target[n] = 0;
    int device;
    if (sscanf(target, "/memfd:fake-cuda-%d", &device) != 1) return -1;
    return device;
}

int cuInit(unsigned flags) { return flags == 0 ? SUCCESS : INVALID_VALUE; }

int cuDeviceGetCount(int *count) {
    *count = device_count();
    return SUCCESS;
}

int cuDeviceGet(int *device, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return INVALID_DEVICE;
    *device = ordinal;
    return SUCCESS;
}

int cuDevicePrimaryCtxRetain(void **ctx, int device) {
    *ctx = (void *)(intptr_t)(device + 1);
    return SUCCESS;
}

int cuCtxSetCurrent(void *ctx) { return ctx ? SUCCESS : INVALID_VALUE; }

static void flush_all_streams(void);

int cuCtxSynchronize(void) {
    flush_all_streams();
    return SUCCESS;
}

static const char *name_of(int e) {
    switch (e) {
    case SUCCESS: return "CUDA_SUCCESS";
    case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case HOST_MEMORY_ALREADY_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case HOST_MEMORY_NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    default: return "CUDA_ERROR_UNKNOWN";
    }
}

int cuGetErrorName(int e, const char **s) {
    *s = name_of(e);
    return SUCCESS;
}

int cuGetErrorString(int e, const char **s) {
    *s = e == SUCCESS ? "no error" : "fake libcuda error";
    return SUCCESS;
}

/* "Device memory in use": every fake allocation some process on the machine still holds
 * through an fd (handle, export) or a mapping, counted once by inode — the driver's rule
 * for when an exported allocation's memory is freed. */
#define MAX_SEEN 8192
static unsigned long long seen[MAX_SEEN];
static int nseen;

static int first_sight(unsigned long long ino) {
    for (int i = 0; i < nseen; i++)
        if (seen[i] == ino) return 0;
    if (nseen < MAX_SEEN) seen[nseen++] = ino;
    return 1;
}

static size_t bytes_in_use(void) {
    size_t used = 0;
    char path[512], target[512];
    DIR *proc = opendir("/proc");
    if (!proc) return 0;
    pthread_mutex_lock(&lock);
    nseen = 0;
    struct dirent *p;
    while ((p = readdir(proc))) {
        if (p->d_name[0] < '0' || p->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/%s/fd", p->d_name);
        DIR *fds = opendir(path);
        if (fds) {
            struct dirent *f;
            while ((f = readdir(fds))) {
                snprintf(path, sizeof path, "/proc/%s/fd/%s", p->d_name, f->d_name);
                ssize_t n = readlink(path, target, sizeof target - 1);
                if (n <= 0) continue;
                target[n] = 0;
                struct stat st;
                if (strncmp(target, "/memfd:fake-cuda-", 17) == 0 && stat(path, &st) == 0 &&
                    first_sight((unsigned long long)st.st_ino))
                    used += (size_t)st.st_size;
            }
            closedir(fds);
        }
        snprintf(path, sizeof path, "/proc/%s/maps", p->d_name);
        FILE *maps = fopen(path, "r");
        if (maps) {
            char line[1024];
            while (fgets(line, sizeof line, maps)) {
                unsigned long start, end, ino;
                char name[512] = "";
                if (sscanf(line, "%lx-%lx %*s %*s %*s %lu %511s", &start, &end, &ino, name) == 4 &&
                    strncmp(name, "/memfd:fake-cuda-", 17) == 0 && first_sight(ino))
                    used += end - start;
            }
            fclose(maps);
        }
    }
    pthread_mutex_unlock(&lock);
    closedir(proc);
    return used;
}

int cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    size_t used = bytes_in_use();
    *total = TOTAL;
    *free_bytes = used < TOTAL ? TOTAL - used : 0;
    return SUCCESS;
}

int cuMemGetAllocationGranularity(size_t *granularity, const Prop *prop, int option) {
    (void)prop;
    (void)option;
    *granularity = GRANULE;
    return SUCCESS;
}

int cuMemCreate(CUhandle *handle, size_t size, const Prop *prop, unsigned long long flags) {
    if (flags != 0 || size == 0 || size % GRANULE != 0) return INVALID_VALUE;
    if (prop->location.id < 0 || prop->location.id >= device_count()) return INVALID_DEVICE;
    if (size > TOTAL) return OUT_OF_MEMORY;
    char name[32];
    snprintf(name, sizeof name, "fake-cuda-%d", prop->location.id);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    *handle = put_handle(fd);
    if (*handle == 0) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    return SUCCESS;
}

int cuMemRelease(CUhandle handle) {
    int fd = handle_fd(handle);
    if (fd < 0) return INVALID_HANDLE;
    close(fd);
    pthread_mutex_lock(&lock);
    handles[handle - 1] = 0;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

int cuMemExportToShareableHandle(void *out, CUhandle handle, unsigned type, unsigned long long flags) {
    int fd = handle_fd(handle);
    if (fd < 0) return INVALID_HANDLE;
    if (type != 1 || flags != 0) return INVALID_VALUE;
    int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return OUT_OF_MEMORY;
    *(int *)out = copy;
    return SUCCESS;
}

int cuMemImportFromShareableHandle(CUhandle *handle, void *os_handle, unsigned type) {
    int fd = (int)(intptr_t)os_handle;
    if (type != 1) return INVALID_VALUE;
    if (export_device(fd) < 0) return INVALID_VALUE;
    int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return OUT_OF_MEMORY;
    *handle = put_handle(copy);
    return *handle ? SUCCESS : OUT_OF_MEMORY;
}

int cuMemGetAllocationPropertiesFromHandle(Prop *prop, CUhandle handle) {
    int fd = handle_fd(handle);
    if (fd < 0) return INVALID_HANDLE;
    memset(prop, 0, sizeof *prop);
    prop->type = 1;
    prop->requested_handle_types = 1;
    prop->location.type = 1;
    prop->location.id = export_device(fd);
    return SUCCESS;
}

int cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)align;
    (void)addr;
    if (flags != 0 || size == 0) return INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}

int cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    return munmap((void *)(uintptr_t)ptr, size) == 0 ? SUCCESS : INVALID_VALUE;
}

int cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUhandle handle, unsigned long long flags) {
    int fd = handle_fd(handle);
    if (fd < 0) return INVALID_HANDLE;
    struct stat st;
    if (offset != 0 || flags != 0 || fstat(fd, &st) != 0 || size > (size_t)st.st_size)
        return INVALID_VALUE;
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0);
    return p == MAP_FAILED ? OUT_OF_MEMORY : SUCCESS;
}

int cuMemUnmap(CUdeviceptr ptr, size_t size) {
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return p == MAP_FAILED ? INVALID_VALUE : SUCCESS;
}

int cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    (void)desc;
    if (count != 1) return INVALID_VALUE;
    return mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) == 0 ? SUCCESS
                                                                              : INVALID_VALUE;
}

int cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    memcpy((void *)(uintptr_t)dst, src, n);
    return SUCCESS;
}

int cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return SUCCESS;
}

int cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return SUCCESS;
}

int cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    memset((void *)(uintptr_t)dst, value, n);
    return SUCCESS;
}

/* ----- page-locked host memory ----- */

#define MAX_REGISTERED 4096
#define PAGE 4096ull

typedef struct {
    uintptr_t base;  /* as passed to cuMemHostRegister */
    uintptr_t first; /* page-rounded range */
    uintptr_t end;
    unsigned flags;
} Registration;

static Registration registered[MAX_REGISTERED];
static int nregistered;
/* registrations made, undone, refused as already registered, and undone after their
 * memory was unmapped */
static long long host_counts[4];

static int is_mapped(uintptr_t first, uintptr_t end) {
    return msync((void *)first, end - first, MS_ASYNC) == 0;
}

int cuMemHostRegister_v2(void *p, size_t size, unsigned flags) {
    if (p == NULL || size == 0 || (flags & ~0xfu) != 0) return INVALID_VALUE;
    uintptr_t first = (uintptr_t)p & ~(PAGE - 1);
    uintptr_t end = ((uintptr_t)p + size + PAGE - 1) & ~(PAGE - 1);
    if (!is_mapped(first, end)) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nregistered; i++) {
        if (registered[i].first < end && first < registered[i].end) {
            host_counts[2]++;
            pthread_mutex_unlock(&lock);
            return HOST_MEMORY_ALREADY_REGISTERED;
        }
    }
    if (nregistered == MAX_REGISTERED) {
        pthread_mutex_unlock(&lock);
        return OUT_OF_MEMORY;
    }
    registered[nregistered++] = (Registration){(uintptr_t)p, first, end, flags};
    host_counts[0]++;
    pthread_mutex_unlock(&lock);
    return SUCCESS;
}

int cuMemHostUnregister(void *p) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nregistered; i++) {
        if (registered[i].base == (uintptr_t)p) {
            if (!is_mapped(registered[i].first, registered[i].end)) host_counts[3]++;
            registered[i] = registered[--nregistered];
            host_counts[1]++;
            pthread_mutex_unlock(&lock);
            return SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return HOST_MEMORY_NOT_REGISTERED;
}

int cuMemHostGetFlags(unsigned *flags, void *p) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nregistered; i++) {
        if (registered[i].first <= (uintptr_t)p && (uintptr_t)p < registered[i].end) {
            *flags = registered[i].flags;
            pthread_mutex_unlock(&lock);
            return SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return INVALID_VALUE;
}

/* Only the memory type of registered host memory (CU_MEMORYTYPE_HOST); any other address
 * is CUDA_ERROR_INVALID_VALUE, as pageable memory is on a GPU. */
int cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    if (attribute != 2) return INVALID_VALUE; /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */
    unsigned flags;
    if (cuMemHostGetFlags(&flags, (void *)(uintptr_t)ptr) == SUCCESS) {
        *(unsigned *)data = 1; /* CU_MEMORYTYPE_HOST */
        return SUCCESS;
    }
    return INVALID_VALUE;
}

/* Not CUDA: the stand-in's counters, for tests. out[0] registrations made, out[1]
 * undone, out[2] refused as already registered, out[3] undone after their memory was
 * unmapped, out[4] registered now. */
void fake_cuda_host_counts(long long out[5]) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 4; i++) out[i] = host_counts[i];
    out[4] = nregistered;
    pthread_mutex_unlock(&lock);
}

/* ----- streams and events: queues of copies run when synchronised ----- */

typedef struct {
    CUdeviceptr dst;
    const void *src;
    size_t n;
} Copy;

typedef struct {
    Copy *ops;
    size_t len, cap;
    int live;
} Stream;

#define MAX_STREAMS 256
static Stream *streams[MAX_STREAMS];
static pthread_mutex_t stream_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
    Stream *stream;
} Event;

static void flush_locked(Stream *s) {
    for (size_t i = 0; i < s->len; i++)
        memcpy((void *)(uintptr_t)s->ops[i].dst, s->ops[i].src, s->ops[i].n);
    s->len = 0;
}

static void flush_all_streams(void) {
    pthread_mutex_lock(&stream_lock);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i]) flush_locked(streams[i]);
    pthread_mutex_unlock(&stream_lock);
}

int cuStreamCreate(void **out, unsigned flags) {
    if (flags > 1) return INVALID_VALUE;
    Stream *s = calloc(1, sizeof *s);
    if (!s) return OUT_OF_MEMORY;
    pthread_mutex_lock(&stream_lock);
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (!streams[i]) {
            streams[i] = s;
            pthread_mutex_unlock(&stream_lock);
            *out = s;
            return SUCCESS;
        }
    }
    pthread_mutex_unlock(&stream_lock);
    free(s);
    return OUT_OF_MEMORY;
}

static int known_stream(Stream *s) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i] == s) return 1;
    return 0;
}

int cuStreamSynchronize(void *stream) {
    pthread_mutex_lock(&stream_lock);
    if (stream && !known_stream(stream)) {
        pthread_mutex_unlock(&stream_lock);
        return INVALID_HANDLE;
    }
    if (stream) flush_locked(stream);
    pthread_mutex_unlock(&stream_lock);
    return SUCCESS;
}

int cuStreamDestroy_v2(void *stream) {
    pthread_mutex_lock(&stream_lock);
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (streams[i] == stream) {
            flush_locked(stream);
            streams[i] = NULL;
            pthread_mutex_unlock(&stream_lock);
            free(((Stream *)stream)->ops);
            free(stream);
            return SUCCESS;
        }
    }
    pthread_mutex_unlock(&stream_lock);
    return INVALID_HANDLE;
}

int cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    if (!stream) {
        memcpy((void *)(uintptr_t)dst, src, n);
        return SUCCESS;
    }
    pthread_mutex_lock(&stream_lock);
    Stream *s = stream;
    if (!known_stream(s)) {
        pthread_mutex_unlock(&stream_lock);
        return INVALID_HANDLE;
    }
    if (s->len == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 16;
        Copy *ops = realloc(s->ops, cap * sizeof *ops);
        if (!ops) {
            pthread_mutex_unlock(&stream_lock);
            return OUT_OF_MEMORY;
        }
        s->ops = ops;
        s->cap = cap;
    }
    s->ops[s->len++] = (Copy){dst, src, n};
    pthread_mutex_unlock(&stream_lock);
    return SUCCESS;
}

/* A stream callback runs on a thread of the stand-in's own, as the driver's do: 30 ms
 * later (so a caller that awaits it really waits), after running the
 * stream's queued copies (all of them, as cuEventSynchronize does). It is called
 * exactly once, with CUDA_SUCCESS, also when the stream was destroyed meanwhile (its
 * copies ran then). */
typedef void (*StreamCallback)(void *stream, int status, void *user);

typedef struct {
    Stream *stream;
    StreamCallback callback;
    void *user;
} PendingCallback;

static void *run_callback(void *arg) {
    PendingCallback *c = arg;
    struct timespec later = {0, 30 * 1000000};
    nanosleep(&later, NULL);
    pthread_mutex_lock(&stream_lock);
    if (known_stream(c->stream)) flush_locked(c->stream);
    pthread_mutex_unlock(&stream_lock);
    c->callback(c->stream, SUCCESS, c->user);
    free(c);
    return NULL;
}

int cuStreamAddCallback(void *stream, StreamCallback callback, void *user, unsigned flags) {
    if (!callback || flags != 0) return INVALID_VALUE;
    pthread_mutex_lock(&stream_lock);
    int known = stream && known_stream(stream);
    pthread_mutex_unlock(&stream_lock);
    if (!known) return INVALID_HANDLE;
    PendingCallback *c = malloc(sizeof *c);
    if (!c) return OUT_OF_MEMORY;
    *c = (PendingCallback){stream, callback, user};
    pthread_t thread;
    if (pthread_create(&thread, NULL, run_callback, c) != 0) {
        free(c);
        return OUT_OF_MEMORY;
    }
    pthread_detach(thread);
    return SUCCESS;
}

int cuEventCreate(void **out, unsigned flags) {
    (void)flags;
    Event *e = calloc(1, sizeof *e);
    if (!e) return OUT_OF_MEMORY;
    *out = e;
    return SUCCESS;
}

int cuEventRecord(void *event, void *stream) {
    ((Event *)event)->stream = stream;
    return SUCCESS;
}

int cuEventSynchronize(void *event) {
    Event *e = event;
    /* Runs the whole stream: copies issued after the record too (allowed: they would
     * finish eventually anyway). */
    return e->stream ? cuStreamSynchronize(e->stream) : SUCCESS;
}

int cuEventDestroy_v2(void *event) {
    free(event);
    return SUCCESS;
}

/* ----- modules and kernels: loaded and launched, never run (examples only) ----- */

int cuModuleLoadData(void **module, const void *image) {
    if (!image) return INVALID_VALUE;
    *module = (void *)1;
    return SUCCESS;
}

int cuModuleGetFunction(void **function, void *module, const char *name) {
    if (!module || !name) return INVALID_VALUE;
    *function = (void *)2;
    return SUCCESS;
}

int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)stream;
    (void)params; (void)extra;
    return f ? SUCCESS : INVALID_HANDLE;
}
