//! Fuzzes the safetensors loader (`multiproc::safetensors::load`): any bytes as a whole
//! file. It must return `Ok` or `Err`, never panic, crash or SIGBUS; whatever loads is
//! read whole. Entry point: `multiproc::__fuzz::run_safetensors_file`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = multiproc::__fuzz::run_safetensors_file(data);
});
