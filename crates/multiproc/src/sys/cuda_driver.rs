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
//! those bytes before the call returns.

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
];

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

impl Driver {
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
