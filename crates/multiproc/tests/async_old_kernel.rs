//! Feature `async` (issue 23): on a kernel without `futex_waitv` (Linux before 5.16) the
//! awaited waits and the blocking waits over several words still work, on their
//! fallbacks: the word reactor looks at its words every 10 ms, and a blocking wait on
//! several queues sleeps on the first word for at most 10 ms at a time.
//!
//! Such a kernel is made here, in a worker process, by a seccomp filter that answers
//! `futex_waitv` with `ENOSYS` (as a kernel that lacks it does) for every thread of the
//! worker, the reactor's included. The worker first checks that the filter is in force
//! (a direct `futex_waitv` gets `ENOSYS`), so the test cannot pass on the fast path.

multiproc::test_init!();

mod common;

use common::async_rt::*;
use multiproc::{Event, Process, Queue};

/// `futex_waitv`'s number (the same on x86_64 and aarch64: the generic table).
const SYS_FUTEX_WAITV: u32 = 449;

/// The audit architecture a seccomp filter checks before it trusts a syscall number.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// Makes every thread of this process, and every thread it starts later, get `ENOSYS`
/// from `futex_waitv`.
fn refuse_futex_waitv() -> std::io::Result<()> {
    use libc::{
        BPF_ABS, BPF_JEQ, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W, SECCOMP_RET_ALLOW,
        SECCOMP_RET_ERRNO, sock_filter,
    };
    let op = |code: u32, k: u32, jt: u8, jf: u8| sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let enosys = SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    // struct seccomp_data: `nr` at offset 0, `arch` at 4.
    let filter = [
        op(BPF_LD | BPF_W | BPF_ABS, 4, 0, 0),
        op(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH, 1, 0),
        op(BPF_RET | BPF_K, SECCOMP_RET_ALLOW, 0, 0),
        op(BPF_LD | BPF_W | BPF_ABS, 0, 0, 0),
        op(BPF_JMP | BPF_JEQ | BPF_K, SYS_FUTEX_WAITV, 0, 1),
        op(BPF_RET | BPF_K, enosys, 0, 0),
        op(BPF_RET | BPF_K, SECCOMP_RET_ALLOW, 0, 0),
    ];
    let program = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) takes no pointers.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `program` points at `filter`, both alive for the call; the kernel copies
    // the program.
    let r = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_TSYNC,
            &program as *const libc::sock_fprog,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `futex_waitv` answers `ENOSYS` here (on a word that holds another value it
/// would return `EAGAIN` at once).
fn futex_waitv_is_missing() -> bool {
    use rustix::thread::futex;
    let word = std::sync::atomic::AtomicU32::new(1);
    let mut wait = futex::Wait::new();
    wait.val = 0;
    wait.uaddr = futex::WaitPtr::new(word.as_ptr().cast());
    wait.flags = futex::WaitFlags::SIZE_U32 | futex::WaitFlags::PRIVATE;
    let r = futex::waitv(
        &[wait],
        futex::WaitvFlags::empty(),
        None,
        rustix::time::ClockId::Monotonic,
    );
    r == Err(rustix::io::Errno::NOSYS)
}

/// On a kernel made without `futex_waitv`: awaits an item, then an event (telling the
/// parent on `steps` once each wait is parked), then waits, blocking, on two queues of
/// which the parent fills the second.
fn without_futex_waitv(
    _rank: usize,
    (items, go, first, second, steps): (Queue<u32>, Event, Queue<u32>, Queue<u32>, Queue<u8>),
) -> Result<(), String> {
    refuse_futex_waitv().map_err(|e| format!("installing the seccomp filter: {e}"))?;
    if !futex_waitv_is_missing() {
        return Err("futex_waitv still works under the filter".into());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let base = multiproc::__testing::parked_word_waits();
    let steps = &steps;
    let tell = |step: u8| async move {
        until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
        steps.put(step)
    };
    rt.block_on(async {
        let (item, told) = tokio::join!(tokio::time::timeout(WAIT, items.get_async()), tell(1));
        told.map_err(|e| e.to_string())?;
        let item = item.map_err(|_| "no item in time".to_string())?;
        if item.map_err(|e| e.to_string())? != 7 {
            return Err("the wrong item".to_string());
        }
        let (set, told) = tokio::join!(tokio::time::timeout(WAIT, go.wait_async()), tell(2));
        told.map_err(|e| e.to_string())?;
        set.map_err(|_| "the event was not seen in time".to_string())?
            .map_err(|e| e.to_string())
    })?;
    steps.put(3).map_err(|e| e.to_string())?;
    let ready =
        multiproc::connection::wait(&[&first, &second], Some(WAIT)).map_err(|e| e.to_string())?;
    if ready != [1] || second.try_get().map_err(|e| e.to_string())? != Some(9) {
        return Err(format!("the blocking wait said {ready:?}"));
    }
    Ok(())
}

#[test]
fn awaited_and_blocking_waits_work_without_futex_waitv() {
    common::run(DEADLINE, || {
        let items = Queue::<u32>::new().unwrap();
        let go = Event::new().unwrap();
        let (first, second) = (Queue::<u32>::new().unwrap(), Queue::<u32>::new().unwrap());
        let steps = Queue::<u8>::new().unwrap();
        let args = (
            items.clone(),
            go.clone(),
            first.clone(),
            second.clone(),
            steps.clone(),
        );
        let mut worker = Process::builder(without_futex_waitv, 0, args)
            .start()
            .unwrap();
        // Each wake-up reaches a wait that is parked: the fallback delivers it.
        assert_eq!(steps.get_timeout(WAIT).unwrap(), 1, "{:?}", worker.error());
        items.put(7).unwrap();
        assert_eq!(steps.get_timeout(WAIT).unwrap(), 2, "{:?}", worker.error());
        go.set();
        assert_eq!(steps.get_timeout(WAIT).unwrap(), 3, "{:?}", worker.error());
        second.put(9).unwrap();
        let status = worker.join_timeout(WAIT).unwrap();
        assert!(status.success(), "{status:?}: {:?}", worker.error());
    });
}
