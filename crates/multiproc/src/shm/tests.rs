//! Segments in one process: creation, the checks on received segments, the header
//! refcount, and the map cache.

use std::os::fd::AsFd;
use std::path::Path;

use rustix::fs::{Mode, OFlags, SealFlags};

use super::cache::{self, CacheKey};
use super::*;

fn exists(name: &SegmentName) -> bool {
    Path::new(&name::shm_path(name)).exists()
}

fn invalid(r: Result<Segment>) -> String {
    match r {
        Err(Error::InvalidMessage(m)) => m,
        Err(e) => panic!("expected InvalidMessage, got {e:?}"),
        Ok(_) => panic!("expected InvalidMessage, got a segment"),
    }
}

#[test]
fn anonymous_segments_are_sealed_reserved_and_cached() {
    let len = segment::ARENA_LEN + 10_000;
    let seg = create(SharingStrategy::FileDescriptor, len).unwrap();
    let fd = seg.fd().unwrap();
    let seals = rustix::fs::fcntl_get_seals(fd).unwrap();
    assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL));
    let st = rustix::fs::fstat(fd).unwrap();
    assert_eq!(st.st_size as usize, len);
    assert!(st.st_blocks as usize * 512 >= len, "pages are reserved");
    let key = CacheKey::of(&seg).unwrap();
    assert!(Arc::ptr_eq(&cache::lookup(&key).unwrap(), &seg));
    // Only blocks travel: a plain segment's fd received as a block handle is refused.
    let err = receive_fd(fd, 128).err().unwrap();
    assert!(
        err.to_string().contains("mapped here as a plain segment"),
        "{err}"
    );
    drop(seg);
    assert!(
        cache::lookup(&key).is_none(),
        "the cache does not keep large segments alive"
    );
}

/// A sealed memfd laid out as a block that another live process (this one's parent)
/// made and pools: what a receiver keeps mapped.
fn foreign_block(len: u64) -> std::os::fd::OwnedFd {
    let fd = crate::sys::memfd::create("t", len).unwrap();
    let mut header = [0u8; segment::BLOCK_HEADER_LEN];
    header[..8].copy_from_slice(&segment::BLOCK_MAGIC_BYTES);
    header[12..16].copy_from_slice(&1u32.to_le_bytes()); // pooled
    header[16..20].copy_from_slice(
        &rustix::process::getppid()
            .map_or(1, |p| p.as_raw_nonzero().get() as u32)
            .to_le_bytes(),
    );
    crate::sys::memfd::write_all_at(fd.as_fd(), &header).unwrap();
    crate::sys::memfd::seal_size(fd.as_fd()).unwrap();
    fd
}

#[test]
fn small_received_segments_stay_mapped_for_a_while() {
    let made: Vec<std::os::fd::OwnedFd> = (0..cache::RECENT + 1)
        .map(|_| foreign_block(4096))
        .collect();
    let mut keys = Vec::new();
    for fd in &made {
        let received = receive_fd(fd.as_fd(), 4096).unwrap();
        keys.push(CacheKey::of(&received).unwrap());
        drop(received);
    }
    // The oldest was pushed out; the newest is still mapped, and found again. (Other
    // tests receive segments concurrently, so only the ends are certain.)
    assert!(cache::lookup(&keys[0]).is_none());
    assert!(cache::lookup(&keys[cache::RECENT]).is_some());
}

#[test]
fn received_memfds_are_checked_before_mapping() {
    let fd = crate::sys::memfd::create("t", 4096).unwrap();
    assert!(invalid(Segment::open_anonymous(fd.try_clone().unwrap(), 4096)).contains("sealed"));
    crate::sys::memfd::seal_size(fd.as_fd()).unwrap();
    assert!(invalid(Segment::open_anonymous(fd.try_clone().unwrap(), 4097)).contains("4096"));
    let seg = Segment::open_anonymous(fd, 100).unwrap();
    assert_eq!(seg.len(), 4096, "the whole file is mapped");
    let empty = crate::sys::memfd::create("t", 0).unwrap();
    crate::sys::memfd::seal_size(empty.as_fd()).unwrap();
    invalid(Segment::open_anonymous(empty, 0));
}

#[test]
fn received_blocks_are_found_again_in_the_cache() {
    let block = create_block(SharingStrategy::FileDescriptor, segment::ARENA_LEN).unwrap();
    let fd = block.fd().unwrap();
    let len = block.len() as u64;
    let again = receive_fd(fd, len).unwrap();
    assert!(Arc::ptr_eq(&again, &block), "the same mapping");
    assert!(receive_fd(fd, len + 1).is_err(), "a claim past its end");
}

#[test]
fn named_segments_count_references_and_the_last_user_unlinks() {
    crate::manager::serve_in_this_process();
    let seg = create(SharingStrategy::FileSystem, 1000).unwrap();
    let name = seg.name().unwrap().clone();
    let st = rustix::fs::stat(name::shm_path(&name)).unwrap();
    assert_eq!(st.st_mode & 0o777, 0o600);
    assert_eq!(st.st_size as usize, segment::HEADER_LEN + 1000);
    assert_eq!(seg.refcount(), Some(1));
    // What a message does: an in-flight reference, adopted by a fresh mapping.
    seg.acquire_in_flight().unwrap();
    assert_eq!(seg.refcount(), Some(2));
    let other = Segment::open_named(name.clone(), 1000, false).unwrap();
    assert_eq!(other.refcount(), Some(2));
    drop(other);
    assert_eq!(seg.refcount(), Some(1));
    assert!(exists(&name));
    drop(seg);
    assert!(!exists(&name), "the last user unlinked the name");
}

#[test]
fn a_named_blocks_name_lives_while_it_is_pooled_or_used() {
    crate::manager::serve_in_this_process();
    let block = create_block(SharingStrategy::FileSystem, 4096).unwrap();
    let name = block.name().unwrap().clone();
    assert!(block.is_block() && block.is_own_block());
    assert_eq!(
        (block.uses(), block.refcount()),
        (Some(0), Some(1)),
        "the pool's"
    );
    // A storage's use, then a message's: each takes a reference on the name too.
    block.acquire_use();
    block.acquire_use();
    assert_eq!((block.uses(), block.refcount()), (Some(2), Some(3)));
    // A receiver that maps it holds no reference of its own: the use is what it adopts.
    let mapped = Segment::open_named(name.clone(), 4096, true).unwrap();
    assert!(mapped.is_block() && !mapped.is_dead_block());
    drop(mapped);
    assert_eq!(
        block.refcount(),
        Some(3),
        "dropping a mapping takes nothing"
    );
    // Received again where it is mapped: the same mapping.
    let same = receive_named(name.clone(), 100).unwrap();
    assert!(Arc::ptr_eq(&same, &block));
    drop(same);
    block.release_use();
    // The creator stops pooling it (twice: the second does nothing).
    block.unpool();
    block.unpool();
    assert_eq!((block.uses(), block.refcount()), (Some(1), Some(1)));
    assert!(exists(&name), "still used");
    block.release_use();
    assert_eq!(block.refcount(), Some(0));
    assert!(
        !exists(&name),
        "the last use of an unpooled block unlinks its name"
    );
    assert!(block.is_dead_block());
}

#[test]
fn received_named_segments_are_checked_before_mapping() {
    crate::manager::serve_in_this_process();
    let seg = create(SharingStrategy::FileSystem, 256).unwrap();
    let name = seg.name().unwrap().clone();
    assert!(invalid(Segment::open_named(name.clone(), 257, false)).contains("holds 256"));
    // A file of the right name pattern that is not one of our segments.
    let other = SegmentName::generate().unwrap();
    let path = name::shm_path(&other);
    let fd = rustix::fs::open(
        &path,
        OFlags::CREATE | OFlags::EXCL | OFlags::RDWR,
        Mode::from_raw_mode(0o644),
    )
    .unwrap();
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o644)).unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    assert!(invalid(Segment::open_named(other.clone(), 16, false)).contains("not a private"));
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600)).unwrap();
    assert!(invalid(Segment::open_named(other.clone(), 16, false)).contains("header"));
    rustix::fs::unlink(&path).unwrap();
    // A symbolic link is never followed.
    std::os::unix::fs::symlink(name::shm_path(&name), &path).unwrap();
    assert!(invalid(Segment::open_named(other.clone(), 256, false)).contains("symbolic link"));
    rustix::fs::unlink(&path).unwrap();
    assert_eq!(seg.refcount(), Some(1), "failed opens took no reference");
}

#[test]
fn segments_alias_across_mappings() {
    let seg = create(SharingStrategy::FileDescriptor, 8).unwrap();
    let fresh =
        Segment::open_anonymous(seg.fd().unwrap().try_clone_to_owned().unwrap(), 8).unwrap();
    assert_ne!(fresh.data_ptr(), seg.data_ptr());
    let a = crate::Storage::from_segment(seg, 0, 8, None).unwrap();
    let b = crate::Storage::from_segment(Arc::new(fresh), 0, 8, None).unwrap();
    let ta = crate::Tensor::from_storage(a, crate::DType::I64, &[1], &[1], 0).unwrap();
    let tb = crate::Tensor::from_storage(b, crate::DType::I64, &[1], &[1], 0).unwrap();
    ta.fill_(42.0).unwrap();
    assert_eq!(tb.to_vec::<i64>().unwrap(), [42]);
}

#[test]
fn creation_never_follows_or_reuses_an_existing_name() {
    // A file already at the name: refused (O_EXCL), and left as it was.
    let name = SegmentName::generate().unwrap();
    let path = name::shm_path(&name);
    std::fs::write(&path, b"someone else's").unwrap();
    let err = Segment::create_named(name.clone(), 4096).unwrap_err();
    assert!(err.to_string().contains(&path), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
    std::fs::remove_file(&path).unwrap();
    // A symbolic link at the name: not followed (O_NOFOLLOW with O_EXCL), its target
    // neither created nor truncated.
    let target = std::env::temp_dir().join(format!("mp-symlink-target-{}", std::process::id()));
    std::fs::write(&target, b"precious").unwrap();
    std::os::unix::fs::symlink(&target, &path).unwrap();
    assert!(Segment::create_named(name.clone(), 4096).is_err());
    assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    std::fs::remove_file(&path).unwrap();
    // A dangling link: the target is not created either.
    std::fs::remove_file(&target).unwrap();
    std::os::unix::fs::symlink(&target, &path).unwrap();
    assert!(Segment::create_named(name.clone(), 4096).is_err());
    assert!(!target.exists(), "a dangling symlink was followed");
    std::fs::remove_file(&path).unwrap();
    // Once the name is free, the segment is made 0600.
    let seg = Segment::create_named(name.clone(), 4096).unwrap();
    let st = rustix::fs::stat(&path).unwrap();
    assert_eq!(st.st_mode & 0o7777, 0o600);
    assert_eq!(st.st_uid, rustix::process::geteuid().as_raw());
    drop(seg);
    assert!(!exists(&name));
}
