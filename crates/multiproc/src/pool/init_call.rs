//! An initializer with an argument ([`PoolBuilder::initializer_with`](super::PoolBuilder::initializer_with))
//! as it travels to each worker: the function with the trampoline that decodes its
//! argument ([`InitCall`]), and the recipe that encodes the argument anew for every
//! worker ([`InitWith`]).

use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::process::code::{CodeCall, Sink};
use crate::wire::Opaque;

/// An initializer `fn(A)` with the trampoline that decodes its argument (nothing is
/// reported through the sink).
type InitCode = CodeCall<Opaque, (), std::result::Result<(), String>>;

/// An initializer call as it travels to a worker: its function (with its trampoline)
/// and its encoded argument.
#[derive(Serialize, Deserialize)]
pub(super) struct InitCall {
    call: InitCode,
    arg: Opaque,
}

impl InitCall {
    /// Runs the initializer in the worker.
    pub(super) fn run(self) -> std::result::Result<(), String> {
        self.call
            .call(self.arg, &mut |()| true)
            .and_then(|outcome| outcome)
    }
}

fn run_init<A: DeserializeOwned>(
    f: fn(A),
    arg: Opaque,
    _nothing_reported: Sink<'_, ()>,
) -> std::result::Result<(), String> {
    let arg: A = arg
        .decode(&crate::shm::Returns::plain())
        .map_err(|e| format!("cannot decode the initializer's argument: {e}"))?;
    f(arg);
    Ok(())
}

/// [`PoolBuilder::initializer_with`]'s function and argument, encoded anew for every
/// worker the pool starts (replacements included).
#[derive(Clone)]
pub(super) struct InitWith(Arc<dyn Fn() -> Result<InitCall> + Send + Sync>);

impl InitWith {
    pub(super) fn call(&self) -> Result<InitCall> {
        (self.0)()
    }
}

impl fmt::Debug for InitWith {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InitWith(..)")
    }
}

impl InitWith {
    /// The recipe: `f` with `arg`, encoded anew at each call.
    pub(super) fn new<A>(f: fn(A), arg: A) -> Self
    where
        A: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        let call = CodeCall::new(f, run_init::<A>);
        InitWith(Arc::new(move || {
            Ok(InitCall {
                call,
                arg: Opaque::encode(&arg)?,
            })
        }))
    }
}
