//! Fuzzes the wire decoder: any packet, with fds of assorted kinds attached, decoded as
//! a message that carries tensors, queues, events, a lock, strings, nested vectors and
//! a nested message (a tensor's storage may be a CUDA handle: without a GPU, or in
//! this build without the `cuda` feature, that is a clean `CudaUnavailable`; the
//! corpus's `cuda-*` inputs start there). The decoder must return `Ok` or `Err`,
//! never panic, crash or SIGBUS; whatever decodes is used (tensors read, the lock
//! taken and released).
//! Input layout: `multiproc::__fuzz` (crates/multiproc/src/fuzzing.rs).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = multiproc::__fuzz::run_input(data);
});
