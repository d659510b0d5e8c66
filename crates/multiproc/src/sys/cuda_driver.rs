//! The CUDA driver calls multiproc makes (feature `cuda`), as safe functions: the only
//! place that calls `cudarc::driver::sys` (FFI into the `libcuda` that cudarc loads at
//! run time). `crate::cuda` builds CUDA memory on these and has no unsafe code.
//!
//! # Safety
//!
//! cudarc loads `libcuda` on first use and panics when the library or one of its
//! symbols is missing, so nothing here calls it before [`driver`] has checked both
//! (with `libloading`, through cudarc's own loader); every other function takes the
//! `&Driver` that check returns. Every driver call is made with the device's primary
//! context current on the calling thread ([`Driver::bind`]). Device pointers are plain
//! integers to Rust, and every device range is checked against its [`Mapping`] before
//! a call. The only host memory the driver touches is that of the copies, which take
//! it as a [`SharedBytes`]: checked to be mapped for the borrow and as long as the
//! copy (and writable, for a copy to the host); the driver reads or writes exactly
//! those bytes before the call returns — but for an asynchronous copy ([`Transfer`]),
//! which takes host bytes it holds ([`HeldHostBytes`]: mapped while the value lives)
//! and drops them only once the copy is complete (its event waited for).
//!
//! Host memory registered with the driver ([`HostRegistration`], `cuMemHostRegister`)
//! is only named by address: the driver pins its pages and never touches them on our
//! behalf outside a copy. The registration is undone by the process that made it, in
//! its drop (the owner of the mapping drops it before unmapping).

use std::ffi::{CStr, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;

use super::memfd::human_bytes;
use super::shared_bytes::SharedBytes;
use crate::error::{Error, Result};

/// Every driver symbol called below (cudarc's loader panics on a missing one).
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2",
    "cuMemsetD8_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemHostGetFlags",
    "cuPointerGetAttribute",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamDestroy_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuStreamAddCallback",
];

/// `cuMemHostRegister` calls that succeeded in this process, and registrations undone
/// (for the diagnostics in `__testing`: a recycled block should cost one, once).
pub(crate) static HOST_REGISTRATIONS: [std::sync::atomic::AtomicU64; 2] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 2];

/// Set once `cuInit` has succeeded in this process: a `fork` child of this process
/// cannot use CUDA (see `check_fork`).
static INITIALISED: AtomicBool = AtomicBool::new(false);

/// The loaded, initialised driver: proof that cudarc's functions can be called.
pub(crate) struct Driver {
    /// One primary context per visible device, retained for the process's life.
    contexts: Vec<usize>,
    /// Each device's allocation granularity, once asked.
    granularities: Vec<OnceLock<usize>>,
}

/// Whether this process has initialised CUDA.
pub(crate) fn initialised() -> bool {
    INITIALISED.load(Ordering::Acquire)
}

/// The driver, loaded and initialised on first use; [`Error::CudaUnavailable`] with the
/// reason when there is none (no library, an old one, no device).
pub(crate) fn driver() -> Result<&'static Driver> {
    static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();
    match DRIVER.get_or_init(load) {
        Ok(d) => Ok(d),
        Err(reason) => Err(Error::CudaUnavailable {
            reason: reason.clone(),
        }),
    }
}

fn load() -> std::result::Result<Driver, String> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "the NVIDIA driver library (libcuda.so.1) was not found: install the NVIDIA \
                    driver, or add its directory to LD_LIBRARY_PATH"
                .into(),
        );
    }
    // SAFETY: the library is present (checked above), so `culib` loads it instead of
    // panicking; `get` only looks a symbol up.
    let lib = unsafe { sys::culib() };
    for name in SYMBOLS {
        // SAFETY: looking a symbol up does not call it; the type is never used.
        if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
            return Err(format!(
                "the NVIDIA driver library lacks {name}: it is older than CUDA 11.4; update the driver"
            ));
        }
    }
    // SAFETY: every symbol is present; cuInit takes flags 0.
    check(unsafe { sys::cuInit(0) }, || "cuInit".into()).map_err(|e| e.to_string())?;
    INITIALISED.store(true, Ordering::Release);
    let mut count = 0;
    // SAFETY: `count` is a valid out-pointer.
    check(unsafe { sys::cuDeviceGetCount(&mut count) }, || {
        "cuDeviceGetCount".into()
    })
    .map_err(|e| e.to_string())?;
    if count <= 0 {
        return Err(format!(
            "the NVIDIA driver sees no CUDA device (CUDA_VISIBLE_DEVICES={})",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
        ));
    }
    let mut contexts = Vec::new();
    for ordinal in 0..count {
        let mut dev = 0;
        // SAFETY: valid out-pointer; `ordinal` is below the count.
        check(unsafe { sys::cuDeviceGet(&mut dev, ordinal) }, || {
            format!("cuDeviceGet({ordinal})")
        })
        .map_err(|e| e.to_string())?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device; the context is retained for the life of
        // the process (never released), so it stays valid for every later call.
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) };
        check(r, || format!("cuDevicePrimaryCtxRetain(cuda:{ordinal})"))
            .map_err(|e| e.to_string())?;
        contexts.push(ctx as usize);
    }
    let granularities = contexts.iter().map(|_| OnceLock::new()).collect();
    Ok(Driver {
        contexts,
        granularities,
    })
}

/// The driver's name and text for a result code.
fn describe(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: valid out-pointers; the driver returns static strings or leaves null.
    let (a, b) = unsafe {
        (
            sys::cuGetErrorName(r, &mut name),
            sys::cuGetErrorString(r, &mut text),
        )
    };
    let read = |p: *const std::ffi::c_char, ok: sys::CUresult| {
        if ok == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
            // SAFETY: the driver returned a NUL-terminated static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        }
    };
    format!("{} ({})", read(name, a), read(text, b))
}

/// `Ok` for `CUDA_SUCCESS`, else an [`Error::Cuda`] naming the call.
fn check(r: sys::CUresult, call: impl FnOnce() -> String) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("{} failed: {}", call(), describe(r))))
    }
}

fn location(device: u32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device as i32,
    }
}

fn allocation_prop(device: u32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: location(device),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// A physical allocation's handle (`CUmemGenericAllocationHandle`), released on drop
/// (the memory itself lives on while it is mapped or exported anywhere).
pub(crate) struct Physical(sys::CUmemGenericAllocationHandle);

impl Drop for Physical {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuMemCreate or an import and is released once.
        // A failure cannot be acted on in drop; the driver frees it with the process.
        let _ = unsafe { sys::cuMemRelease(self.0) };
    }
}

/// A mapped range of device address space: `len` bytes at `ptr`, readable and writable
/// from its device. Unmapped and freed on drop.
pub(crate) struct Mapping {
    ptr: sys::CUdeviceptr,
    len: usize,
    device: u32,
}

impl Mapping {
    /// The first byte's device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The mapped length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Checks that `offset..offset + len` lies in the mapping; the device address.
    fn range(&self, offset: usize, len: usize, what: &str) -> Result<sys::CUdeviceptr> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::InvalidArgument(format!(
                "{what}: {len} bytes at offset {offset} reach past a CUDA allocation of {} bytes",
                self.len
            )));
        }
        Ok(self.ptr + offset as u64)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Ok(d) = driver() {
            if d.bind(self.device).is_ok() {
                // SAFETY: the range was reserved and mapped by `map` and is unmapped and
                // freed once, here; no storage refers to it any more (a `Mapping` is
                // owned by the memory every storage on it keeps alive).
                unsafe {
                    let _ = sys::cuMemUnmap(self.ptr, self.len);
                    let _ = sys::cuMemAddressFree(self.ptr, self.len);
                }
            }
        }
    }
}

/// Host memory page-locked for every CUDA context of this process
/// (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE`): `len` bytes at `ptr`.
/// Unregistered on drop, by the process that registered it (a `fork` child inherits
/// the value, not the registration).
#[derive(Debug)]
pub(crate) struct HostRegistration {
    ptr: usize,
    len: usize,
    device: u32,
    pid: u32,
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.pid != super::fork_local::cached_pid() {
            return;
        }
        if let Ok(d) = driver() {
            if d.bind(self.device).is_ok() {
                // SAFETY: the address was registered by `register_host` in this process
                // and is unregistered once, here.
                let r = unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) };
                HOST_REGISTRATIONS[1].fetch_add(1, Ordering::Relaxed);
                if let Err(e) = check(r, || "cuMemHostUnregister".into()) {
                    tracing::warn!("unregistering {} of pinned host memory: {e}", self.len);
                }
            }
        }
    }
}

/// Host bytes that stay mapped (readable) while the value lives: the source of a copy
/// that completes after the call that issues it ([`Transfer::copy`] holds it until
/// then).
pub(crate) trait HeldHostBytes: Send + Sync {
    /// The bytes, valid while `self` lives.
    fn bytes(&self) -> SharedBytes<'_>;
}

/// A CUDA stream of this process that never waits for the legacy default stream
/// (`CU_STREAM_NON_BLOCKING`), so copies on it overlap other work. Waited for and
/// destroyed on drop.
pub(crate) struct Stream {
    raw: usize,
    device: u32,
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(d) = driver() {
            if d.bind(self.device).is_ok() {
                // SAFETY: a stream made by `Driver::stream`, destroyed once, here, after
                // its work is done.
                unsafe {
                    let _ = sys::cuStreamSynchronize(self.raw as sys::CUstream);
                    let _ = sys::cuStreamDestroy_v2(self.raw as sys::CUstream);
                }
            }
        }
    }
}

/// Copies from host to device issued on a [`Stream`], and an event recorded after
/// them: [`wait`](Self::wait) returns once every copy is complete. The host bytes are
/// held until then; dropping a transfer waits for it first.
pub(crate) struct Transfer {
    stream: std::sync::Arc<Stream>,
    event: usize,
    recorded: bool,
    held: Vec<Box<dyn HeldHostBytes>>,
}

impl Transfer {
    /// Copies `src` to `offset` in `dst` on the transfer's stream; `src` is held until
    /// the copy is complete. From pinned host memory the copy runs while the caller
    /// goes on; from pageable memory the driver stages it (and may return later).
    pub(crate) fn copy(
        &mut self,
        dst: &Mapping,
        offset: usize,
        src: Box<dyn HeldHostBytes>,
    ) -> Result<()> {
        let bytes = src.bytes();
        let len = bytes.len();
        let d = dst.range(offset, len, "an asynchronous host-to-device copy")?;
        if dst.device != self.stream.device {
            return Err(Error::InvalidArgument(format!(
                "a copy to cuda:{} on a stream of cuda:{}",
                dst.device, self.stream.device
            )));
        }
        let host = bytes.as_ptr().cast_const().cast();
        driver()?.bind(dst.device)?;
        // SAFETY: the device range is mapped (checked above); the host range is `len`
        // readable bytes while `src` lives, and `src` is held (below) until the copy is
        // complete: `wait` (also run by drop) waits for the event recorded after it, or
        // the whole stream.
        let r =
            unsafe { sys::cuMemcpyHtoDAsync_v2(d, host, len, self.stream.raw as sys::CUstream) };
        self.held.push(src);
        check(r, || "cuMemcpyHtoDAsync".into())
    }

    /// Records the transfer's event after the copies issued so far.
    pub(crate) fn record(&mut self) -> Result<()> {
        driver()?.bind(self.stream.device)?;
        // SAFETY: an event and a stream of this context, both alive.
        let r = unsafe {
            sys::cuEventRecord(self.event as sys::CUevent, self.stream.raw as sys::CUstream)
        };
        check(r, || "cuEventRecord".into())?;
        self.recorded = true;
        Ok(())
    }

    /// A [`CopiesDone`] the driver sets once the copies issued so far are complete (or
    /// the context failed: [`wait`](Self::wait) then says why), from a thread of its
    /// own (`cuStreamAddCallback`, which, unlike `cuLaunchHostFunc`, is called on a
    /// device error too, so an awaited transfer cannot wait forever).
    pub(crate) fn copies_done(&mut self) -> Result<std::sync::Arc<CopiesDone>> {
        driver()?.bind(self.stream.device)?;
        let signal = std::sync::Arc::new(CopiesDone::default());
        let user = std::sync::Arc::into_raw(std::sync::Arc::clone(&signal));
        // SAFETY: a live stream of this context; `on_copies_done` takes back the reference
        // `user` carries, and the driver calls it exactly once (on success or error).
        let r = unsafe {
            sys::cuStreamAddCallback(
                self.stream.raw as sys::CUstream,
                Some(on_copies_done),
                user.cast_mut().cast(),
                0,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: the driver refused the callback, so the reference is still ours.
            drop(unsafe { std::sync::Arc::from_raw(user) });
        }
        check(r, || "cuStreamAddCallback".into())?;
        Ok(signal)
    }

    /// Waits until every copy issued is complete, then lets go of their host bytes.
    pub(crate) fn wait(&mut self) -> Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        driver()?.bind(self.stream.device)?;
        let r = if self.recorded {
            // SAFETY: an event recorded after every copy issued.
            unsafe { sys::cuEventSynchronize(self.event as sys::CUevent) }
        } else {
            // SAFETY: a live stream.
            unsafe { sys::cuStreamSynchronize(self.stream.raw as sys::CUstream) }
        };
        check(r, || "waiting for host-to-device copies".into())?;
        self.held.clear();
        Ok(())
    }
}

/// Whether the copies a [`Transfer::copies_done`] followed are complete, and who to wake
/// when they are: what an awaited transfer parks on instead of blocking its thread.
#[derive(Default)]
pub(crate) struct CopiesDone {
    done: AtomicBool,
    waker: std::sync::Mutex<Option<std::task::Waker>>,
}

impl CopiesDone {
    /// `Ready` once the driver has called back; until then `cx`'s waker is kept and
    /// woken from the driver's thread.
    #[cfg(feature = "async")]
    pub(crate) fn poll(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.done.load(Ordering::Acquire) {
            return std::task::Poll::Ready(());
        }
        *self.waker_slot() = Some(cx.waker().clone());
        // Checked again under the waker's registration: a callback between the load
        // above and the store found no waker to wake.
        if self.done.load(Ordering::Acquire) {
            return std::task::Poll::Ready(());
        }
        std::task::Poll::Pending
    }

    fn waker_slot(&self) -> std::sync::MutexGuard<'_, Option<std::task::Waker>> {
        self.waker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The driver's callback after a transfer's copies (`Transfer::copies_done`). It makes no
/// CUDA call (the driver forbids it) and blocks the stream only for the wake-up.
unsafe extern "C" fn on_copies_done(
    _stream: sys::CUstream,
    _status: sys::CUresult,
    user: *mut c_void,
) {
    // SAFETY: `user` is the reference `Transfer::copies_done` gave up for this one call.
    let signal = unsafe { std::sync::Arc::from_raw(user.cast_const().cast::<CopiesDone>()) };
    signal.done.store(true, Ordering::Release);
    let waker = signal.waker_slot().take();
    if let Some(waker) = waker {
        // An executor's wake that panics must not unwind into the driver's thread.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if self.wait().is_err() {
            // The copies' state is unknown: wait for the whole stream before the host
            // bytes may go (a stream that fails to synchronise is a dead context, which
            // reads nothing any more).
            if let Ok(d) = driver() {
                if d.bind(self.stream.device).is_ok() {
                    // SAFETY: a live stream.
                    let _ = unsafe { sys::cuStreamSynchronize(self.stream.raw as sys::CUstream) };
                }
            }
        }
        // SAFETY: the event was made by `Driver::transfer` and is destroyed once, here.
        let _ = unsafe { sys::cuEventDestroy_v2(self.event as sys::CUevent) };
    }
}

impl Driver {
    /// Page-locks `bytes` for every context (`cuMemHostRegister`, portable), with
    /// `device`'s context current. Registering pages that are registered already is
    /// the driver's `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
    pub(crate) fn register_host(
        &self,
        device: u32,
        bytes: SharedBytes<'_>,
    ) -> Result<HostRegistration> {
        self.bind(device)?;
        let len = bytes.len();
        // SAFETY: `len` mapped bytes (what a `SharedBytes` is); the driver only pins
        // their pages. The registration is undone by `HostRegistration`'s drop, which
        // the mapping's owner runs before unmapping.
        let r = unsafe {
            sys::cuMemHostRegister_v2(bytes.as_ptr().cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        check(r, || {
            format!(
                "page-locking {} of shared memory (cuMemHostRegister)",
                human_bytes(len as u64)
            )
        })?;
        HOST_REGISTRATIONS[0].fetch_add(1, Ordering::Relaxed);
        Ok(HostRegistration {
            ptr: bytes.as_ptr() as usize,
            len,
            device,
            pid: super::fork_local::cached_pid(),
        })
    }

    /// Whether the host address `ptr` is in page-locked memory the driver knows: its
    /// memory type is host memory (`cuPointerGetAttribute`, what torch's `is_pinned`
    /// asks through the runtime), or, failing that, `cuMemHostGetFlags` knows it.
    pub(crate) fn is_registered_host(&self, ptr: *const u8) -> bool {
        let mut kind: std::ffi::c_uint = 0;
        // SAFETY: a valid out-pointer of the attribute's type (`CUmemorytype`, an
        // unsigned int); the driver only looks the address up.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                (&mut kind as *mut std::ffi::c_uint).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr as sys::CUdeviceptr,
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS {
            return kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as std::ffi::c_uint;
        }
        let mut flags = 0;
        // SAFETY: a valid out-pointer; the driver only looks the address up.
        let r = unsafe { sys::cuMemHostGetFlags(&mut flags, ptr.cast_mut().cast()) };
        r == sys::CUresult::CUDA_SUCCESS
    }

    /// A new stream on `device` that does not wait for the default stream.
    pub(crate) fn stream(&self, device: u32) -> Result<std::sync::Arc<Stream>> {
        self.bind(device)?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flags are a documented value.
        let r = unsafe {
            sys::cuStreamCreate(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as std::ffi::c_uint,
            )
        };
        check(r, || format!("cuStreamCreate(cuda:{device})"))?;
        Ok(std::sync::Arc::new(Stream {
            raw: raw as usize,
            device,
        }))
    }

    /// A new transfer on `stream` (an event without timing).
    pub(crate) fn transfer(&self, stream: &std::sync::Arc<Stream>) -> Result<Transfer> {
        self.bind(stream.device)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flags are a documented value.
        let r = unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
            )
        };
        check(r, || "cuEventCreate".into())?;
        Ok(Transfer {
            stream: std::sync::Arc::clone(stream),
            event: event as usize,
            recorded: false,
            held: Vec::new(),
        })
    }

    /// The number of visible devices.
    pub(crate) fn device_count(&self) -> usize {
        self.contexts.len()
    }

    /// Checks `device` is visible; an error naming what this process sees otherwise.
    pub(crate) fn check_device(&self, device: u32, what: &str) -> Result<()> {
        if (device as usize) < self.contexts.len() {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "{what} names cuda:{device}, but this process sees {} CUDA device(s) \
             (CUDA_VISIBLE_DEVICES={})",
            self.contexts.len(),
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
        )))
    }

    /// Makes `device`'s primary context current on this thread.
    pub(crate) fn bind(&self, device: u32) -> Result<()> {
        self.check_device(device, "a CUDA call")?;
        let ctx = self.contexts[device as usize] as sys::CUcontext;
        // Set every time (it costs about as much as asking): other CUDA code on this
        // thread may have made another context current since our last call.
        // SAFETY: a retained primary context, valid for the life of the process.
        check(unsafe { sys::cuCtxSetCurrent(ctx) }, || {
            format!("cuCtxSetCurrent(cuda:{device})")
        })
    }

    /// Free and total memory of `device`, in bytes (`cuMemGetInfo`).
    pub(crate) fn mem_info(&self, device: u32) -> Result<(usize, usize)> {
        self.bind(device)?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers, a current context.
        let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        check(r, || format!("cuMemGetInfo(cuda:{device})"))?;
        Ok((free, total))
    }

    /// The allocation granularity of `device` for shareable allocations.
    pub(crate) fn granularity(&self, device: u32) -> Result<usize> {
        self.check_device(device, "a CUDA allocation")?;
        if let Some(&g) = self.granularities[device as usize].get() {
            return Ok(g);
        }
        let g = self.ask_granularity(device)?;
        Ok(*self.granularities[device as usize].get_or_init(|| g))
    }

    fn ask_granularity(&self, device: u32) -> Result<usize> {
        self.bind(device)?;
        let prop = allocation_prop(device);
        let mut granularity = 0;
        // SAFETY: valid out-pointer and property struct.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        check(r, || {
            format!("cuMemGetAllocationGranularity(cuda:{device})")
        })?;
        Ok(granularity.max(1))
    }

    /// A new physical allocation of `len` bytes (a multiple of the granularity) on
    /// `device`, exportable as a POSIX fd. Out of memory says how much is free.
    pub(crate) fn create(&self, device: u32, len: usize) -> Result<Physical> {
        self.bind(device)?;
        let prop = allocation_prop(device);
        let mut handle = 0;
        // SAFETY: valid out-pointer and property struct; flags must be 0.
        let r = unsafe { sys::cuMemCreate(&mut handle, len, &prop, 0) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let free = self
                .mem_info(device)
                .map(|(free, total)| {
                    format!(
                        "{} free of {}",
                        human_bytes(free as u64),
                        human_bytes(total as u64)
                    )
                })
                .unwrap_or_else(|e| format!("free memory unknown: {e}"));
            return Err(Error::Cuda(format!(
                "out of memory on cuda:{device}: cannot allocate {} ({free}); drop CUDA tensors \
                 you no longer need, call multiproc::cuda::empty_cache(), or use smaller ones",
                human_bytes(len as u64)
            )));
        }
        check(r, || {
            format!(
                "cuMemCreate of {} on cuda:{device}",
                human_bytes(len as u64)
            )
        })?;
        Ok(Physical(handle))
    }

    /// The allocation as a POSIX fd that another process can import.
    pub(crate) fn export(&self, physical: &Physical) -> Result<OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for a POSIX-fd handle type the out-pointer is an `int`.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                physical.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        check(r, || "cuMemExportToShareableHandle".into())?;
        if fd < 0 {
            return Err(Error::Cuda(format!(
                "cuMemExportToShareableHandle returned fd {fd}"
            )));
        }
        // SAFETY: the driver just created this fd for us; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Close-on-exec, like every fd of ours (a spawned worker gets fds by message).
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
            .map_err(|e| Error::os("setting FD_CLOEXEC on a CUDA export", e))?;
        Ok(fd)
    }

    /// The allocation an fd from another process refers to, and the device it is on.
    /// An fd that is not a CUDA export is an error.
    pub(crate) fn import(&self, fd: BorrowedFd<'_>, device: u32) -> Result<(Physical, u32)> {
        self.bind(device)?;
        let mut handle = 0;
        // SAFETY: for a POSIX-fd handle type the os handle is the fd's number, passed by
        // value in the pointer; the driver does not take ownership of it.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        check(r, || {
            format!(
                "importing fd {} as CUDA memory (cuMemImportFromShareableHandle; is it a CUDA \
                     export?)",
                fd.as_raw_fd()
            )
        })?;
        let physical = Physical(handle);
        let mut prop = allocation_prop(device);
        // SAFETY: valid out-pointer and handle.
        let r = unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, physical.0) };
        check(r, || "cuMemGetAllocationPropertiesFromHandle".into())?;
        let on = u32::try_from(prop.location.id).map_err(|_| {
            Error::InvalidMessage(format!(
                "a CUDA allocation reports device {}",
                prop.location.id
            ))
        })?;
        Ok((physical, on))
    }

    /// Reserves `len` bytes of address space on `device`, maps `physical` there and
    /// makes it readable and writable. A `len` beyond the allocation's size fails here.
    pub(crate) fn map(&self, physical: &Physical, device: u32, len: usize) -> Result<Mapping> {
        self.bind(device)?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; alignment 0 is the default, address 0 any.
        let r = unsafe { sys::cuMemAddressReserve(&mut ptr, len, 0, 0, 0) };
        check(r, || {
            format!(
                "reserving {} of CUDA address space",
                human_bytes(len as u64)
            )
        })?;
        // SAFETY: `ptr..ptr+len` was just reserved; map offset 0, flags 0.
        if let Err(e) = check(unsafe { sys::cuMemMap(ptr, len, 0, physical.0, 0) }, || {
            format!(
                "mapping {} of a CUDA allocation (cuMemMap; the allocation may be smaller)",
                human_bytes(len as u64)
            )
        }) {
            // SAFETY: the reservation above, not mapped, freed once.
            let _ = unsafe { sys::cuMemAddressFree(ptr, len) };
            return Err(e);
        }
        // From here on the mapping's drop unmaps and frees the range.
        let mapping = Mapping { ptr, len, device };
        let access = sys::CUmemAccessDesc {
            location: location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one access descriptor.
        check(unsafe { sys::cuMemSetAccess(ptr, len, &access, 1) }, || {
            "cuMemSetAccess".into()
        })?;
        Ok(mapping)
    }

    /// Waits for every operation on `device` (all streams of its context) to finish.
    pub(crate) fn synchronize(&self, device: u32) -> Result<()> {
        self.bind(device)?;
        // SAFETY: no arguments; a current context.
        check(unsafe { sys::cuCtxSynchronize() }, || {
            format!("cuCtxSynchronize(cuda:{device})")
        })
    }

    /// Sets `len` bytes at `offset` of `dst` to zero, and waits for it.
    pub(crate) fn zero(&self, dst: &Mapping, offset: usize, len: usize) -> Result<()> {
        let p = dst.range(offset, len, "zeroing CUDA memory")?;
        self.bind(dst.device)?;
        // SAFETY: the range is mapped on this device (checked above).
        check(unsafe { sys::cuMemsetD8_v2(p, 0, len) }, || {
            "cuMemsetD8".into()
        })?;
        self.synchronize(dst.device)
    }

    /// Copies `len` bytes between two mappings on one device, and waits for it.
    pub(crate) fn copy_device(
        &self,
        dst: (&Mapping, usize),
        src: (&Mapping, usize),
        len: usize,
    ) -> Result<()> {
        let d = dst.0.range(dst.1, len, "a device-to-device copy")?;
        let s = src.0.range(src.1, len, "a device-to-device copy")?;
        self.bind(dst.0.device)?;
        // SAFETY: both ranges are mapped (checked above); a device-wide copy.
        check(unsafe { sys::cuMemcpyDtoD_v2(d, s, len) }, || {
            "cuMemcpyDtoD".into()
        })?;
        self.synchronize(dst.0.device)
    }

    /// Copies the host bytes `src` to `offset` in `dst`, and waits for it.
    pub(crate) fn copy_from_host(
        &self,
        dst: &Mapping,
        offset: usize,
        src: SharedBytes<'_>,
    ) -> Result<()> {
        let len = src.len();
        let d = dst.range(offset, len, "a host-to-device copy")?;
        self.bind(dst.device)?;
        let host = src.as_ptr().cast_const().cast();
        // SAFETY: the device range is mapped (checked above); the host range is `len`
        // readable bytes for the duration of the call (what a `SharedBytes` is).
        let r = unsafe { sys::cuMemcpyHtoD_v2(d, host, len) };
        check(r, || "cuMemcpyHtoD".into())?;
        self.synchronize(dst.device)
    }

    /// Copies `dst.len()` bytes at `offset` in `src` into the host bytes `dst`, which
    /// must be writable.
    pub(crate) fn copy_to_host(
        &self,
        dst: SharedBytes<'_>,
        src: &Mapping,
        offset: usize,
    ) -> Result<()> {
        let len = dst.len();
        if !dst.is_writable() {
            return Err(Error::Tensor(
                "a device-to-host copy into read-only host memory".into(),
            ));
        }
        let s = src.range(offset, len, "a device-to-host copy")?;
        self.bind(src.device)?;
        // SAFETY: the device range is mapped (checked above); the host range is `len`
        // writable bytes for the duration of the call (a writable `SharedBytes`, checked
        // above). cuMemcpyDtoH returns once the bytes are in host memory.
        check(
            unsafe { sys::cuMemcpyDtoH_v2(dst.as_ptr().cast(), s, len) },
            || "cuMemcpyDtoH".into(),
        )
    }
}
