//! CUDA memory that other processes can map: [`CudaMemory`] (one VMM allocation, mapped
//! here), the pool that recycles this process's allocations, the per-process map of
//! allocations by id, and their wire form.
//!
//! An allocation is made with `cuMemCreate` (POSIX-fd shareable), exported once as an
//! fd, and mapped here; its `Physical` handle is released at once, so the memory lives
//! exactly while some process maps it or holds an fd of its export (the driver's rule),
//! like a memfd. A handle on the wire carries that fd, a *lease* (see `sys::lease`), the
//! allocation's random 128-bit id, its device and length.
//!
//! Small storages are carved out of a one-granule *arena*, which is one allocation to
//! everything below: its lease, its use and its recycling cover every slice.
//!
//! Who holds an allocation is counted by leases, not by a counter in shared memory: a
//! counter cannot tell that a holder was SIGKILLed, a lease is dropped by the kernel.
//! Each process that maps an imported allocation holds one lease; each message in
//! flight holds one (it dies with the message if the message is never received). The
//! pool hands an allocation out again only when no storage here uses it and no lease
//! is held anywhere, so no process can still see its bytes.
//!
//! A process's storages on one allocation share one [`CudaUse`]: for an importer it
//! holds the lease, so the lease ends when the last storage here is dropped. The
//! mapping itself may outlive it: a receiver keeps its [`RETAINED_MAX`] most recently
//! received allocations mapped (at most [`RETAINED_BYTES_MAX`] of them; without a
//! lease, so their owner may recycle them), so a tensor that comes again — a ping, or
//! the owner's recycled allocation in the next fresh tensor — costs no import and no
//! mapping. That pins the memory while retained; [`empty_cache`] gives retained
//! mappings up, and they go with the process.
//!
//! Identity: a process maps each allocation once; the map is keyed by the id (a peer
//! can only name an allocation it was sent: ids are 128 random bits). An allocation
//! that comes back to its owner finds the owner's own mapping.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use super::CudaHandle;
use crate::error::{Error, Result};
use crate::identity_cache::IdentityCache;
use crate::sys::cuda_driver::{self as driver, Driver, Mapping};
use crate::sys::lease;
use crate::sys::memfd::human_bytes;
use crate::sys::shared_bytes::SharedBytes;
use crate::wire::{Decoder, Encoder};

/// Allocations kept by the pool (in use elsewhere or idle).
const MAX_KEPT: usize = 32;
/// Bytes of idle allocations kept for reuse.
const IDLE_BYTES_MAX: usize = 4 << 30;
/// Largest storage carved out of a shared one-granule arena.
const SMALL_MAX: usize = 256 << 10;
/// Alignment of carved storages (more than any element type or CUDA load needs).
const SLICE_ALIGN: usize = 512;
/// Received allocations a process keeps mapped after their storages are gone.
const RETAINED_MAX: usize = 8;
/// Bytes of received allocations kept mapped so.
const RETAINED_BYTES_MAX: usize = 2 << 30;

/// One VMM allocation, mapped in this process.
pub(crate) struct CudaMemory {
    id: u128,
    device: u32,
    mapping: Mapping,
    /// The exported allocation, sent as is (no `dup` per message).
    export: Arc<OwnedFd>,
    /// The owner's description of the lease file (never locked); `None` for an import,
    /// whose lease its [`CudaUse`] holds.
    owner_lease: Option<OwnedFd>,
    /// The use this process's storages on it hold now, if any.
    current: Mutex<Weak<CudaUse>>,
}

/// This process's use of an allocation, held by every storage on it: for an importer,
/// with the lease that tells the owner the bytes are still seen here.
pub(crate) struct CudaUse {
    memory: Arc<CudaMemory>,
    lease: Option<OwnedFd>,
}

impl Drop for CudaUse {
    fn drop(&mut self) {
        // Work this process queued on the memory (a user's kernel still reading it)
        // must be done before the lease goes and the owner may reuse the bytes.
        if self.lease.is_some() {
            if let Ok(d) = driver::driver() {
                let _ = d.synchronize(self.memory.device);
            }
        }
    }
}

impl std::ops::Deref for CudaUse {
    type Target = CudaMemory;

    fn deref(&self) -> &CudaMemory {
        &self.memory
    }
}

impl CudaMemory {
    /// This process's current use of the memory, or a new one holding `lease` (which
    /// is dropped when a use exists already, or when this process owns the memory).
    fn use_with(self: &Arc<Self>, lease: Option<OwnedFd>) -> Arc<CudaUse> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(existing) = current.upgrade() {
            return existing;
        }
        let lease = if self.owner_lease.is_some() {
            None
        } else {
            lease
        };
        let fresh = Arc::new(CudaUse {
            memory: Arc::clone(self),
            lease,
        });
        *current = Arc::downgrade(&fresh);
        fresh
    }
}

impl CudaMemory {
    /// The device it lives on.
    pub(crate) fn device(&self) -> u32 {
        self.device
    }

    /// The allocation's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.mapping.len()
    }

    /// The device address of the first byte.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.mapping.ptr()
    }

    /// Zeroes `len` bytes at `offset`.
    pub(crate) fn zero(&self, offset: usize, len: usize) -> Result<()> {
        driver::driver()?.zero(&self.mapping, offset, len)
    }

    /// Copies `len` bytes from `src` at `src_offset` to this memory at `offset` (one
    /// device: a device-wide copy; two: through the host).
    pub(crate) fn copy_from(
        &self,
        offset: usize,
        src: &CudaMemory,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        let d = driver::driver()?;
        if self.device == src.device {
            return d.copy_device((&self.mapping, offset), (&src.mapping, src_offset), len);
        }
        let mut staging = Vec::new();
        staging.try_reserve_exact(len).map_err(|_| {
            Error::Tensor(format!(
                "cannot stage {} between CUDA devices: out of host memory",
                human_bytes(len as u64)
            ))
        })?;
        staging.resize(len, 0u8);
        d.copy_to_host(
            SharedBytes::of_mut_slice(&mut staging),
            &src.mapping,
            src_offset,
        )?;
        d.copy_from_host(&self.mapping, offset, SharedBytes::of_slice(&staging))
    }

    /// Copies the host bytes `src` to `offset`, and waits for it.
    pub(crate) fn copy_from_host(&self, offset: usize, src: SharedBytes<'_>) -> Result<()> {
        driver::driver()?.copy_from_host(&self.mapping, offset, src)
    }

    /// Starts copying `src` to `offset` on `transfer`'s stream (complete once the
    /// transfer is waited for).
    pub(crate) fn copy_from_host_async(
        &self,
        offset: usize,
        src: Box<dyn driver::HeldHostBytes>,
        transfer: &mut driver::Transfer,
    ) -> Result<()> {
        transfer.copy(&self.mapping, offset, src)
    }

    /// Copies `dst.len()` bytes at `offset` into the host bytes `dst` (writable).
    pub(crate) fn copy_to_host(&self, dst: SharedBytes<'_>, offset: usize) -> Result<()> {
        driver::driver()?.copy_to_host(dst, &self.mapping, offset)
    }
}

/// This process's allocations, by id, so that a received handle finds its mapping.
static BY_ID: crate::sys::fork_local::ForkLocal<IdentityCache<u128, CudaMemory>> =
    crate::sys::fork_local::ForkLocal::new();

fn with_ids<R>(f: impl FnOnce(&mut IdentityCache<u128, CudaMemory>) -> R) -> R {
    f(&mut BY_ID.lock())
}

struct Pool {
    pid: u32,
    /// Oldest first.
    kept: VecDeque<Arc<CudaMemory>>,
    /// Per device, the arena small storages are carved from now (also in `kept`, so
    /// it is never free while current) and where its unused bytes start.
    arenas: HashMap<u32, (Arc<CudaMemory>, usize)>,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// Whether nobody uses the allocation any more, here or elsewhere.
fn is_free(m: &Arc<CudaMemory>) -> bool {
    Arc::strong_count(m) == 1
        && m.owner_lease
            .as_ref()
            .is_some_and(|l| lease::is_unheld(l.as_fd()))
}

/// Memory for a storage of `nbytes` on `device`, and the storage's offset in it: up to
/// [`SMALL_MAX`] bytes are carved out of the current one-granule arena (so small
/// tensors do not cost a granule each; an arena is recycled whole, once no storage on
/// it is left anywhere), larger ones get a whole number of granules, taken from the
/// pool when an allocation of that size is free. The bytes are unspecified (fresh VMM
/// memory is not cleared; a recycled allocation holds what was last stored).
pub(crate) fn allocate(device: u32, nbytes: usize) -> Result<(Arc<CudaUse>, usize)> {
    let d = driver::driver()?;
    d.check_device(device, "a new CUDA tensor")?;
    let pid = crate::sys::fork_local::cached_pid();
    let mut guard = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    let pool = match guard.as_mut() {
        Some(p) if p.pid == pid => p,
        _ => guard.insert(Pool {
            pid,
            kept: VecDeque::new(),
            arenas: HashMap::new(),
        }),
    };
    let granularity = d.granularity(device)?;
    if nbytes <= SMALL_MAX && nbytes <= granularity {
        if let Some((arena, next)) = pool.arenas.get_mut(&device) {
            if *next + nbytes <= arena.len() {
                let offset = *next;
                *next = (offset + nbytes.max(1)).next_multiple_of(SLICE_ALIGN);
                return Ok((arena.use_with(None), offset));
            }
        }
        let arena = pool.take(d, device, granularity)?;
        let next = nbytes.max(1).next_multiple_of(SLICE_ALIGN);
        pool.arenas.insert(device, (Arc::clone(&arena), next));
        return Ok((arena.use_with(None), 0));
    }
    let len = nbytes
        .max(1)
        .checked_next_multiple_of(granularity)
        .ok_or_else(|| {
            Error::InvalidArgument(format!("a CUDA tensor of {nbytes} bytes is too large"))
        })?;
    let memory = pool.take(d, device, len)?;
    Ok((memory.use_with(None), 0))
}

fn create(d: &Driver, device: u32, len: usize) -> Result<CudaMemory> {
    let physical = d.create(device, len)?;
    let export = d.export(&physical)?;
    let mapping = d.map(&physical, device, len)?;
    // The mapping and the export keep the memory; the handle is no longer needed.
    drop(physical);
    let mut id = [0u8; 16];
    getrandom::fill(&mut id)
        .map_err(|e| Error::Cuda(format!("no random bytes for an allocation id: {e}")))?;
    Ok(CudaMemory {
        id: u128::from_le_bytes(id),
        device,
        mapping,
        export: Arc::new(export),
        owner_lease: Some(lease::create("multiproc-cuda-lease")?),
        current: Mutex::new(Weak::new()),
    })
}

impl Pool {
    /// A free allocation of `len` bytes on `device` from the pool, or a new one; kept.
    fn take(&mut self, d: &Driver, device: u32, len: usize) -> Result<Arc<CudaMemory>> {
        let reuse = self
            .kept
            .iter()
            .position(|m| m.device == device && m.len() == len && is_free(m));
        let memory = match reuse {
            Some(i) => {
                // This process's own queued work on the old tensor finishes before the
                // bytes are handed out again (an importer's did before its lease went).
                d.synchronize(device)?;
                self.kept.remove(i).expect("index from position")
            }
            None => {
                let m = Arc::new(create(d, device, len)?);
                with_ids(|ids| ids.insert(m.id, &m));
                m
            }
        };
        self.kept.push_back(Arc::clone(&memory));
        self.trim();
        Ok(memory)
    }

    /// Keeps at most [`MAX_KEPT`] allocations and [`IDLE_BYTES_MAX`] of idle ones;
    /// dropping one here only gives up this process's mapping (holders keep theirs).
    fn trim(&mut self) {
        while self.kept.len() > MAX_KEPT {
            self.kept.pop_front();
        }
        let mut idle: usize = self
            .kept
            .iter()
            .filter(|m| is_free(m))
            .map(|m| m.len())
            .sum();
        while idle > IDLE_BYTES_MAX {
            let Some(i) = self.kept.iter().position(is_free) else {
                break;
            };
            if let Some(m) = self.kept.remove(i) {
                idle -= m.len();
            }
        }
    }
}

/// Releases every idle allocation of the pool (torch's `torch.cuda.empty_cache()`);
/// allocations still in use here or elsewhere are kept until they are not.
pub(crate) fn empty_cache() {
    let mut guard = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(pool) = guard.as_mut() {
        // An arena nobody uses goes too (it is referenced by the pool twice).
        pool.arenas.retain(|_, (arena, _)| {
            Arc::strong_count(arena) > 2
                || !arena
                    .owner_lease
                    .as_ref()
                    .is_some_and(|l| lease::is_unheld(l.as_fd()))
        });
        pool.kept.retain(|m| !is_free(m));
    }
    drop(guard);
    let retained = std::mem::take(&mut *RETAINED.lock().unwrap_or_else(PoisonError::into_inner));
    drop(retained);
}

/// Received allocations kept mapped, oldest first.
static RETAINED: Mutex<VecDeque<Arc<CudaMemory>>> = Mutex::new(VecDeque::new());

/// Keeps `memory` mapped after its storages here are gone (see the module doc).
fn retain(memory: &Arc<CudaMemory>) {
    let mut retained = RETAINED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(i) = retained.iter().position(|m| Arc::ptr_eq(m, memory)) {
        if let Some(m) = retained.remove(i) {
            retained.push_back(m);
        }
        return;
    }
    retained.push_back(Arc::clone(memory));
    let mut bytes: usize = retained.iter().map(|m| m.len()).sum();
    while retained.len() > RETAINED_MAX || bytes > RETAINED_BYTES_MAX {
        let Some(oldest) = retained.pop_front() else {
            break;
        };
        bytes -= oldest.len();
    }
}

/// Writes the handle of `nbytes` at `offset` in `memory` into the message being
/// encoded. Waits for the device first: every write issued before the send, on any
/// stream of this process, is complete before the receiver can see the handle.
pub(crate) fn send(
    enc: &Encoder<'_>,
    memory: &CudaUse,
    offset: usize,
    nbytes: usize,
) -> std::result::Result<CudaHandle, String> {
    let fail = |e: Error| enc.fail(e);
    let d = driver::driver().map_err(fail)?;
    d.synchronize(memory.device).map_err(fail)?;
    // A new lease is made from one this process holds (an importer's) or by the owner.
    let from = memory
        .lease
        .as_ref()
        .or(memory.owner_lease.as_ref())
        .ok_or_else(|| fail(Error::Encode("a CUDA allocation without a lease".into())))?;
    let lease = lease::take(from.as_fd()).map_err(fail)?;
    let export = enc.attach_shared_fd(&memory.export);
    // The message owns the lease: it is released with the message, sent or not.
    let lease = enc.attach_shared_fd(&Arc::new(lease));
    Ok(CudaHandle {
        export,
        lease,
        id: memory.id,
        device: memory.device,
        len: memory.len() as u64,
        offset: offset as u64,
        nbytes: nbytes as u64,
    })
}

/// The memory a received handle names: this process's mapping of it, or a new one.
/// Checks everything the sender claims; returns the memory, offset and length.
pub(crate) fn receive(
    dec: &Decoder<'_>,
    h: &CudaHandle,
) -> std::result::Result<(Arc<CudaUse>, usize, usize), String> {
    let d = driver::driver().map_err(|e| dec.fail(e))?;
    let invalid = |why: String| dec.fail(Error::InvalidMessage(why));
    d.check_device(h.device, "a received CUDA tensor")
        .map_err(|e| invalid(e.to_string()))?;
    let (Ok(len), Ok(offset), Ok(nbytes)) = (
        usize::try_from(h.len),
        usize::try_from(h.offset),
        usize::try_from(h.nbytes),
    ) else {
        return Err(invalid(format!(
            "a CUDA storage of {} bytes at offset {} in {} does not fit this machine",
            h.nbytes, h.offset, h.len
        )));
    };
    if offset.checked_add(nbytes).is_none_or(|end| end > len) {
        return Err(invalid(format!(
            "a CUDA storage of {nbytes} bytes at offset {offset} cannot live in an allocation of {len}"
        )));
    }
    let granularity = d.granularity(h.device).map_err(|e| dec.fail(e))?;
    if len == 0 || len % granularity != 0 {
        return Err(invalid(format!(
            "a CUDA allocation of {len} bytes is not a multiple of cuda:{}'s granularity ({granularity})",
            h.device
        )));
    }
    let known = with_ids(|ids| ids.get(&h.id));
    if let Some(memory) = known {
        if memory.device != h.device || memory.len() != len {
            return Err(invalid(format!(
                "a received CUDA handle names allocation {:032x} as {len} bytes on cuda:{}, but \
                 it is {} bytes on cuda:{}",
                h.id,
                h.device,
                memory.len(),
                memory.device
            )));
        }
        // Mapped here already: the export is not needed; the message's lease becomes
        // this process's unless it has one (or owns the memory).
        dec.about("a CUDA tensor").with_fd(h.export, |_| ())?;
        let lease = dec.about("a CUDA tensor's lease").take_fd(h.lease)?;
        if memory.owner_lease.is_none() {
            retain(&memory);
        }
        return Ok((memory.use_with(Some(lease)), offset, nbytes));
    }
    let export = dec.about("a CUDA tensor").take_fd(h.export)?;
    let lease = dec.about("a CUDA tensor's lease").take_fd(h.lease)?;
    let (physical, on) = d
        .import(export.as_fd(), h.device)
        .map_err(|e| invalid(e.to_string()))?;
    if on != h.device {
        return Err(invalid(format!(
            "a received CUDA handle says cuda:{}, but the allocation is on cuda:{on}",
            h.device
        )));
    }
    let mapping = d.map(&physical, on, len).map_err(|e| {
        invalid(format!(
            "a received CUDA handle claims {len} bytes the allocation does not have: {e}"
        ))
    })?;
    drop(physical);
    let memory = Arc::new(CudaMemory {
        id: h.id,
        device: on,
        mapping,
        export: Arc::new(export),
        owner_lease: None,
        current: Mutex::new(Weak::new()),
    });
    // Another thread may have mapped the same allocation meanwhile: keep one.
    let memory = with_ids(|ids| match ids.get(&h.id) {
        Some(existing) => existing,
        None => {
            ids.insert(h.id, &memory);
            memory
        }
    });
    retain(&memory);
    Ok((memory.use_with(Some(lease)), offset, nbytes))
}
