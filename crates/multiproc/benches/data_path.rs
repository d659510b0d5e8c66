//! Micro-benchmarks of the steps of the data path a tensor takes through a queue (see
//! the crate docs and `multiproc::__bench`): encoding and decoding a message with 1 and
//! 64 tensors, creating/opening/mapping a segment, passing an fd over a socket, a
//! map-cache hit. They use `multiproc::__bench`, an internal entry point that is not
//! public API, behind the `bench-internals` feature (on for this package's benches).
//!
//! `cargo bench -p multiproc` runs them; CI only builds them (`cargo bench --no-run`).
//! End-to-end figures are `multiproc bench`'s job.

#![allow(missing_docs)] // criterion_group! makes an undocumented pub fn

use criterion::{Criterion, criterion_group, criterion_main};
use multiproc::__bench as b;
use multiproc::{DType, Tensor};

fn tensors(count: usize, floats: usize) -> Vec<Tensor> {
    (0..count)
        .map(|_| {
            let t = Tensor::zeros_shared(&[floats], DType::F32).expect("tensor");
            t.fill_(1.0).expect("fill");
            t
        })
        .collect()
}

fn wire(c: &mut Criterion) {
    let pair = b::socket_pair().expect("socketpair");
    for count in [1usize, 64] {
        let msg = tensors(count, 1024);
        c.bench_function(&format!("encode/{count}_tensors"), |bench| {
            bench.iter(|| b::encode(&msg).expect("encode"))
        });
        c.bench_function(
            &format!("encode_send_recv_decode/{count}_tensors"),
            |bench| {
                bench.iter(|| {
                    b::send(&pair, &msg).expect("send");
                    let back: Vec<Tensor> = b::recv(&pair).expect("recv");
                    back
                })
            },
        );
    }
}

fn segments(c: &mut Criterion) {
    for (name, len) in [("4KiB", 4usize << 10), ("1MiB", 1 << 20)] {
        c.bench_function(&format!("segment_create/{name}"), |bench| {
            bench.iter(|| b::segment_create(len).expect("create"))
        });
        let memfd = b::memfd(len).expect("memfd");
        c.bench_function(&format!("segment_open_map/{name}"), |bench| {
            bench.iter(|| b::segment_open(&memfd).expect("open"))
        });
    }
}

fn fds(c: &mut Criterion) {
    let pair = b::socket_pair().expect("socketpair");
    let memfd = b::memfd(4096).expect("memfd");
    c.bench_function("fd_send_recv", |bench| {
        bench.iter(|| b::fd_round_trip(&pair, &memfd).expect("fd"))
    });
}

fn map_cache(c: &mut Criterion) {
    let memfd = b::memfd(1 << 20).expect("memfd");
    let _mapped = b::map_cache_lookup(&memfd).expect("first lookup maps");
    c.bench_function("map_cache_hit", |bench| {
        bench.iter(|| b::map_cache_lookup(&memfd).expect("hit"))
    });
}

criterion_group!(benches, wire, segments, fds, map_cache);
criterion_main!(benches);
