//! Hostile input, the packets themselves: forged, truncated and malformed messages, fd
//! counts and indices that lie, random bytes from another process, forged packets
//! against a bounded queue, and queue, event and lock handles whose fd is of the wrong
//! kind. Every one is an `Err` that says what was wrong — never a panic, a crash or a
//! SIGBUS — and the channel stays usable after it. The tools that forge the packets are
//! in tests/common/hostile.rs; the segments behind tensor handles are
//! tests/hostile_segments.rs.

multiproc::test_init!();

mod common;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use common::hostile::*;
use multiproc::{
    Connection, DType, Error, Event, Lock, Queue, SharingStrategy, Tensor, pipe, start_processes,
};
use rustix::fs::SealFlags;

// ----- the classes -----

#[test]
fn wrong_magic_version_and_kind() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Tensor>().unwrap();
        let body = payload(&0u8);
        let cases: [(Vec<u8>, &[&str]); 6] = [
            (
                {
                    let mut p = packet(0, &body);
                    p[0] = b'X';
                    p
                },
                &["magic"],
            ),
            (
                {
                    let mut p = header(0, INLINE, 0, body.len() as u32);
                    p.extend(&body);
                    p
                },
                &["wire version 0", "version 4"],
            ),
            (
                {
                    let mut p = header(1, INLINE, 0, body.len() as u32);
                    p.extend(&body);
                    p
                },
                &["wire version 1"],
            ),
            (header(255, INLINE, 0, 0), &["wire version 255"]),
            (
                {
                    let mut p = header(VERSION, 7, 0, body.len() as u32);
                    p.extend(&body);
                    p
                },
                &["unknown packet kind 7"],
            ),
            (
                {
                    let mut p = header(VERSION, MEMFD, 0, 4);
                    p.extend([1, 2, 3, 4]);
                    p
                },
                &["fds"],
            ),
        ];
        for (bytes, says) in cases {
            send_raw(there.as_fd(), &bytes, &[]);
            assert_says(&refused(&here), says);
        }
        tensor_channel_works(&here, &there);
    });
}

#[test]
fn truncated_messages() {
    common::run(DEADLINE, || {
        for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
            multiproc::set_sharing_strategy(strategy);
            let (here, there) = pipe::<Tensor>().unwrap();
            let t = Tensor::arange(0.0, 64.0, 1.0, DType::F32).unwrap();
            let (good, fds) = capture(t.clone());
            let fds: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            // Cut anywhere: inside the header, inside the payload.
            for cut in 0..good.len() {
                send_raw(there.as_fd(), &good[..cut], &fds);
                let why = refused(&here);
                if cut == 0 && fds.is_empty() {
                    assert_says(&why, &["empty packet"]);
                } else if cut < 20 {
                    assert_says(&why, &["shorter than the 20-byte header"]);
                } else {
                    assert_says(&why, &["declares a", "bytes arrived"]);
                }
            }
            // Cut, with the header's lengths fixed up to match (all payload, no
            // references section): the value itself ends early, or names a reference
            // the packet does not list.
            for cut in 20..good.len() {
                let mut bytes = good[..cut].to_vec();
                bytes[12..16].copy_from_slice(&((cut - 20) as u32).to_le_bytes());
                bytes[16..20].copy_from_slice(&[0; 4]);
                send_raw(there.as_fd(), &bytes, &fds);
                let why = refused(&here);
                assert!(!why.is_empty());
            }
            // An empty packet is not the end of the stream.
            send_raw(there.as_fd(), &[], &[]);
            assert_says(&refused(&here), &["empty packet"]);
            tensor_channel_works(&here, &there);
            // The captured message carries a use of t's block, which no receiver has
            // adopted yet: delivered whole once, it is (here, where t holds one, it is
            // given back), and the block can be recycled again.
            send_raw(there.as_fd(), &good, &fds);
            let back: Tensor = here.recv_timeout(WAIT).unwrap();
            assert_eq!(back.data_ptr(), t.data_ptr());
            drop((fds, back, t));
        }
        multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    });
}

#[test]
fn more_or_fewer_fds_than_declared_and_indices_out_of_range() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Tensor>().unwrap();
        let seg = block(4096);
        let other = block(4096);
        let body = fd_tensor(F32, &[4], &[1], 0, 16);
        // Declares two, one arrives.
        send_raw(there.as_fd(), &packet(2, &body), &[seg.as_fd()]);
        assert_says(&refused(&here), &["declares 2 fds but 1 arrived"]);
        // Declares none, one arrives.
        send_raw(there.as_fd(), &packet(0, &payload(&0u8)), &[seg.as_fd()]);
        assert_says(&refused(&here), &["declares 0 fds but 1 arrived"]);
        // Two declared and sent, the payload uses one.
        send_raw(
            there.as_fd(),
            &packet(2, &body),
            &[seg.as_fd(), other.as_fd()],
        );
        assert_says(&refused(&here), &["fd #1 is not referred to"]);
        // A reference pointing past the fd table, and a handle past the references.
        let tensor = |reference: u32, entries: &[Reference]| WithReferences {
            payload: payload(&f32_row(4, reference, BLOCK_HEADER, 16)),
            section: section(entries),
        };
        for index in [1u32, 252, u32::MAX] {
            let body = tensor(0, &[Reference::Fd(index)]);
            send_raw(there.as_fd(), &packet(1, &body), &[seg.as_fd()]);
            assert_says(
                &refused(&here),
                &[&format!("file descriptor #{index}"), "carried 1"],
            );
            let body = tensor(index, &[Reference::Fd(0)]);
            send_raw(there.as_fd(), &packet(1, &body), &[seg.as_fd()]);
            assert_says(
                &refused(&here),
                &[&format!("reference #{index}"), "lists 1"],
            );
        }
        // Two handles naming one reference, and a reference no handle names.
        let two = WithReferences {
            payload: payload(&(
                f32_row(4, 0, BLOCK_HEADER, 16),
                f32_row(4, 0, BLOCK_HEADER, 16),
            )),
            section: section(&[Reference::Fd(0)]),
        };
        let (pair_here, pair_there) = pipe::<(Tensor, Tensor)>().unwrap();
        send_raw(pair_there.as_fd(), &packet(1, &two), &[seg.as_fd()]);
        assert_says(&refused(&pair_here), &["reference #0", "named already"]);
        let extra = tensor(0, &[Reference::Fd(0), Reference::Fd(0)]);
        send_raw(there.as_fd(), &packet(1, &extra), &[seg.as_fd()]);
        assert_says(&refused(&here), &["lists 2 references", "#1 is not named"]);
        // A references section that lies about its entries.
        let mut lying = tensor(0, &[Reference::Fd(0)]);
        lying.section[0] = 9;
        send_raw(there.as_fd(), &packet(1, &lying), &[seg.as_fd()]);
        assert_says(&refused(&here), &["references section"]);
        tensor_channel_works(&here, &there);
    });
}

#[test]
fn queue_event_and_lock_handles_whose_fd_is_of_the_wrong_kind() {
    common::run(DEADLINE, || {
        // A queue whose ends are not SEQPACKET sockets.
        let (here, there) = pipe::<Queue<u32>>().unwrap();
        let (_real, raw) = capture(Queue::<u32>::new().unwrap());
        assert_eq!(
            raw.len(),
            6,
            "a queue travels as two sockets, its ring, the two sockets of its custody and \
             its holder lease"
        );
        let body = payload(&(0u32, 1u32, 2u32, 3u32, 4u32, 5u32));
        let m = sealed(4096);
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&m, &m, &raw[2], &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["queue or pipe end is not a socket"]);
        let (s1, _s2) = std::os::unix::net::UnixStream::pair().unwrap();
        let s1 = OwnedFd::from(s1);
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&s1, &s1, &raw[2], &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["not SEQPACKET"]);
        // A custody socket of the wrong kind.
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &raw[2], &s1, &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["not SEQPACKET"]);
        // Sockets, a short memfd, or a block of another kind where the ring should be.
        let (a, b) = seqpacket();
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&a, &b, &a, &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(
            &refused(&here),
            &["received as a queue's ring is not a sealed multiproc memfd"],
        );
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &m, &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(
            &refused(&here),
            &["received as a queue's ring is 4096 bytes"],
        );
        // Big enough, but not a ring (its kind word says so).
        let not_a_ring = sealed(4096 + (1 << 20));
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &not_a_ring, &raw[3], &raw[4], &raw[5]]),
        );
        assert_says(&refused(&here), &["another kind"]);
        // A holder lease that is a socket.
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &raw[2], &raw[3], &raw[4], &s1]),
        );
        assert_says(&refused(&here), &["holder lease", "not a regular file"]);
        // And the real thing works.
        send_raw(
            there.as_fd(),
            &packet(6, &body),
            &with([&raw[0], &raw[1], &raw[2], &raw[3], &raw[4], &raw[5]]),
        );
        let q = here.recv_timeout(WAIT).unwrap();
        q.put(5).map_err(|e| e.error).unwrap();
        assert_eq!(q.get_timeout(WAIT).unwrap(), 5);
        drop((q, here, there));

        // Events and locks: a socket, a short memfd, a block of another kind.
        let (here, there) = pipe::<Event>().unwrap();
        let event = Event::new().unwrap();
        let lock = Lock::new().unwrap();
        let (_, event_fds) = capture(event.clone());
        let (_, lock_fds) = capture(lock.clone());
        let idx = payload(&0u32);
        send_raw(there.as_fd(), &packet(1, &idx), &[a.as_fd()]);
        assert_says(
            &refused(&here),
            &["received as an Event is not a sealed multiproc memfd"],
        );
        send_raw(there.as_fd(), &packet(1, &idx), &[sealed(100).as_fd()]);
        assert_says(&refused(&here), &["is 100 bytes, fewer than", "fewer than"]);
        send_raw(there.as_fd(), &packet(1, &idx), &[lock_fds[0].as_fd()]);
        assert_says(&refused(&here), &["another kind"]);
        send_raw(there.as_fd(), &packet(1, &idx), &[event_fds[0].as_fd()]);
        let ev = here.recv_timeout(WAIT).unwrap();
        ev.set();
        assert!(event.is_set(), "the received event is the real one");
        drop((ev, here, there));

        let (here, there) = pipe::<Lock>().unwrap();
        send_raw(there.as_fd(), &packet(1, &idx), &[event_fds[0].as_fd()]);
        assert_says(&refused(&here), &["sent as a Lock", "another kind"]);
        send_raw(there.as_fd(), &packet(1, &idx), &[lock_fds[0].as_fd()]);
        let l = here.recv_timeout(WAIT).unwrap();
        l.acquire_timeout(Duration::ZERO).unwrap();
        assert!(lock.is_locked(), "the received lock is the real one");
        l.release().unwrap();
    });
}

// --- random bytes, from another process ---

use common::Rng;

const RANDOM_PACKETS: u32 = 3000;

/// Sends random packets: pure noise, a valid header over noise, and real messages with
/// bytes flipped, with 0–3 fds of assorted kinds; then a sentinel.
fn send_random(_rank: usize, (conn, seed): (Connection<(u64, Tensor)>, u64)) -> Result<(), String> {
    let mut rng = Rng(seed);
    let t = Tensor::arange(0.0, 256.0, 1.0, DType::F32).map_err(|e| e.to_string())?;
    let (real, real_fds) = capture((7u64, t.narrow(0, 3, 100).map_err(|e| e.to_string())?));
    let pool: Vec<OwnedFd> = vec![
        sealed(4096),
        sealed(64),
        memfd(4096, SealFlags::empty()),
        seqpacket().0,
        real_fds[0].try_clone().map_err(|e| e.to_string())?,
    ];
    for _ in 0..RANDOM_PACKETS {
        let mut bytes: Vec<u8> = match rng.below(3) {
            0 => (0..rng.below(200)).map(|_| rng.next_u64() as u8).collect(),
            1 => {
                let mut b = header(VERSION, rng.below(3) as u8, rng.below(4) as u32, 0);
                let body: Vec<u8> = (0..rng.below(120)).map(|_| rng.next_u64() as u8).collect();
                b[12..16].copy_from_slice(&(body.len() as u32).to_le_bytes());
                b.extend(body);
                b
            }
            _ => real.clone(),
        };
        for _ in 0..rng.below(4) {
            if !bytes.is_empty() {
                let i = rng.below(bytes.len() as u64) as usize;
                bytes[i] ^= 1 << rng.below(8);
            }
        }
        let fds: Vec<BorrowedFd<'_>> = (0..rng.below(4))
            .map(|_| pool[rng.below(pool.len() as u64) as usize].as_fd())
            .collect();
        send_raw(conn.as_fd(), &bytes, &fds);
    }
    conn.send((
        u64::MAX,
        Tensor::full(&[3], 1.0, DType::F32).map_err(|e| e.to_string())?,
    ))
    .map_err(|e| e.error.to_string())
}

#[test]
fn random_bytes_from_another_process() {
    let seed = std::env::var("MULTIPROC_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    random_packets_then_a_valid_message(seed);
}

/// Seeds that once lost the final valid message: an empty packet queued behind the
/// sender's exit was read as the end of the stream, and a forged plain-segment handle
/// to the sender's arena made the real block handle that followed look wrong.
#[test]
fn random_bytes_seeds_that_once_lost_the_last_message() {
    for seed in [1796322591613810451, 1796322639706174250] {
        random_packets_then_a_valid_message(seed);
    }
}

/// Empty packets (which read as 0 bytes, like the end of the stream) queued before and
/// after a real message, with the sender gone: each one before it is refused, the real
/// message arrives, and only then is the channel closed (the empty packet behind the
/// last message reads as that end: nothing is left to lose).
#[test]
fn empty_packets_behind_a_hung_up_sender_are_not_the_end() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<u32>().unwrap();
        send_raw(there.as_fd(), &[], &[]);
        send_raw(there.as_fd(), &[], &[]);
        there.send(7).map_err(|e| e.error).unwrap();
        send_raw(there.as_fd(), &[], &[]);
        drop(there);
        assert_says(&refused(&here), &["empty packet"]);
        assert_says(&refused(&here), &["empty packet"]);
        assert_eq!(here.recv_timeout(WAIT).unwrap(), 7);
        for _ in 0..2 {
            match here.recv_timeout(WAIT) {
                Err(Error::Disconnected(_)) => {}
                other => panic!("expected the end of the channel, got {other:?}"),
            }
        }
    });
}

fn random_packets_then_a_valid_message(seed: u64) {
    common::run(DEADLINE, move || {
        eprintln!("random packets seed: {seed} (MULTIPROC_FAULT_SEED={seed} replays it)");
        let (here, there) = pipe::<(u64, Tensor)>().unwrap();
        let mut ctx =
            start_processes(send_random, (there, seed), 1, multiproc::StartMethod::Spawn).unwrap();
        let (mut refused, mut accepted) = (0u32, 0u32);
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(Instant::now() < until, "the random packets took too long");
            match here.recv_timeout(WAIT) {
                Ok((u64::MAX, t)) => {
                    assert_eq!(t.sum().unwrap(), 3.0);
                    break;
                }
                // A mutation that still decodes is a valid message: it must be safe
                // to use (this reads every element it addresses; a storage that is not
                // aligned for its dtype is a clear error, never a crash).
                Ok((_, t)) => {
                    let _ = t.sum();
                    accepted += 1;
                }
                Err(e) if e.is_timeout() => panic!("the sender went quiet (seed {seed})"),
                Err(Error::InvalidMessage(_)) | Err(Error::FdLimit { .. }) => refused += 1,
                Err(e) => panic!(
                    "packet {}: unexpected {e} (seed {seed})",
                    refused + accepted
                ),
            }
        }
        assert_eq!(
            refused + accepted,
            RANDOM_PACKETS,
            "every packet had one outcome"
        );
        eprintln!("random packets: {refused} refused, {accepted} accepted, 0 crashes");
        ctx.join_timeout(WAIT).unwrap();
    });
}

/// Forged packets written straight into a bounded queue's socket took no place, so
/// taking them must give none back: the capacity stays exact.
#[test]
fn forged_packets_never_give_a_bounded_queue_extra_places() {
    common::run(DEADLINE, || {
        const CAPACITY: u32 = 8;
        let q = Queue::<u32>::with_capacity(CAPACITY as usize).unwrap();
        let (_, raw) = capture(q.clone());
        let tx = raw[0].as_fd();
        let mut flagged = header(VERSION, INLINE, 0, 3);
        flagged[6] = 1; // claims a put counted it
        flagged.extend([0xff, 0xff, 0xff]); // but the payload is no u32
        let mut forged: Vec<Vec<u8>> = vec![
            b"random bytes, not a packet".to_vec(),
            header(VERSION + 1, INLINE, 0, 0),
            header(VERSION, 7, 0, 0),
            packet(0, &vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            flagged,
        ];
        let mut seed = 0x5eed_u64;
        while forged.len() < 20 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            forged.push(seed.to_le_bytes().to_vec());
        }
        for (i, bytes) in forged.iter().enumerate() {
            send_raw(tx, bytes, &[]);
            match q.get_timeout(WAIT) {
                Err(Error::InvalidMessage(_)) => {}
                other => {
                    panic!("forged packet {i} ({bytes:?}): expected InvalidMessage, got {other:?}")
                }
            }
        }
        let mut accepted = 0;
        for v in 0..CAPACITY + 20 {
            // A full queue has no place: the put times out at once (nobody gets).
            match q.put_timeout(v, Duration::from_millis(50)) {
                Ok(()) => accepted += 1,
                Err(e) => {
                    assert!(matches!(e.error, Error::Timeout { .. }), "{:?}", e.error);
                    break;
                }
            }
        }
        assert_eq!(
            accepted, CAPACITY,
            "a queue of capacity {CAPACITY} accepted {accepted} puts after 20 forged packets"
        );
        assert!(q.is_full());
        assert_eq!(q.len(), CAPACITY as usize);
        for v in 0..CAPACITY {
            assert_eq!(q.get_timeout(WAIT).unwrap(), v);
        }
        assert_eq!(q.len(), 0);
    });
}
