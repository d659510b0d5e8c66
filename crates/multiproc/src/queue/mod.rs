//! Channels between processes: [`SimpleQueue`], [`Queue`], [`JoinableQueue`] and
//! [`pipe`]/[`Connection`].
//!
//! A queue's transport (`channel`) is four things that every process holding the
//! queue holds, which makes queues multi-producer multi-consumer across processes with
//! no feeder thread, and tells a getter when nobody is left to put:
//!
//! - a **ring** (`ring`): 1,024 slots of [`wire`](crate::wire) packets in shared
//!   memory, claimed and published by compare-and-swap, with no lock. A message without
//!   fds that fits a slot goes from `put` to `get` through it with no system call at
//!   all; a getter spins briefly and then sleeps on a futex, woken only when it sleeps;
//! - a `SOCK_SEQPACKET` **socket pair**, the *lane*, for what the ring cannot take:
//!   messages that carry fds (queues, events, locks, tensors whose block could not be
//!   kept in custody), messages larger than a slot, any message while the ring is full,
//!   and every message while the lane is flagged, which keeps each producer's order
//!   (see `ring`);
//! - a **custody** (`custody`): a second socket pair whose queued packets hold the fds
//!   of the tensor blocks sent through the queue, so that a message names a block by
//!   inode alone and a receiver that already maps it (the common case: blocks are
//!   recycled and stay mapped) needs no fd and no system call;
//! - a **holder lease** (`sys::lease`'s peers): an open-file-description lock that each
//!   channel value — the creator's, each received one, each one inside a message in
//!   flight — holds on the queue's lease file, which the kernel drops with the value's
//!   last fd (a SIGKILL included). A get that finds the queue empty, with no other
//!   lease and no other handle in this process, is [`Error::Disconnected`](crate::Error::Disconnected)
//!   instead of a wait that never ends.
//!
//! [`wait`] (`wait`) waits on queues, pipe ends and processes together without taking
//! anything: on the queues' futex words and the fds at once.
//!
//! The counters a `Queue` needs (capacity, size, unfinished tasks) live in the ring's
//! block of atomics. A [`pipe`] is a plain socket pair with no ring: each message is one
//! packet with its fds attached (one reader per end, and hang-up detection).
//!
//! One tensor from `put` to `get`: `Queue::put` encodes the item with the channel's
//! custody lent to the encode (`wire::encode_in`, `wire::Custody`); the tensor's `Storage` moves to shared memory if it
//! is not there (`share_memory_`), and its `SegmentHandle` takes one use of the block
//! for the receiver, lists it in the packet's references section as `Inode { dev, ino
//! }` and writes `{ reference, offset, nbytes }`, having put the block's fd into the
//! custody the first time this process sent that block on this queue. The packet (header and payload) is copied into the ring and a sleeping getter
//! is woken. `get` copies the packet out of the ring, decodes it with the channel's `Returns`, which lends
//! the decode the same custody: the block is found in this process's map cache (or its fd is taken from the custody and
//! mapped once), the `Storage` adopts the message's use, and the tensor aliases the
//! sender's memory.

// The awaitable operations (feature `async`).
#[cfg(feature = "async")]
mod awaiting;
mod bounded;
mod channel;
mod custody;
mod joinable;
mod layout;
mod pipe;
mod ring;
#[cfg(feature = "fuzzing")]
pub(crate) use layout::FLAVOR as RING_FLAVOR_WORD;
#[cfg(feature = "fuzzing")]
pub(crate) use ring::KIND as RING_KIND;
mod simple;
mod wait;

pub use bounded::{Queue, QueueIter, QueueTryIter};
pub use joinable::JoinableQueue;
pub use pipe::{Connection, pipe};
pub use simple::SimpleQueue;
pub(crate) use wait::source::Source as WaitSource;
pub use wait::{Waitable, wait};

#[cfg(test)]
use crate::sync::Event;

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::error::Error;

    #[test]
    fn put_then_get_in_one_process() {
        let q = Queue::with_capacity(4).unwrap();
        // Another handle, as a producer thread would hold: the queue is not
        // disconnected while it lives.
        let producer = q.clone();
        for i in 0..4u32 {
            q.put(i).unwrap();
        }
        assert_eq!(q.len(), 4);
        assert!(q.is_full());
        let start = Instant::now();
        let back = q.put_timeout(9, Duration::from_millis(50)).unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert!(back.error.is_timeout(), "{}", back.error);
        assert_eq!(back.into_inner(), 9, "a failed put hands the item back");
        assert_eq!(
            (0..4).map(|_| q.get().unwrap()).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert!(q.is_empty());
        assert_eq!(q.try_get().unwrap(), None);
        let err = q.get_timeout(Duration::from_millis(10)).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { after: Some(t), .. } if *t == Duration::from_millis(10)),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "a get on an empty queue timed out after 10ms"
        );
        // The last other handle goes: an empty queue that nothing can feed is
        // disconnected, for every form of get, at once.
        producer.put(5).unwrap();
        drop(producer);
        assert_eq!(q.get().unwrap(), 5, "what was queued comes first");
        assert!(q.get().unwrap_err().is_disconnected());
        assert!(q.try_get().unwrap_err().is_disconnected());
        assert!(
            q.get_timeout(Duration::from_secs(60))
                .unwrap_err()
                .is_disconnected()
        );
        assert_eq!(q.iter().count(), 0, "the blocking iterator ends");
    }

    #[test]
    fn a_queue_travels_through_a_queue() {
        let outer: SimpleQueue<Queue<String>> = SimpleQueue::new().unwrap();
        let inner = Queue::new().unwrap();
        outer.put(inner.clone()).unwrap();
        let received = outer.get().unwrap();
        received.put("through".to_string()).unwrap();
        assert_eq!(inner.get().unwrap(), "through");
        assert_eq!(inner.len(), 0);
    }

    #[test]
    fn garbage_is_reported_and_the_queue_stays_usable() {
        let q: SimpleQueue<u64> = SimpleQueue::new().unwrap();
        let raw = &q.channel;
        crate::sys::socket::send_packet(raw.tx_fd(), b"garbage", &[], &[], None).unwrap();
        let err = q.get().unwrap_err();
        assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
        q.put(7).unwrap();
        assert_eq!(q.get().unwrap(), 7);
    }

    #[test]
    fn fd_claiming_message_without_fds_is_an_error() {
        let q: SimpleQueue<Event> = SimpleQueue::new().unwrap();
        let ev = Event::new().unwrap();
        // A well-formed Event message, then the same bytes with the fd stripped.
        let mut encoded = crate::wire::encode(&ev).unwrap();
        let (a, b) = crate::sys::socket::seqpacket_pair().unwrap();
        encoded.send(a.as_fd(), None).unwrap();
        let packet = crate::wire::recv_packet(b.as_fd(), None).unwrap().unwrap();
        let mut bytes = packet.bytes.clone();
        bytes[8] = 0; // declare no fds
        crate::sys::socket::send_packet(q.channel.tx_fd(), &bytes, &[], &[], None).unwrap();
        let err = q.get().unwrap_err();
        assert!(err.to_string().contains("file descriptor #0"), "{err}");
    }

    #[test]
    fn joinable_queue_counts_tasks() {
        let q = JoinableQueue::new().unwrap();
        q.put(1u8).unwrap();
        q.put(2u8).unwrap();
        assert!(
            q.join_timeout(Duration::from_millis(10))
                .unwrap_err()
                .is_timeout()
        );
        q.get().unwrap();
        q.task_done().unwrap();
        q.get().unwrap();
        q.task_done().unwrap();
        q.join_timeout(Duration::from_millis(10)).unwrap();
        assert!(q.task_done().is_err(), "one task_done too many is an error");
    }

    #[test]
    fn pipe_carries_16_mib_and_reports_a_closed_peer() {
        let (a, b) = pipe::<Vec<u8>>().unwrap();
        let big: Vec<u8> = (0..16 << 20).map(|i: u32| (i % 251) as u8).collect();
        assert!(b.poll_timeout(Duration::ZERO).unwrap_err().is_timeout());
        a.send(big.clone()).unwrap();
        b.poll_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(b.recv().unwrap(), big);
        assert_eq!(b.try_recv().unwrap(), None);
        b.send(vec![1]).unwrap();
        assert_eq!(a.recv().unwrap(), vec![1]);
        drop(b);
        assert!(matches!(a.recv(), Err(Error::Disconnected(_))));
        let back = a.send(vec![2]).unwrap_err();
        assert!(matches!(back.error, Error::Closed(_)));
        assert_eq!(back.item, vec![2]);
    }

    #[test]
    fn closed_handle_refuses_puts_and_gets() {
        let q: SimpleQueue<u8> = SimpleQueue::new().unwrap();
        q.close();
        assert!(matches!(q.put(1).unwrap_err().error, Error::Closed(_)));
        assert!(matches!(q.get(), Err(Error::Closed(_))));
    }

    #[test]
    fn event_set_wakes_a_waiting_thread() {
        let ev = Event::new().unwrap();
        let ev2 = ev.clone();
        let waiter = std::thread::spawn(move || ev2.wait_timeout(Duration::from_secs(10)));
        ev.set();
        waiter.join().unwrap().unwrap();
        ev.clear();
        assert!(!ev.is_set());
    }
}
