//! # multiproc
//!
//! torch.multiprocessing for Rust (crate docs are written as the modules land).

#![deny(unsafe_code)]

mod error;
#[allow(unsafe_code)]
mod sys;
mod wire;

pub use error::{Error, Failure, PutError, Result};
