//! The manager's protocol and bookkeeping, and its serve loop run on a thread of the
//! test process (the re-exec and detach path needs a binary that calls `init()`, so it
//! is tested in `tests/manager.rs`).

use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};

use super::daemon::{Registry, bind, serve};
use crate::shm::SegmentName;
use crate::shm::registry::{Request, connect_to, interpret_status_line};
use crate::shm::tree::{address, is_valid_address, new_address};
use crate::sys::socket::send_packet;

#[test]
fn requests_round_trip_and_hostile_ones_are_ignored() {
    // A fixed name: generating one reads the tree from /proc (not under Miri).
    let name = "multiproc_7_0123456789abcdef0123456789abcdef_42_12345_0123456789abcdef".to_owned();
    for r in [
        Request::Register(name.clone()),
        Request::Unregister(name.clone()),
        Request::Query(name),
    ] {
        assert_eq!(Request::decode(&r.encode()), Some(r));
    }
    for bad in [
        &b""[..],
        b"R",
        b"Rmultiproc_1_xyz",
        b"R/etc/passwd",
        b"Xmultiproc_1_0123456789abcdef0123456789abcdef",
        b"R\xffmultiproc",
    ] {
        assert_eq!(Request::decode(bad), None, "{bad:?}");
    }
}

#[test]
fn addresses_are_validated() {
    assert!(is_valid_address(address()));
    assert!(is_valid_address(&new_address()));
    assert_ne!(new_address(), new_address());
    assert!(!is_valid_address("multiproc-shm-1 2"));
    assert!(!is_valid_address("other-1-2-3"));
    assert!(!is_valid_address(&format!(
        "multiproc-shm-{}",
        "1".repeat(100)
    )));
}

#[test]
fn registry_waits_a_grace_period_after_the_last_client() {
    let t0 = Instant::now();
    let grace = Duration::from_millis(100);
    let mut r = Registry::new(t0, grace);
    assert!(
        !r.expired(t0 + grace),
        "a new manager waits longer for its first client"
    );
    r.connected();
    r.connected();
    assert_eq!(r.deadline(), None);
    r.apply(Request::Register("a".into()));
    r.apply(Request::Register("b".into()));
    r.apply(Request::Unregister("a".into()));
    r.apply(Request::Unregister("never-registered".into()));
    r.disconnected(t0);
    assert_eq!(r.deadline(), None, "one client is left");
    r.disconnected(t0);
    assert_eq!(r.deadline(), Some(t0 + grace));
    assert!(!r.expired(t0 + grace / 2));
    r.connected();
    assert!(
        !r.expired(t0 + grace * 2),
        "a new client cancels the cleanup"
    );
    r.disconnected(t0 + grace);
    assert!(r.expired(t0 + grace * 2));
    assert_eq!(r.leftovers().collect::<Vec<_>>(), ["b"]);
}

#[test]
fn status_lines_are_interpreted() {
    assert!(interpret_status_line("ready @x", "bin").is_ok());
    assert!(interpret_status_line("in-use @x", "bin").is_ok());
    let e = interpret_status_line("error: cannot listen", "bin").unwrap_err();
    assert_eq!(e.to_string(), "shm manager: cannot listen");
    let e = interpret_status_line("", "bin").unwrap_err();
    assert!(e.to_string().contains("multiproc::init()"), "{e}");
    let e = interpret_status_line("hello world", "bin").unwrap_err();
    assert!(e.to_string().contains("hello world"), "{e}");
}

fn make_file(name: &SegmentName) -> String {
    let path = format!("/dev/shm/{name}");
    rustix::fs::open(
        &path,
        OFlags::CREATE | OFlags::EXCL | OFlags::RDWR,
        Mode::RUSR | Mode::WUSR,
    )
    .unwrap();
    path
}

fn send(sock: &std::os::fd::OwnedFd, r: Request) {
    send_packet(sock.as_fd(), &r.encode(), &[], &[], None).unwrap();
}

/// Asks the manager on `conn` whether `name` is held: its one-byte answer.
fn query(conn: &std::os::fd::OwnedFd, name: &SegmentName) -> Vec<u8> {
    send(conn, Request::Query(name.as_str().into()));
    crate::wire::recv_packet(
        conn.as_fd(),
        crate::sys::deadline_after(Some(Duration::from_secs(10))),
    )
    .unwrap()
    .expect("an answer to a query")
    .bytes
}

#[test]
fn the_serve_loop_unlinks_leftovers_after_its_clients_hang_up() {
    let addr = new_address();
    let listener = bind(&addr).unwrap().unwrap();
    assert!(
        bind(&addr).unwrap().is_none(),
        "a second manager finds the address in use"
    );
    let grace = Duration::from_millis(300);
    let server = std::thread::spawn(move || serve(listener, grace, None));

    let (kept, left, gone) = (
        SegmentName::generate().unwrap(),
        SegmentName::generate().unwrap(),
        SegmentName::generate().unwrap(),
    );
    let (kept_path, left_path) = (make_file(&kept), make_file(&left));
    let a = connect_to(&addr).unwrap().unwrap();
    let b = connect_to(&addr).unwrap().unwrap();
    send(&a, Request::Register(kept.as_str().into()));
    send(&a, Request::Unregister(kept.as_str().into()));
    send(&a, Request::Register(left.as_str().into()));
    send(&b, Request::Register(gone.as_str().into()));
    send_packet(b.as_fd(), b"garbage", &[], &[], None).unwrap();
    // A query (what `multiproc gc` asks) is answered on the same connection.
    for (name, held) in [(&gone, b'Y'), (&kept, b'N')] {
        assert_eq!(query(&b, name), [held], "{name}");
    }
    // And on a connection of its own, as `maintenance` asks it.
    for (name, held) in [(&gone, true), (&kept, false), (&left, true)] {
        assert_eq!(
            crate::shm::registry::query(&addr, name).unwrap(),
            held,
            "{name}"
        );
    }
    drop(a);
    // One client remains, so nothing is cleaned up even after the grace period: past
    // it, the server still answers `b` and still counts `left` as held (an answer on
    // `b` comes after the server has seen whatever came before it, `a`'s hang-up
    // included), and the file is still there.
    let hung_up = Instant::now();
    for _ in 0..3 {
        std::thread::sleep(grace);
        assert_eq!(query(&b, &left), [b'Y'], "{left} is still held");
        assert!(Path::new(&left_path).exists());
    }
    assert!(hung_up.elapsed() >= grace * 2);
    let started = Instant::now();
    drop(b);
    server.join().unwrap();
    assert!(started.elapsed() >= grace);
    assert!(!Path::new(&left_path).exists(), "a leftover was unlinked");
    assert!(
        Path::new(&kept_path).exists(),
        "an unregistered name was left alone"
    );
    rustix::fs::unlink(&kept_path).unwrap();
    assert!(connect_to(&addr).unwrap().is_none(), "the manager has gone");
}

#[test]
fn a_manager_with_no_clients_ends_once_its_startup_window_passes() {
    let t0 = Instant::now();
    let r = Registry::new(t0, Duration::from_millis(1));
    assert!(
        r.deadline()
            .is_some_and(|d| d > t0 + Duration::from_secs(5))
    );
}
