//! Tensor sharing in one process, and tensors through the wire (encode → seqpacket
//! pair → receive → decode); the operations and views are in `tests/operations.rs`.

use std::os::fd::{AsFd, OwnedFd};

use serde::{Deserialize, Serialize, Serializer};

use super::*;
use crate::SharingStrategy;
use crate::sys::socket;
use crate::wire;

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

fn is_tensor_error<T: fmt::Debug>(r: Result<T>) -> String {
    match r {
        Err(Error::Tensor(m)) => m,
        other => panic!("expected Error::Tensor, got {other:?}"),
    }
}

// Construction, views and operations in one process: `tests/operations.rs`.
mod operations;

/// A 3×4 grid of `0..12` (f32), for views.
fn grid() -> Tensor {
    // [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    Tensor::arange(0.0, 12.0, 1.0, DType::F32)
        .unwrap()
        .view(&[3, 4])
        .unwrap()
}

// ----- sharing in one process -----

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn share_memory_moves_in_place_and_views_follow() {
    crate::manager::serve_in_this_process();
    for strategy in crate::get_all_sharing_strategies() {
        let g = grid();
        let col = g.select(1, 1).unwrap();
        assert!(!g.is_shared());
        let before = col.data_ptr() as usize - g.data_ptr() as usize;
        g.storage().share_memory_with(*strategy).unwrap();
        assert!(g.is_shared() && col.is_shared());
        assert_eq!(g.storage().sharing_strategy(), Some(*strategy));
        assert_eq!(col.data_ptr() as usize - g.data_ptr() as usize, before);
        assert_eq!(f32s(&col), [1., 5., 9.]);
        col.fill_(0.0).unwrap();
        assert_eq!(g.sum().unwrap(), 66.0 - 15.0);
        g.storage().share_memory_with(*strategy).unwrap();
        match strategy {
            SharingStrategy::FileSystem => {
                // A small storage lives in a named arena (its name's lifetime is
                // `shm::tests`' subject).
                let name = g.storage().shm_name().unwrap();
                assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists());
                assert!(g.storage().segment().unwrap().0.is_block());
            }
            SharingStrategy::FileDescriptor => assert_eq!(g.storage().shm_name(), None),
        }
    }
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn small_storages_share_arenas_and_large_ones_do_not() {
    let a = Tensor::zeros(&[3], DType::U8).unwrap();
    let b = Tensor::zeros(&[100], DType::F32).unwrap();
    let big = Tensor::zeros(&[crate::shm::allocate_small_max() + 1], DType::U8).unwrap();
    for t in [&a, &b, &big] {
        t.storage()
            .share_memory_with(SharingStrategy::FileDescriptor)
            .unwrap();
    }
    let ((sa, oa), (sb, ob), (sbig, obig)) = (
        a.storage().segment().unwrap(),
        b.storage().segment().unwrap(),
        big.storage().segment().unwrap(),
    );
    // A large storage has a block of its own, after the block header.
    assert_eq!(obig, crate::shm::BLOCK_HEADER_LEN);
    assert_eq!(
        sbig.len(),
        big.storage().nbytes() + crate::shm::BLOCK_HEADER_LEN
    );
    assert_eq!(oa % 64, 0);
    assert_eq!(ob % 64, 0);
    if std::sync::Arc::ptr_eq(&sa, &sb) {
        assert!(ob >= oa + 64 || oa >= ob + 400, "slices do not overlap");
    }
    b.fill_(2.0).unwrap();
    a.fill_(255.0).unwrap();
    assert_eq!(b.sum().unwrap(), 200.0);
    // A received slice keeps its offset.
    let (ra, rb): (Tensor, Tensor) = roundtrip(&(a.clone(), b.clone())).unwrap();
    assert_eq!((ra.data_ptr(), rb.data_ptr()), (a.data_ptr(), b.data_ptr()));
    assert_eq!(rb.sum().unwrap(), 200.0);
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn empty_storage_shares_without_a_segment() {
    let t = Tensor::zeros(&[0, 3], DType::F64).unwrap();
    t.share_memory_().unwrap();
    assert!(t.is_shared());
    assert_eq!(t.storage().sharing_strategy(), None);
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn share_memory_waits_for_concurrent_writers_and_loses_no_update() {
    let t = Tensor::zeros(&[8, 1024], DType::I64).unwrap();
    std::thread::scope(|s| {
        for row in 0..8 {
            let r = t.select(0, row).unwrap();
            s.spawn(move || {
                for _ in 0..200 {
                    r.add_scalar_(1.0).unwrap();
                }
            });
        }
        let t = t.clone();
        s.spawn(move || t.share_memory_().unwrap());
    });
    assert!(t.is_shared());
    assert_eq!(t.sum().unwrap(), 200.0 * 8.0 * 1024.0);
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn hogwild_updates_from_many_threads_are_defined() {
    let t = Tensor::zeros(&[4096], DType::F32).unwrap();
    t.share_memory_().unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            let t = t.clone();
            s.spawn(move || {
                for _ in 0..50 {
                    t.add_scalar_(1.0).unwrap();
                }
            });
        }
    });
    // Racing read-modify-writes may lose updates, never produce garbage.
    let v = f32s(&t);
    assert!(
        v.iter()
            .all(|&x| (50.0..=200.0).contains(&x) && x.fract() == 0.0)
    );
}

// ----- through the wire -----

fn send_all<T: Serialize>(value: &T) -> Result<(OwnedFd, OwnedFd)> {
    let (a, b) = socket::seqpacket_pair()?;
    let mut enc = wire::encode(value)?;
    enc.send(a.as_fd(), None)?;
    Ok((a, b))
}

fn receive<T: serde::de::DeserializeOwned>(b: &OwnedFd) -> Result<T> {
    let p = wire::recv_packet(b.as_fd(), None)?.expect("no deadline");
    wire::decode(p, &crate::shm::Returns::plain())
}

fn roundtrip<T: Serialize + serde::de::DeserializeOwned>(value: &T) -> Result<T> {
    let (_a, b) = send_all(value)?;
    receive(&b)
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn a_tensor_round_trips_and_aliases_the_original() {
    let g = grid();
    let view = g.transpose(0, 1).unwrap().narrow(0, 1, 2).unwrap();
    let back: Tensor = roundtrip(&view).unwrap();
    assert!(g.is_shared(), "sending shared the storage in place");
    assert!(back.is_shared());
    assert_eq!(back.shape(), view.shape());
    assert_eq!(back.strides(), view.strides());
    assert_eq!(back.storage_offset(), view.storage_offset());
    assert_eq!(back.dtype(), DType::F32);
    assert_eq!(f32s(&back), f32s(&view));
    assert_eq!(back.data_ptr(), view.data_ptr(), "one mapping per process");
    back.fill_(0.0).unwrap();
    assert_eq!(g.sum().unwrap(), 66.0 - (1. + 5. + 9. + 2. + 6. + 10.));
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn views_alias_within_one_message_and_across_messages() {
    crate::manager::serve_in_this_process();
    for strategy in crate::get_all_sharing_strategies() {
        let g = grid();
        g.storage().share_memory_with(*strategy).unwrap();
        let (r0, r1): (Tensor, Tensor) =
            roundtrip(&(g.select(0, 0).unwrap(), g.select(0, 2).unwrap())).unwrap();
        let again: Tensor = roundtrip(&g).unwrap();
        assert_eq!(r0.data_ptr() as usize + 8 * 4, r1.data_ptr() as usize);
        assert_eq!(again.data_ptr(), g.data_ptr());
        assert!(
            Storage::ptr_eq(r0.storage(), r1.storage()),
            "one storage, as in torch"
        );
        assert!(
            Storage::ptr_eq(again.storage(), g.storage()),
            "sent and received here"
        );
        r1.fill_(7.0).unwrap();
        assert_eq!(f32s(&again.select(0, 2).unwrap()), [7.0; 4]);
        // A storage of its own block (not an arena other tests carve from at the same
        // time), so its counts are this test's alone.
        let big = Tensor::zeros(&[(crate::shm::allocate_small_max() / 4) + 1], DType::F32).unwrap();
        big.storage().share_memory_with(*strategy).unwrap();
        let (seg, _) = big.storage().segment().unwrap();
        let (b0, b1): (Tensor, Tensor) =
            roundtrip(&(big.narrow(0, 0, 4).unwrap(), big.clone())).unwrap();
        assert!(
            Storage::ptr_eq(b0.storage(), big.storage())
                && Storage::ptr_eq(b1.storage(), big.storage())
        );
        assert_eq!(
            seg.uses(),
            Some(1),
            "{strategy}: the messages' uses were given back"
        );
        if *strategy == SharingStrategy::FileSystem {
            assert_eq!(
                seg.refcount(),
                Some(2),
                "the pool's reference and the one use"
            );
        }
    }
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn empty_tensors_of_every_dtype_round_trip() {
    for dtype in DType::ALL {
        for shape in [&[0][..], &[2, 0, 3][..]] {
            let t = Tensor::zeros(shape, dtype).unwrap();
            let back: Tensor = roundtrip(&t).unwrap();
            assert_eq!((back.dtype(), back.shape()), (dtype, shape));
            assert!(back.is_shared());
            assert_eq!(back.numel(), 0);
        }
    }
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn tensors_nested_in_values_travel() {
    #[derive(Serialize, Deserialize)]
    struct Batch {
        id: u32,
        xs: Vec<Tensor>,
        named: std::collections::BTreeMap<String, (Tensor, i8)>,
    }
    let x = Tensor::ones(&[4], DType::F64).unwrap();
    let mut named = std::collections::BTreeMap::new();
    named.insert("x".to_string(), (x.narrow(0, 1, 2).unwrap(), -1));
    let batch = Batch {
        id: 3,
        xs: vec![x.clone(), Tensor::zeros(&[2], DType::I32).unwrap()],
        named,
    };
    let back: Batch = roundtrip(&batch).unwrap();
    assert_eq!(back.id, 3);
    assert_eq!(back.xs[0].data_ptr(), x.data_ptr());
    assert_eq!(back.named["x"].0.to_vec::<f64>().unwrap(), [1.0, 1.0]);
}

#[test]
fn serializing_outside_a_channel_is_an_error_and_shares_nothing() {
    let t = Tensor::zeros(&[3], DType::F32).unwrap();
    let err = serde_json::to_string(&t).unwrap_err();
    assert!(err.to_string().contains("multiproc channel"), "{err}");
    assert!(!t.is_shared());
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn an_unsent_file_system_message_gives_its_reference_back() {
    crate::manager::serve_in_this_process();
    // Its own block, so the counts are this test's alone.
    let t = Tensor::zeros(&[crate::shm::allocate_small_max() + 1], DType::U8).unwrap();
    t.storage()
        .share_memory_with(SharingStrategy::FileSystem)
        .unwrap();
    let (seg, _) = t.storage().segment().unwrap();
    assert_eq!(
        (seg.uses(), seg.refcount()),
        (Some(1), Some(2)),
        "t's use, the pool's reference"
    );
    let enc = wire::encode(&t).unwrap();
    assert_eq!(
        (seg.uses(), seg.refcount()),
        (Some(2), Some(3)),
        "and the message's"
    );
    drop(enc);
    assert_eq!((seg.uses(), seg.refcount()), (Some(1), Some(2)));
    let name = t.storage().shm_name().unwrap();
    drop(t);
    assert_eq!(
        (seg.uses(), seg.refcount()),
        (Some(0), Some(1)),
        "the pool keeps it"
    );
    assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists());
    crate::shm::release_idle_blocks();
    assert_eq!(seg.refcount(), Some(0));
    assert!(
        !std::path::Path::new(&format!("/dev/shm/{name}")).exists(),
        "unpooled and unused: gone"
    );
}

// A forged tensor message: the same wire layout with handles we choose.
#[derive(Serialize)]
struct ForgedHandle {
    reference: u32,
    offset: u64,
    nbytes: u64,
}

#[derive(Serialize)]
enum ForgedStorage {
    #[allow(dead_code)]
    Empty,
    Segment(ForgedHandle),
}

/// A forger's entry in the references section: it took no use.
struct NoUse;

impl wire::Carried for NoUse {
    fn sent(self: Box<Self>) {}
}

/// A block handle: its memfd, the bytes it claims, and where they start after the block
/// header.
struct ForgedFd(OwnedFd, u64, u64);

impl Serialize for ForgedFd {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let enc = wire::Encoder::current("a forged tensor").map_err(S::Error::custom)?;
        let index = enc.attach_fd(self.0.as_fd()).map_err(S::Error::custom)?;
        let reference = enc.carry_reference(
            &wire::Reference::Fd(index),
            wire::CarriedRef::Other(Box::new(NoUse)),
        );
        ForgedStorage::Segment(ForgedHandle {
            reference,
            offset: self.2.saturating_add(crate::shm::BLOCK_HEADER_LEN as u64),
            nbytes: self.1,
        })
        .serialize(s)
    }
}

/// A named block's handle: its name, offset and length, and the block when the sender
/// takes a use of it as an honest one would (else it takes none).
struct ForgedName {
    name: String,
    offset: u64,
    nbytes: u64,
    block: Option<std::sync::Arc<crate::shm::Segment>>,
}

impl Serialize for ForgedName {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let enc = wire::Encoder::current("a forged tensor").map_err(S::Error::custom)?;
        let carried = match &self.block {
            Some(block) => {
                wire::CarriedRef::Use(wire::InFlightUse::take(std::sync::Arc::clone(block) as _))
            }
            None => wire::CarriedRef::Other(Box::new(NoUse)),
        };
        let reference = enc.carry_reference(
            &wire::Reference::Name(std::borrow::Cow::Borrowed(&self.name)),
            carried,
        );
        ForgedStorage::Segment(ForgedHandle {
            reference,
            offset: self.offset,
            nbytes: self.nbytes,
        })
        .serialize(s)
    }
}

#[derive(Serialize)]
struct ForgedTensor<S> {
    dtype: u8,
    shape: Vec<u64>,
    strides: Vec<u64>,
    offset: u64,
    storage: S,
}

/// A sealed memfd laid out as a block (the magic, then `len` bytes after the header).
fn sealed_memfd(len: u64) -> OwnedFd {
    let header = crate::shm::BLOCK_HEADER_LEN as u64;
    let fd = crate::sys::memfd::create("forged", header + len).unwrap();
    crate::sys::memfd::write_all_at(fd.as_fd(), &crate::shm::BLOCK_MAGIC_BYTES).unwrap();
    crate::sys::memfd::seal_size(fd.as_fd()).unwrap();
    fd
}

fn decode_forged<S: Serialize>(t: ForgedTensor<S>) -> Error {
    match roundtrip_forged(&t) {
        Ok(t) => panic!("a forged tensor was accepted: {t:?}"),
        Err(e) => e,
    }
}

fn roundtrip_forged<S: Serialize>(t: &ForgedTensor<S>) -> Result<Tensor> {
    let (_a, b) = send_all(t)?;
    receive(&b)
}

fn forged(
    storage: impl Serialize,
    dtype: u8,
    shape: &[u64],
    strides: &[u64],
    offset: u64,
) -> Error {
    decode_forged(ForgedTensor {
        dtype,
        shape: shape.to_vec(),
        strides: strides.to_vec(),
        offset,
        storage,
    })
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn forged_handles_are_errors_not_crashes() {
    let check = |e: Error, what: &str| {
        assert!(matches!(e, Error::InvalidMessage(_)), "{e:?}");
        assert!(e.to_string().contains(what), "{e} should mention {what:?}");
    };
    // A length bigger than the segment.
    check(
        forged(ForgedFd(sealed_memfd(4096), 1 << 20, 0), 0, &[16], &[1], 0),
        "claims 1048704 bytes but its segment holds 4224",
    );
    // A memfd that can shrink under us.
    let unsealed = crate::sys::memfd::create("forged", 4096).unwrap();
    check(
        forged(ForgedFd(unsealed, 4096, 0), 0, &[16], &[1], 0),
        "sealed",
    );
    // Not a memfd at all.
    let null: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
    check(forged(ForgedFd(null, 16, 0), 0, &[1], &[1], 0), "sealed");
    // A layout past the storage, an overflowing one, too many strides, unknown dtype.
    check(
        forged(ForgedFd(sealed_memfd(64), 64, 0), 0, &[17], &[1], 0),
        "layout",
    );
    check(
        forged(ForgedFd(sealed_memfd(64), 64, 0), 0, &[2], &[u64::MAX], 0),
        "layout",
    );
    check(
        forged(ForgedFd(sealed_memfd(64), 64, 0), 0, &[2], &[1], u64::MAX),
        "layout",
    );
    check(
        forged(ForgedFd(sealed_memfd(64), 64, 0), 0, &[2], &[1, 1], 0),
        "strides",
    );
    // A slice past the end of its segment, and one whose end overflows.
    check(
        forged(ForgedFd(sealed_memfd(4096), 64, 4090), 0, &[1], &[1], 0),
        "claims 4282 bytes",
    );
    check(
        forged(
            ForgedFd(sealed_memfd(4096), 64, u64::MAX - 70),
            0,
            &[1],
            &[1],
            0,
        ),
        "past any segment",
    );
    check(
        forged(ForgedFd(sealed_memfd(64), 64, 0), 77, &[2], &[1], 0),
        "dtype code 77",
    );
    // Named segments: a name that is not ours, one that does not exist.
    let named = |name: &str| ForgedName {
        name: name.to_string(),
        offset: 128,
        nbytes: 64,
        block: None,
    };
    check(
        forged(named("../../etc/passwd"), 0, &[1], &[1], 0),
        "not a multiproc segment name",
    );
    check(
        forged(
            named("multiproc_1_00000000000000000000000000000000"),
            0,
            &[1],
            &[1],
            0,
        ),
        "no longer exists",
    );
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn a_forged_length_on_a_real_named_segment_is_an_error() {
    crate::manager::serve_in_this_process();
    // Its own block, so the counts are this test's alone.
    let t = Tensor::zeros(&[crate::shm::allocate_small_max() + 1], DType::U8).unwrap();
    t.storage()
        .share_memory_with(SharingStrategy::FileSystem)
        .unwrap();
    let name = t.storage().shm_name().unwrap();
    let (seg, _) = t.storage().segment().unwrap();
    let counts = (seg.uses(), seg.refcount());
    // Mapped here already: judged against the mapping. The sender took a use for the
    // receiver, as an honest one does: the refused packet gives it back.
    let e = forged(
        ForgedName {
            name: name.clone(),
            offset: 128,
            nbytes: 1 << 30,
            block: Some(std::sync::Arc::clone(&seg)),
        },
        0,
        &[1],
        &[1],
        0,
    );
    assert!(e.to_string().contains("claims 1073741952 bytes"), "{e}");
    assert_eq!(
        (seg.uses(), seg.refcount()),
        counts,
        "a refused packet gives back the use it carried, and nothing else"
    );
    assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists());
}

/// A tensor on a block of its own under `strategy`, and its block.
fn own_block(strategy: SharingStrategy) -> (Tensor, std::sync::Arc<crate::shm::Segment>) {
    let t = Tensor::zeros(&[crate::shm::allocate_small_max() + 1], DType::U8).unwrap();
    t.storage().share_memory_with(strategy).unwrap();
    let (seg, _) = t.storage().segment().unwrap();
    (t, seg)
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn a_message_refused_after_its_handles_decoded_gives_back_what_it_carried() {
    crate::manager::serve_in_this_process();
    for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        let (t, seg) = own_block(strategy);
        let before = (seg.uses(), seg.refcount());
        let (_a, b) = send_all(&(t.clone(), 5u8, t.clone())).unwrap();
        assert_eq!(
            seg.uses(),
            before.0.map(|u| u + 2),
            "{strategy}: two uses in flight"
        );
        // The tensors decode (and adopt their uses), then the rest does not fit the type.
        let e = receive::<(Tensor, String, Tensor)>(&b).unwrap_err();
        assert!(matches!(e, Error::InvalidMessage(_)), "{e}");
        assert_eq!(
            (seg.uses(), seg.refcount()),
            before,
            "{strategy}: the refused message gave back each use it carried, once"
        );
    }
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn a_message_dropped_unread_gives_back_what_it_carried() {
    crate::manager::serve_in_this_process();
    for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        let (t, seg) = own_block(strategy);
        let before = (seg.uses(), seg.refcount());
        let (_a, b) = send_all(&vec![t.clone(), t.clone(), t.clone()]).unwrap();
        assert_eq!(seg.uses(), before.0.map(|u| u + 3));
        let packet = wire::recv_packet(b.as_fd(), None).unwrap().unwrap();
        wire::give_back_unread(packet, &*crate::shm::Returns::plain());
        assert_eq!((seg.uses(), seg.refcount()), before, "{strategy}");
        // Received and decoded, the same message's uses are the tensors'.
        let (_a, b) = send_all(&vec![t.clone(), t.clone()]).unwrap();
        let got: Vec<Tensor> = receive(&b).unwrap();
        assert_eq!(seg.uses().map(|u| u >= 1), Some(true));
        drop(got);
        assert_eq!(
            (seg.uses(), seg.refcount()),
            before,
            "{strategy}: decoded, then dropped"
        );
    }
}

/// Rough figures, not a timed test: `cargo test --release -p multiproc --lib perf_figures
/// -- --ignored --nocapture`.
#[test]
#[ignore]
fn perf_figures() {
    crate::manager::serve_in_this_process();
    use std::time::Instant;
    let n = 16 << 20; // 64 MiB of f32
    let mut plain = vec![0f32; n];
    let t0 = Instant::now();
    for _ in 0..5 {
        plain
            .iter_mut()
            .for_each(|x| *x = std::hint::black_box(1.0));
        std::hint::black_box(plain.iter().map(|&x| x as f64).sum::<f64>());
    }
    let base = t0.elapsed() / 5;
    let t = Tensor::zeros(&[n], DType::F32).unwrap();
    t.share_memory_().unwrap();
    for _ in 0..3 {
        let t0 = Instant::now();
        t.fill_(1.0).unwrap();
        let fill = t0.elapsed();
        let t0 = Instant::now();
        assert_eq!(t.sum().unwrap(), n as f64);
        let sum = t0.elapsed();
        let t0 = Instant::now();
        plain.fill(2.0);
        let memset = t0.elapsed();
        println!("64 MiB: fill_ {fill:?}, sum {sum:?}; memset {memset:?} (plain loop {base:?})");
    }

    for strategy in crate::get_all_sharing_strategies() {
        let (a, b) = socket::seqpacket_pair().unwrap();
        let count = 20_000;
        let t0 = Instant::now();
        for _ in 0..count {
            let x = Tensor::zeros(&[64], DType::F32).unwrap();
            x.storage().share_memory_with(*strategy).unwrap();
            x.fill_(1.0).unwrap();
            wire::encode(&x).unwrap().send(a.as_fd(), None).unwrap();
            drop(x);
            let y: Tensor = receive(&b).unwrap();
            assert_eq!(y.sum().unwrap(), 64.0);
        }
        let dt = t0.elapsed();
        println!(
            "{strategy}: {count} fresh 64-f32 tensors through a socket in one process: {:.0}/s",
            count as f64 / dt.as_secs_f64()
        );
    }
}

#[test]
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<Tensor>();
    send_sync::<Storage>();
    send_sync::<DType>();
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn blocks_are_recycled_only_when_unused() {
    let n = (1 << 20) + 4096; // a size no other test uses, so the pool's block is ours
    let shared = || {
        let s = Storage::new_shared_with(n, SharingStrategy::FileDescriptor).unwrap();
        Tensor::from_storage(s, DType::U8, &[n], &[1], 0).unwrap()
    };
    let a = shared();
    a.fill_(7.0).unwrap();
    let (seg_a, _) = a.storage().segment().unwrap();
    assert_eq!(seg_a.uses(), Some(1));
    // In use: a second tensor of the same size gets another block.
    let b = shared();
    let (seg_b, _) = b.storage().segment().unwrap();
    assert!(!std::sync::Arc::ptr_eq(&seg_a, &seg_b));
    // Sent and received in this process: the same storage, no extra use left behind.
    let q = crate::Queue::new().unwrap();
    q.put(a.clone()).unwrap();
    assert_eq!(seg_a.uses(), Some(2), "the message in flight holds a use");
    let back: Tensor = q.get().unwrap();
    assert!(Storage::ptr_eq(back.storage(), a.storage()));
    assert_eq!(seg_a.uses(), Some(1));
    drop((a, back));
    assert_eq!(seg_a.uses(), Some(0));
    // Unused: recycled, and zeroed again for `zeros_shared`.
    let c = shared();
    let (seg_c, _) = c.storage().segment().unwrap();
    assert!(std::sync::Arc::ptr_eq(&seg_a, &seg_c));
    assert_eq!(c.sum().unwrap(), 0.0);
    drop((b, c));
}

/// Hogwild on a private storage from several threads: element access is relaxed
/// atomics, so racing updates may be lost but are never undefined behaviour (this one
/// runs under Miri, whose race detector checks exactly that).
#[test]
fn racing_in_place_updates_on_a_private_storage_are_defined() {
    let t = Tensor::zeros(&[64], DType::F32).unwrap();
    let rounds = 20;
    std::thread::scope(|s| {
        for _ in 0..4 {
            let t = t.clone();
            s.spawn(move || {
                for _ in 0..rounds {
                    t.add_scalar_(1.0).unwrap();
                }
            });
        }
    });
    for v in t.to_vec::<f32>().unwrap() {
        assert!((rounds as f32..=4.0 * rounds as f32).contains(&v), "{v}");
    }
}
