//! Functions of this executable named across processes, behind a safe typed API:
//! [`Code<F>`] (a function of type `F`, e.g. the pool's initializer `fn()`) and
//! [`CodeCall`] (a function of any type together with the trampoline that calls it, the
//! form a pool task takes: one message type carries tasks of every argument type).
//!
//! # Safety
//!
//! This module is the only place that turns a code address back into a function
//! pointer. Both types name functions by their offset from [`anchor`], a function of
//! this crate ([`CodeRef`]), so that another process running the same executable can
//! call them: a spawned worker (`/proc/self/exe`), a forked child, a pool worker or
//! the fork server (itself a re-execution). The invariants:
//!
//! - Offsets, not addresses: the whole executable is loaded at one base (PIE or not),
//!   so an offset taken in one process names the same code in any process running the
//!   same executable.
//! - Same executable: every reference carries a second, known offset (of
//!   [`check_point`]), checked before the reference is turned back into a function
//!   pointer, so a reference from a different build is refused, not called.
//! - The exact type: this module alone turns an offset back into a function pointer,
//!   always as the type it was taken from. A [`Code<F>`] is made from an `F` and read
//!   back as that `F` (the type travels in the Rust type of the message field, which is
//!   one type in sender and receiver: the same executable). A [`CodeCall`]'s function
//!   and trampoline are read back only by the shim that [`CodeCall::new`]
//!   monomorphized for the function's type, and the shim itself as the one shim type of
//!   that `CodeCall<X, Z, Y>`.
//! - References come only from the process that created the worker, over a socket only
//!   the two of them hold (as jobs do): a reference is never made from bytes of
//!   unknown origin.
//!
//! [`FnPtr`] (sealed) is what makes "a function-pointer type" checkable: only `fn`
//! pointers of up to two arguments implement it.
//!
//! Limitation (documented on `spawn`): the function must live in the executable itself,
//! not in a dynamically loaded library, whose base differs between processes.

use std::fmt;
use std::marker::PhantomData;

use serde::{Deserialize, Serialize};

/// The fixed point code offsets are measured from.
#[inline(never)]
fn anchor() -> usize {
    // Distinct body, so identical-code folding cannot merge it with another function
    // (it would still be a valid anchor, but a distinct one is easier to reason about).
    std::hint::black_box(0x6d70_616e_6368_6f72)
}

fn anchor_address() -> usize {
    (anchor as fn() -> usize) as usize
}

fn offset_of(address: usize) -> u64 {
    address.wrapping_sub(anchor_address()) as u64
}

fn address_at(offset: u64) -> usize {
    anchor_address().wrapping_add(offset as usize)
}

/// A second fixed point: its offset from [`anchor`] is what a reference from another
/// build is detected by.
#[inline(never)]
fn check_point() -> usize {
    std::hint::black_box(0x6d70_6368_6563_6b70)
}

/// The offset of a function every process of this executable knows.
fn check_offset() -> u64 {
    offset_of(check_point as fn() -> usize as usize)
}

/// A function of this executable, as it travels to another process, untyped.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct CodeRef {
    check: u64,
    offset: u64,
}

impl CodeRef {
    /// The reference to the function at `address` (a function pointer cast to usize).
    fn of(address: usize) -> Self {
        Self {
            check: check_offset(),
            offset: offset_of(address),
        }
    }

    /// The function pointer again, as type `F`.
    ///
    /// # Errors
    /// When the reference comes from another build of the program.
    ///
    /// # Safety
    /// `F` must be a function-pointer type, and exactly the type of the function this
    /// reference was made from with [`of`](Self::of).
    unsafe fn resolve<F: Copy>(&self) -> Result<F, String> {
        if self.check != check_offset() {
            return Err(
                "the sender runs a different build of this program (code offsets differ); \
                 parent and worker must run the same executable"
                    .into(),
            );
        }
        if size_of::<F>() != size_of::<usize>() {
            return Err("internal error: a code reference resolved to a non-pointer type".into());
        }
        let address = address_at(self.offset);
        // SAFETY: `F` is the function-pointer type the offset was taken from (the
        // caller's contract) in this same executable (checked above), so `address` is a
        // valid value of `F`; sizes are equal (checked above).
        Ok(unsafe { std::mem::transmute_copy::<usize, F>(&address) })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A function-pointer type: `fn() -> R`, `fn(A) -> R` or `fn(A, B) -> R`. Sealed: the
/// safety of [`Code::get`] rests on `F` being one of these.
pub(crate) trait FnPtr: sealed::Sealed + Copy {
    /// The function's address.
    fn address(self) -> usize;
}

macro_rules! fn_ptr {
    ($($arg:ident),*) => {
        impl<$($arg,)* R> sealed::Sealed for fn($($arg),*) -> R {}
        impl<$($arg,)* R> FnPtr for fn($($arg),*) -> R {
            fn address(self) -> usize {
                self as usize
            }
        }
    };
}
fn_ptr!();
fn_ptr!(A);
fn_ptr!(A, B);

/// A function of type `F` of this executable, as it travels to another process.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub(crate) struct Code<F> {
    code: CodeRef,
    _type: PhantomData<F>,
}

impl<F: FnPtr> Code<F> {
    /// The reference to `f`.
    pub(crate) fn of(f: F) -> Self {
        Code {
            code: CodeRef::of(f.address()),
            _type: PhantomData,
        }
    }

    /// The function again.
    ///
    /// # Errors
    /// When the reference comes from another build of the program.
    pub(crate) fn get(&self) -> Result<F, String> {
        // SAFETY: a `Code<F>` is made only by `of` from an `F`, a function-pointer type
        // (`FnPtr` is sealed), and travels as the same `Code<F>` (see the module's
        // safety section); `resolve` checks the executable.
        unsafe { self.code.resolve::<F>() }
    }
}

impl<F> Clone for Code<F> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<F> Copy for Code<F> {}

impl<F> fmt::Debug for Code<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Code").field(&self.code).finish()
    }
}

/// Where a [`CodeCall`]'s trampoline reports partial results; `false` back means stop.
pub(crate) type Sink<'a, Z> = &'a mut dyn FnMut(Z) -> bool;

/// The shape of the trampoline of a [`CodeCall`] for a function of type `F`.
pub(crate) type Trampoline<F, X, Z, Y> = fn(F, X, Sink<'_, Z>) -> Y;

/// The one shim type of a `CodeCall<X, Z, Y>`, whatever function it calls.
type Shim<X, Z, Y> = fn(&CodeCall<X, Z, Y>, X, Sink<'_, Z>) -> Result<Y, String>;

/// A call of a function of this executable, of any type, through a trampoline made for
/// that type: the trampoline gets the function, an input `X` and a [`Sink`] for partial
/// results `Z`, and returns `Y`. The function's type is not part of this type, so one
/// message type carries calls of every function type (the pool's tasks).
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub(crate) struct CodeCall<X, Z, Y> {
    shim: CodeRef,
    trampoline: CodeRef,
    function: CodeRef,
    _types: PhantomData<fn(X, Z) -> Y>,
}

impl<X, Z, Y> CodeCall<X, Z, Y> {
    /// The call of `function` through `trampoline`.
    pub(crate) fn new<F: FnPtr>(function: F, trampoline: Trampoline<F, X, Z, Y>) -> Self {
        let shim: Shim<X, Z, Y> = shim::<F, X, Z, Y>;
        CodeCall {
            shim: CodeRef::of(shim as usize),
            trampoline: CodeRef::of(trampoline as usize),
            function: CodeRef::of(function.address()),
            _types: PhantomData,
        }
    }

    /// Runs the trampoline with the function, `input` and `sink`.
    ///
    /// # Errors
    /// When the call comes from another build of the program.
    pub(crate) fn call(&self, input: X, sink: Sink<'_, Z>) -> Result<Y, String> {
        // SAFETY: `new` took this offset from a `Shim<X, Z, Y>` for this very `X, Z, Y`
        // (the call travels as the same `CodeCall<X, Z, Y>`, see the module's safety
        // section); `resolve` checks the executable.
        let shim = unsafe { self.shim.resolve::<Shim<X, Z, Y>>() }?;
        shim(self, input, sink)
    }
}

/// Calls `call`'s trampoline with its function, both read back as the types `new`
/// took them from: this shim is the one `new::<F>` made for them.
fn shim<F: FnPtr, X, Z, Y>(
    call: &CodeCall<X, Z, Y>,
    input: X,
    sink: Sink<'_, Z>,
) -> Result<Y, String> {
    // SAFETY: `CodeCall::new::<F>` took `function` from an `F` and `trampoline` from a
    // `Trampoline<F, X, Z, Y>`, and made this shim (monomorphized for that `F`) the
    // call's shim; `resolve` checks the executable.
    let function = unsafe { call.function.resolve::<F>() }?;
    // SAFETY: as above.
    let trampoline = unsafe { call.trampoline.resolve::<Trampoline<F, X, Z, Y>>() }?;
    Ok(trampoline(function, input, sink))
}

#[cfg(test)]
impl<X, Z, Y> CodeCall<X, Z, Y> {
    /// This call as a different build of the program would have sent it.
    pub(crate) fn as_from_another_build(mut self) -> Self {
        self.shim.check ^= 1;
        self
    }
}

impl<X, Z, Y> Clone for CodeCall<X, Z, Y> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<X, Z, Y> Copy for CodeCall<X, Z, Y> {}

impl<X, Z, Y> fmt::Debug for CodeCall<X, Z, Y> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CodeCall")
            .field("trampoline", &self.trampoline)
            .field("function", &self.function)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn twice(x: u32) -> u32 {
        2 * x
    }

    fn sum_into(f: fn(u32) -> u32, input: Vec<u32>, sink: Sink<'_, u32>) -> usize {
        let mut sent = 0;
        for x in input {
            if !sink(f(x)) {
                break;
            }
            sent += 1;
        }
        sent
    }

    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(value: &T) -> T {
        serde_json::from_str(&serde_json::to_string(value).unwrap()).unwrap()
    }

    #[test]
    fn a_typed_reference_finds_its_function_again() {
        let code = round_trip(&Code::of(twice as fn(u32) -> u32));
        assert_eq!(code.get().unwrap()(21), 42);
    }

    #[test]
    fn a_call_runs_its_trampoline_with_its_function() {
        let call = round_trip(&CodeCall::new(twice as fn(u32) -> u32, sum_into));
        let mut seen = Vec::new();
        let sent = call
            .call(vec![1, 2, 3], &mut |y| {
                seen.push(y);
                y < 4
            })
            .unwrap();
        assert_eq!((sent, seen), (1, vec![2, 4]));
    }

    #[test]
    fn a_reference_from_another_build_is_refused() {
        let mut code = Code::of(twice as fn(u32) -> u32);
        code.code.check ^= 1;
        assert!(code.get().is_err());
        let mut call = CodeCall::new(twice as fn(u32) -> u32, sum_into);
        call.shim.check ^= 1;
        assert!(call.call(vec![1], &mut |_| true).is_err());
    }
}
