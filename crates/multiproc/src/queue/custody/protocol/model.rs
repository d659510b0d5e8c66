//! The custody's protocol under the model checker (loom, preemption bound 2): the same
//! `rotate` and `find` as the real custody, over shelves whose every operation is one
//! step — a loom mutex around a queue of packets stands for a socket's queue (each
//! system call is atomic in the kernel), a loom atomic holding the holder's id for a
//! shelf's lock (whose own protocol, takeover from a dead holder included, is
//! model-checked in `sync::lock`). A participant stops for good, or dies, at a chosen
//! step by answering `false` to its `go_on` there; a stopped one keeps its lock, a dead
//! one's lock is taken over.
//!
//! Run by `.ci/run` (`cargo test --release -p multiproc --lib custody -- --ignored`).

use std::collections::VecDeque;

use loom::sync::atomic::{AtomicBool, AtomicU32};
use loom::sync::{Arc, Mutex};
use std::sync::atomic::Ordering;

use super::*;
use crate::model_check::explore;

/// A model entry's fd: the block (device, inode) it stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ModelFd(u64, u64);

/// A shelf's packet: its bytes and fd.
type ModelPacket = (Vec<u8>, Option<ModelFd>);

/// Two shelves, their locks, and which pids have died.
struct Custody {
    queues: [Mutex<VecDeque<ModelPacket>>; SHELVES],
    locks: [AtomicU32; SHELVES],
    counts: [AtomicU32; SHELVES],
    dead: [AtomicBool; 4],
}

/// Blocks A and B.
const A: (u64, u64) = (1, 10);
const B: (u64, u64) = (1, 11);
const C: (u64, u64) = (1, 12);
/// Most packets a shelf holds (a socket's buffer).
const CAPACITY: usize = 8;

fn entry((dev, ino): (u64, u64)) -> ModelPacket {
    let mut bytes = dev.to_le_bytes().to_vec();
    bytes.extend(ino.to_le_bytes());
    (bytes, Some(ModelFd(dev, ino)))
}

impl Custody {
    /// Both shelves holding `blocks`, in that order.
    fn holding(blocks: &[(u64, u64)]) -> Arc<Self> {
        let shelf = || Mutex::new(blocks.iter().map(|&b| entry(b)).collect::<VecDeque<_>>());
        Arc::new(Self {
            queues: [shelf(), shelf()],
            locks: std::array::from_fn(|_| AtomicU32::new(0)),
            counts: std::array::from_fn(|_| AtomicU32::new(blocks.len() as u32)),
            dead: std::array::from_fn(|_| AtomicBool::new(false)),
        })
    }

    /// The blocks on `shelf`, in order (sentinels left out).
    fn blocks(&self, shelf: usize) -> Vec<(u64, u64)> {
        self.queues[shelf]
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(_, fd)| fd.map(|f| (f.0, f.1)))
            .collect()
    }

    /// Whether every shelf holds each of `blocks` at least once.
    fn keeps_all(&self, blocks: &[(u64, u64)]) -> bool {
        (0..SHELVES).all(|s| {
            let on = self.blocks(s);
            blocks.iter().all(|b| on.contains(b))
        })
    }
}

/// One participant (pid `me`) acting on the model's shelves.
struct Participant<'a> {
    custody: &'a Custody,
    me: u32,
}

impl Shelves for Participant<'_> {
    type Fd = ModelFd;

    fn try_hold(&self, shelf: usize) -> bool {
        let lock = &self.custody.locks[shelf];
        match lock.compare_exchange(0, self.me, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(holder) => {
                self.custody.dead[holder as usize].load(Ordering::Acquire)
                    && lock
                        .compare_exchange(holder, self.me, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
            }
        }
    }

    fn hold_a_while(&self, shelf: usize) -> bool {
        loom::thread::yield_now();
        self.try_hold(shelf)
    }

    fn release(&self, shelf: usize) {
        let _ = self.custody.locks[shelf].compare_exchange(
            self.me,
            0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    fn peek(&self, shelf: usize) -> Result<Option<ModelPacket>> {
        Ok(self.custody.queues[shelf].lock().unwrap().front().cloned())
    }

    fn dequeue(&self, shelf: usize) {
        self.custody.queues[shelf].lock().unwrap().pop_front();
    }

    fn append(&self, shelf: usize, bytes: &[u8], fd: Option<&ModelFd>) -> bool {
        let mut queue = self.custody.queues[shelf].lock().unwrap();
        if queue.len() >= CAPACITY {
            return false;
        }
        queue.push_back((bytes.to_vec(), fd.copied()));
        true
    }

    fn identity(&self, fd: &ModelFd) -> (u64, u64) {
        (fd.0, fd.1)
    }

    fn count(&self, shelf: usize) -> usize {
        self.custody.counts[shelf].load(Ordering::Acquire) as usize
    }

    fn dropped(&self, shelf: usize) {
        self.custody.counts[shelf].fetch_sub(1, Ordering::AcqRel);
    }
}

/// The sentinels of participant `me`'s passes: unique to each pass, as the real ones
/// are (a number no pass of the process used before).
fn sentinels(me: u32) -> impl FnMut() -> [u8; ENTRY_LEN] {
    static PASSES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    move || {
        let pass = PASSES.fetch_add(1, Ordering::Relaxed);
        let mut s = [0u8; ENTRY_LEN];
        s[..4].copy_from_slice(&me.to_le_bytes());
        s[8..].copy_from_slice(&pass.to_le_bytes());
        s
    }
}

/// Looks `block` up as participant `me`, answering `go_on` before each step, waiting
/// on a taken shelf at most `patience` times.
fn look_up(
    custody: &Custody,
    me: u32,
    block: (u64, u64),
    patience: usize,
    go_on: &mut impl FnMut() -> bool,
) -> Lookup<ModelFd> {
    let mut waits = 0;
    let patient = || {
        waits += 1;
        waits <= patience
    };
    find(
        &Participant { custody, me },
        block,
        sentinels(me),
        patient,
        go_on,
    )
    .unwrap()
}

/// Sweeps `shelf` as participant `me` (its lock held): keeps one entry per block, and
/// drops sentinels left behind.
fn sweep(custody: &Custody, me: u32, shelf: usize) {
    let p = Participant { custody, me };
    while !p.try_hold(shelf) {
        loom::thread::yield_now();
    }
    let mut seen = Vec::new();
    let keep = |d: u64, i: u64, _: &ModelFd| {
        let fresh = !seen.contains(&(d, i));
        seen.push((d, i));
        fresh
    };
    rotate(
        &p,
        shelf,
        &sentinels(me)(),
        |_, _, _| false,
        keep,
        &mut || true,
    )
    .unwrap();
    p.release(shelf);
}

/// `go_on` for a participant that stops for good at its `step`-th question.
fn stops_at(step: usize) -> impl FnMut() -> bool {
    let mut asked = 0;
    move || {
        asked += 1;
        asked < step
    }
}

/// The most steps one lookup of the scenarios below takes (enough to cover every
/// step: the last `k` of each scenario runs to the end).
const STEPS: usize = 16;

#[test]
#[ignore = "model checker: .ci/run runs it in release"]
fn two_lookups_find_their_blocks_beside_a_publication_and_lose_no_entry() {
    let runs = explore(2, || {
        let custody = Custody::holding(&[A, B]);
        let looking = [(1, A), (2, B)].map(|(me, block)| {
            let custody = Arc::clone(&custody);
            loom::thread::spawn(move || look_up(&custody, me, block, 4, &mut || true))
        });
        // A third process publishes C meanwhile: on both shelves, without a lock.
        let publisher = {
            let custody = Arc::clone(&custody);
            loom::thread::spawn(move || {
                let p = Participant {
                    custody: &custody,
                    me: 3,
                };
                let (bytes, fd) = entry(C);
                for shelf in 0..SHELVES {
                    assert!(p.append(shelf, &bytes, fd.as_ref()));
                }
            })
        };
        for (looked, (_, block)) in looking.into_iter().zip([(1, A), (2, B)]) {
            match looked.join().unwrap() {
                Lookup::Found(fd) => assert_eq!((fd.0, fd.1), block),
                other => panic!("a lookup of {block:?} came to {other:?}"),
            }
        }
        publisher.join().unwrap();
        assert!(custody.keeps_all(&[A, B, C]), "an entry was lost");
    });
    eprintln!("custody, 2 lookups beside a publication: {runs} interleavings");
}

#[test]
#[ignore = "model checker: .ci/run runs it in release"]
fn a_lookup_stopped_for_good_at_any_step_holds_nobody_up() {
    let mut total = 0;
    for step in 1..=STEPS {
        total += explore(2, move || {
            let custody = Custody::holding(&[A, B]);
            let stopped = {
                let custody = Arc::clone(&custody);
                loom::thread::spawn(move || {
                    look_up(&custody, 1, A, 4, &mut stops_at(step));
                })
            };
            // The other never waits for it: one shelf is always free.
            match look_up(&custody, 2, B, 4, &mut || true) {
                Lookup::Found(fd) => assert_eq!((fd.0, fd.1), B),
                other => panic!("step {step}: a lookup beside a stopped one came to {other:?}"),
            }
            stopped.join().unwrap();
            // Whatever the stopped one held, nothing left a shelf.
            assert!(custody.keeps_all(&[A, B]), "step {step}: an entry was lost");
        });
    }
    eprintln!("custody, a lookup stopped at each of {STEPS} steps: {total} interleavings");
}

#[test]
#[ignore = "model checker: .ci/run runs it in release"]
fn a_lookup_killed_at_any_step_loses_no_entry_and_is_cleaned_up_after() {
    let mut total = 0;
    for step in 1..=STEPS {
        total += explore(2, move || {
            let custody = Custody::holding(&[A, B]);
            let killed = {
                let custody = Arc::clone(&custody);
                loom::thread::spawn(move || {
                    look_up(&custody, 1, A, 4, &mut stops_at(step));
                    // Its process dies: its lock, if it held one, is taken over.
                    custody.dead[1].store(true, Ordering::Release);
                })
            };
            match look_up(&custody, 2, B, 4, &mut || true) {
                Lookup::Found(fd) => assert_eq!((fd.0, fd.1), B),
                other => panic!("step {step}: a lookup beside a dying one came to {other:?}"),
            }
            killed.join().unwrap();
            // Once it is gone, both shelves are found whole and swept clean: each
            // block once, no sentinel left.
            for shelf in 0..SHELVES {
                sweep(&custody, 2, shelf);
                let on = custody.queues[shelf].lock().unwrap().clone();
                let blocks: Vec<_> = on.iter().filter_map(|(_, fd)| *fd).collect();
                assert_eq!(on.len(), blocks.len(), "step {step}: a sentinel was left");
                let mut blocks: Vec<_> = blocks.iter().map(|f| (f.0, f.1)).collect();
                blocks.sort_unstable();
                assert_eq!(blocks, [A, B], "step {step}: shelf {shelf} after the sweep");
            }
        });
    }
    eprintln!("custody, a lookup killed at each of {STEPS} steps: {total} interleavings");
}
