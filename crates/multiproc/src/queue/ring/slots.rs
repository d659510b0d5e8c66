//! The slot protocol of a queue's ring: a bounded multi-producer, multi-consumer queue
//! of records in shared memory in which nobody ever waits for another participant —
//! so a process stopped (SIGSTOP, a debugger, a frozen container) or killed at any
//! instruction holds nobody up, and nothing is lost but the record it was writing.
//!
//! **Positions and slots.** `HEAD` and `TAIL` are 64-bit positions that only grow;
//! position `p` lives in slot `p % n`, in lap `p / n`. Each slot has a 64-bit state
//! word `lap << 2 | state`, and a position's fate is decided by one compare-and-swap
//! on that word, never by reading `HEAD` or `TAIL` (which are hints that anyone
//! advances, so a participant stopped before it moved one delays nobody):
//!
//! | state     | meaning for position `lap * n + slot`                                  |
//! |-----------|-------------------------------------------------------------------------|
//! | `EMPTY`   | free: the next producer at this position may claim it                   |
//! | `WRITING` | claimed: its producer is writing the record                             |
//! | `FULL`    | published: the first consumer to swap it to `EMPTY` of the next lap takes it |
//! | `SKIPPED` | dead: revoked from a writer too slow to publish, or passed over; holds no record |
//!
//! **Invariants.**
//! - *A slot's lap never goes back*, so no compare-and-swap can succeed on a stale
//!   value (no ABA within 2⁶² laps).
//! - *Only a producer that claimed a slot (`EMPTY` → `WRITING`) writes its bytes*, and
//!   the slot stays `WRITING` or `SKIPPED` — unusable by anyone else — until that
//!   producer publishes it (`WRITING` → `FULL`) or gives it back after it was revoked
//!   (`SKIPPED` → `EMPTY` of the next lap). A writer stopped for good therefore loses one
//!   slot of capacity and no other record.
//! - *A consumer copies a record out before it takes it*: the copy is valid only if its
//!   swap `FULL` → `EMPTY` succeeds, and a consumer stopped before the swap took
//!   nothing, one stopped after it holds its own record. Consumers hold nothing shared.
//! - *A writer that does not publish within a while is revoked* by the consumer waiting
//!   at its position (`WRITING` → `SKIPPED`, the caller decides when): its publication
//!   then fails, it gives the slot back and writes its record again at a new position,
//!   so nothing is lost and nothing is taken twice. Producers reaching a slot still
//!   `SKIPPED` from an earlier lap mark their own position dead too, and consumers pass
//!   dead positions.
//! - *Every bit of shared state may be forged* by a process that holds the queue: the
//!   protocol never trusts a length (the memory checks it), repairs states that cannot
//!   occur, and bounds its loops, so a forged ring costs messages of that ring and an
//!   error, never a hang or a panic.
//!
//! The protocol is written against [`SlotMemory`]; in a process it is a ring's shared
//! block, in the model checker (the `loom` tests below) process-local loom atomics, so
//! the code that runs is the code that is checked.

use std::sync::atomic::{AtomicU64, Ordering};

const EMPTY: u64 = 0;
const WRITING: u64 = 1;
const FULL: u64 = 2;
const SKIPPED: u64 = 3;

/// The state word of `state` at `lap`.
const fn at(lap: u64, state: u64) -> u64 {
    lap << 2 | state
}

/// What the protocol needs of a 64-bit shared word.
pub(crate) trait SlotWord: Sync {
    /// The value.
    fn load(&self) -> u64;
    /// A strong compare-and-swap (acquire-release on success, acquire on failure).
    fn swap_if(&self, current: u64, new: u64) -> bool;
}

impl SlotWord for AtomicU64 {
    fn load(&self) -> u64 {
        AtomicU64::load(self, Ordering::Acquire)
    }

    fn swap_if(&self, current: u64, new: u64) -> bool {
        self.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// The memory of a ring: its positions, its slots' state words and their records.
pub(crate) trait SlotMemory: Sync {
    /// A shared word.
    type Word: SlotWord;
    /// How many slots.
    fn slots(&self) -> usize;
    /// The consumers' position.
    fn head(&self) -> &Self::Word;
    /// The producers' position.
    fn tail(&self) -> &Self::Word;
    /// The state word of slot `slot` (below [`slots`](Self::slots)).
    fn state(&self, slot: usize) -> &Self::Word;
    /// Writes a record made of `parts` into slot `slot`, which the caller has claimed
    /// (the caller checked that it fits).
    fn write(&self, slot: usize, parts: &[&[u8]]);
    /// Copies the record of slot `slot` out; `None` when its length is impossible
    /// (forged).
    fn read(&self, slot: usize) -> Option<Vec<u8>>;
}

/// The outcome of [`push`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// Published.
    Done,
    /// No free slot: the oldest record of the ring is a lap behind (the caller sends
    /// another way).
    Full,
    /// `go_on` said stop (the model checker's stopped or killed producer).
    Stopped,
}

/// The outcome of [`pop`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Popped {
    /// The oldest record, taken.
    Record(Vec<u8>),
    /// The oldest record had an impossible length: taken, its bytes dropped.
    Forged,
    /// Nothing published at the consumers' position.
    Empty,
    /// The record at this position is being written; pass the position to [`pop`] as
    /// `revoke` to revoke it if it is still there.
    Busy(u64),
    /// `go_on` said stop (the model checker's stopped or killed consumer).
    Stopped,
}

/// Most rounds of one call: each round that does not return is one that some other
/// participant's step (or a forged word) made necessary, so a call that runs this many
/// is looking at a forged ring and gives up rather than spin.
fn most_rounds<M: SlotMemory>(m: &M) -> usize {
    4 * m.slots() + 64
}

fn split(word: u64) -> (u64, u64) {
    (word >> 2, word & 3)
}

/// Publishes a record made of `parts` at the next free position. `go_on` is asked
/// between the steps a participant can be stopped at (always `true` outside the model
/// checker).
pub(crate) fn push<M: SlotMemory>(
    m: &M,
    parts: &[&[u8]],
    mut go_on: impl FnMut() -> bool,
) -> Pushed {
    let n = m.slots() as u64;
    for _ in 0..most_rounds(m) {
        let pos = m.tail().load();
        let (slot, lap) = ((pos % n) as usize, pos / n);
        let word = m.state(slot);
        let w = word.load();
        let (wl, state) = split(w);
        if wl > lap || (wl == lap && state != EMPTY) {
            // Decided already: the tail is behind; move it on for whoever left it.
            m.tail().swap_if(pos, pos + 1);
            continue;
        }
        if wl < lap {
            match state {
                // The record of the previous lap is not taken yet.
                FULL | WRITING => return Pushed::Full,
                // A revoked writer of an earlier lap has not given the slot back:
                // this position is dead too.
                SKIPPED => {
                    if word.swap_if(w, at(lap, SKIPPED)) {
                        m.tail().swap_if(pos, pos + 1);
                    }
                    continue;
                }
                _ => {} // EMPTY of an earlier lap (only forged): claimable.
            }
        }
        if !word.swap_if(w, at(lap, WRITING)) {
            continue;
        }
        m.tail().swap_if(pos, pos + 1);
        if !go_on() {
            return Pushed::Stopped;
        }
        m.write(slot, parts);
        if !go_on() {
            return Pushed::Stopped;
        }
        if word.swap_if(at(lap, WRITING), at(lap, FULL)) {
            return Pushed::Done;
        }
        // Revoked while writing: give the slot back for its next lap, write again.
        give_back(word);
        if !go_on() {
            return Pushed::Stopped;
        }
    }
    Pushed::Full
}

/// A revoked writer gives its slot back (it is `SKIPPED`, of its own lap or a later
/// one that producers marked dead meanwhile).
fn give_back(word: &impl SlotWord) {
    loop {
        let w = word.load();
        let (wl, state) = split(w);
        if state != SKIPPED || word.swap_if(w, at(wl + 1, EMPTY)) {
            return;
        }
    }
}

/// Takes the oldest record. `revoke`: a position [`Popped::Busy`] named before, whose
/// writer is revoked if it is still writing there.
pub(crate) fn pop<M: SlotMemory>(
    m: &M,
    revoke: Option<u64>,
    mut go_on: impl FnMut() -> bool,
) -> Popped {
    let n = m.slots() as u64;
    for _ in 0..most_rounds(m) {
        let pos = m.head().load();
        let (slot, lap) = ((pos % n) as usize, pos / n);
        let word = m.state(slot);
        let w = word.load();
        let (wl, state) = split(w);
        if wl > lap || (wl == lap && state == SKIPPED) {
            // Taken or dead: the head is behind; move it on for whoever left it.
            m.head().swap_if(pos, pos + 1);
            continue;
        }
        if wl < lap {
            match state {
                // Nothing claimed here yet (the slot is as its last position left it).
                EMPTY | SKIPPED => {
                    return if starts_over(m, pos, w) {
                        Popped::Forged
                    } else {
                        Popped::Empty
                    };
                }
                // Cannot occur (the head passes a position only once it is decided):
                // a forged word. Make the position usable again.
                FULL => word.swap_if(w, at(lap, EMPTY)),
                _ => word.swap_if(w, at(lap, SKIPPED)),
            };
            continue;
        }
        match state {
            EMPTY => {
                return if starts_over(m, pos, w) {
                    Popped::Forged
                } else {
                    Popped::Empty
                };
            }
            WRITING if revoke == Some(pos) => {
                if word.swap_if(w, at(lap, SKIPPED)) {
                    m.head().swap_if(pos, pos + 1);
                }
            }
            WRITING => return Popped::Busy(pos),
            _ => {
                let record = m.read(slot);
                if !go_on() {
                    return Popped::Stopped;
                }
                if word.swap_if(w, at(lap + 1, EMPTY)) {
                    m.head().swap_if(pos, pos + 1);
                    return record.map_or(Popped::Forged, Popped::Record);
                }
            }
        }
    }
    // A forged ring: start over at the producers' position.
    let (head, tail) = (m.head().load(), m.tail().load());
    m.head().swap_if(head, tail);
    Popped::Forged
}

/// Called where nothing is claimed at the consumers' position `pos` (its slot's word is
/// `w`), so no position a lap further can have been claimed either: a tail that far off
/// (or a head that far past it) is forged, and the ring starts over at the producers'
/// position. Whether it did.
fn starts_over<M: SlotMemory>(m: &M, pos: u64, w: u64) -> bool {
    let n = m.slots() as u64;
    let tail = m.tail().load();
    let off = tail.saturating_sub(pos).max(pos.saturating_sub(tail));
    if off > n && m.head().load() == pos && m.state((pos % n) as usize).load() == w {
        m.head().swap_if(pos, tail);
        return true;
    }
    false
}

/// Whether position `pos` is still claimed by a writer that has not published it.
pub(crate) fn is_writing<M: SlotMemory>(m: &M, pos: u64) -> bool {
    let n = m.slots() as u64;
    m.state((pos % n) as usize).load() == at(pos / n, WRITING)
}

/// Whether a record is published or being written at the consumers' position (moving
/// the head past taken and dead positions on the way).
pub(crate) fn holds_records<M: SlotMemory>(m: &M) -> bool {
    let n = m.slots() as u64;
    for _ in 0..most_rounds(m) {
        let pos = m.head().load();
        let (wl, state) = split(m.state((pos % n) as usize).load());
        let lap = pos / n;
        if wl > lap || (wl == lap && state == SKIPPED) {
            m.head().swap_if(pos, pos + 1);
            continue;
        }
        return wl == lap && matches!(state, WRITING | FULL);
    }
    false
}

/// The protocol under the loom model checker, over process-local words: every
/// interleaving (up to loom's preemption bound) of producers and consumers, including
/// ones that stop for good at each step — which, for a protocol without locks, is also
/// what a participant killed there looks like to the others. `.ci/run` runs them in
/// release: `cargo test --release -p multiproc --lib ring::slots::model -- --ignored`.
#[cfg(test)]
mod model {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64 as LoomU64;

    use crate::model_check::explore;

    impl SlotWord for LoomU64 {
        fn load(&self) -> u64 {
            LoomU64::load(self, Ordering::Acquire)
        }

        fn swap_if(&self, current: u64, new: u64) -> bool {
            self.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        }
    }

    /// A ring of process-local words whose records are one `u64` each (a record's
    /// bytes are copied in and out whole, as a process copies them; the protocol, not
    /// the copy, is what is checked).
    struct ModelRing {
        head: LoomU64,
        tail: LoomU64,
        states: Vec<LoomU64>,
        records: Vec<LoomU64>,
    }

    impl ModelRing {
        fn new(slots: usize) -> Arc<Self> {
            Arc::new(Self {
                head: LoomU64::new(0),
                tail: LoomU64::new(0),
                states: (0..slots).map(|_| LoomU64::new(0)).collect(),
                records: (0..slots).map(|_| LoomU64::new(0)).collect(),
            })
        }
    }

    impl SlotMemory for ModelRing {
        type Word = LoomU64;

        fn slots(&self) -> usize {
            self.states.len()
        }

        fn head(&self) -> &LoomU64 {
            &self.head
        }

        fn tail(&self) -> &LoomU64 {
            &self.tail
        }

        fn state(&self, slot: usize) -> &LoomU64 {
            &self.states[slot]
        }

        fn write(&self, slot: usize, parts: &[&[u8]]) {
            let bytes: [u8; 8] = parts[0].try_into().unwrap();
            self.records[slot].store(u64::from_le_bytes(bytes), Ordering::Relaxed);
        }

        fn read(&self, slot: usize) -> Option<Vec<u8>> {
            Some(
                self.records[slot]
                    .load(Ordering::Relaxed)
                    .to_le_bytes()
                    .to_vec(),
            )
        }
    }

    /// Pushes `value`, retrying while the ring is full; whether it was published
    /// (`false`: `go_on` stopped it).
    fn put(ring: &ModelRing, value: u64, go_on: impl FnMut() -> bool + Clone) -> bool {
        loop {
            match push(ring, &[&value.to_le_bytes()], go_on.clone()) {
                Pushed::Done => return true,
                Pushed::Stopped => return false,
                Pushed::Full => loom::thread::yield_now(),
            }
        }
    }

    /// Pops until a record comes, revoking a writer it finds busy twice at the same
    /// position (the model has no clock: "twice" stands for "for a while").
    fn get(ring: &ModelRing) -> u64 {
        let mut busy = None;
        let mut revoke = None;
        loop {
            match pop(ring, revoke.take(), || true) {
                Popped::Record(bytes) => return u64::from_le_bytes(bytes.try_into().unwrap()),
                Popped::Busy(pos) => {
                    if busy == Some(pos) {
                        revoke = Some(pos);
                    }
                    busy = Some(pos);
                    loom::thread::yield_now();
                }
                Popped::Empty => loom::thread::yield_now(),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// `go_on` for a participant that stops for good at its `step`-th question.
    fn stops_at(step: usize) -> impl FnMut() -> bool + Clone {
        let mut asked = 0;
        move || {
            asked += 1;
            asked < step
        }
    }

    /// Pops at most `tries` times, revoking a writer found busy twice at one position;
    /// what it took. Bounded, so that no interleaving spins for ever on a ring nobody
    /// fills any more (the model checker would call that a livelock).
    fn take_some(ring: &ModelRing, tries: usize) -> Vec<u64> {
        let mut got = Vec::new();
        let mut busy = None;
        let mut revoke = None;
        for _ in 0..tries {
            match pop(ring, revoke.take(), || true) {
                Popped::Record(bytes) => got.push(u64::from_le_bytes(bytes.try_into().unwrap())),
                Popped::Busy(pos) => {
                    if busy == Some(pos) {
                        revoke = Some(pos);
                    }
                    busy = Some(pos);
                    loom::thread::yield_now();
                }
                Popped::Empty => loom::thread::yield_now(),
                other => panic!("unexpected {other:?}"),
            }
        }
        got
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release"]
    fn two_producers_and_two_consumers_lose_and_duplicate_nothing() {
        // Two producers of a record each, two consumers that take what they find in two
        // tries each (revoking a writer found busy twice); whatever they leave is taken
        // afterwards. Eight slots: room for the records and for the positions revoked
        // writers leave dead, so no producer waits. (A producer's order is the
        // integration tests' to check: tests/stopped.rs and the ring's unit tests; two
        // records each made the model run for tens of minutes.)
        let runs = explore(1, || {
            let ring = ModelRing::new(8);
            let producers: Vec<_> = [1u64, 2]
                .into_iter()
                .map(|value| {
                    let ring = Arc::clone(&ring);
                    loom::thread::spawn(move || {
                        assert_eq!(push(&*ring, &[&value.to_le_bytes()], || true), Pushed::Done);
                    })
                })
                .collect();
            let consumers: Vec<_> = (0..2)
                .map(|_| {
                    let ring = Arc::clone(&ring);
                    loom::thread::spawn(move || take_some(&ring, 2))
                })
                .collect();
            for p in producers {
                p.join().unwrap();
            }
            let mut all: Vec<u64> = Vec::new();
            for c in consumers {
                all.extend(c.join().unwrap());
            }
            // Every writer has published: the rest is there to take.
            all.extend(take_some(&ring, 8));
            all.sort_unstable();
            assert_eq!(all, [1, 2], "lost or duplicated");
            assert_eq!(pop(&*ring, None, || true), Popped::Empty);
        });
        eprintln!("ring slots model, 2 producers x 2 consumers: {runs} interleavings");
        assert!(runs > 1);
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release"]
    fn a_producer_stopped_at_any_step_holds_nobody_up() {
        // Steps: after its claim, after its write, after giving a revoked slot back.
        for step in 1..=3 {
            let runs = explore(2, move || {
                let ring = ModelRing::new(2);
                let stopped = {
                    let ring = Arc::clone(&ring);
                    loom::thread::spawn(move || put(&ring, 7, stops_at(step)))
                };
                let producer = {
                    let ring = Arc::clone(&ring);
                    loom::thread::spawn(move || assert!(put(&ring, 1, || true)))
                };
                let consumer = {
                    let ring = Arc::clone(&ring);
                    loom::thread::spawn(move || get(&ring))
                };
                producer.join().unwrap();
                let published = stopped.join().unwrap();
                let first = consumer.join().unwrap();
                // The other producer's record is never lost behind the stopped one; the
                // stopped one's record is there only if it got as far as publishing.
                let mut got = vec![first];
                while let Popped::Record(bytes) = pop(&*ring, None, || true) {
                    got.push(u64::from_le_bytes(bytes.try_into().unwrap()));
                }
                got.sort_unstable();
                let want: &[u64] = if published { &[1, 7] } else { &[1] };
                assert_eq!(got, want, "stopped at step {step}");
                // The ring still carries records.
                assert!(put(&ring, 9, || true));
                assert_eq!(get(&ring), 9);
            });
            eprintln!("ring slots model, a producer stopped at step {step}: {runs} interleavings");
            assert!(runs > 1);
        }
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release"]
    fn a_consumer_stopped_at_any_step_holds_nobody_up() {
        // A consumer stopped between copying a record out and taking it took nothing:
        // the other consumer gets every record, each once.
        let runs = explore(2, || {
            let ring = ModelRing::new(2);
            let stopped = {
                let ring = Arc::clone(&ring);
                loom::thread::spawn(move || match pop(&*ring, None, stops_at(1)) {
                    // Busy: the producer was mid-write; nothing taken either.
                    Popped::Stopped | Popped::Empty | Popped::Busy(_) => None,
                    Popped::Record(bytes) => Some(u64::from_le_bytes(bytes.try_into().unwrap())),
                    other => panic!("unexpected {other:?}"),
                })
            };
            let producer = {
                let ring = Arc::clone(&ring);
                loom::thread::spawn(move || {
                    assert!(put(&ring, 1, || true));
                    assert!(put(&ring, 2, || true));
                })
            };
            let consumer = {
                let ring = Arc::clone(&ring);
                loom::thread::spawn(move || [get(&ring), get(&ring)])
            };
            producer.join().unwrap();
            assert_eq!(
                stopped.join().unwrap(),
                None,
                "a stopped consumer took a record"
            );
            assert_eq!(consumer.join().unwrap(), [1, 2]);
        });
        eprintln!("ring slots model, a consumer stopped after its copy: {runs} interleavings");
        assert!(runs > 1);
    }
}
