//! [`test_init!`](crate::test_init): [`init`](crate::init) for `cargo test` integration
//! tests, whose `main` belongs to libtest.

/// Makes a `cargo test` integration-test binary able to start workers.
///
/// A spawned worker is a new run of the same executable, and it finds its job in
/// [`init`](crate::init). In a test binary, `main` belongs to libtest, so there is nowhere to call
/// `init`. Put this macro at the top of the test file instead:
///
/// ```ignore
/// multiproc::test_init!();
///
/// fn worker(rank: usize, n: u64) {
///     assert!(rank < 2 && n == 7);
/// }
///
/// #[test]
/// fn two_workers() {
///     multiproc::spawn(worker, 7u64, 2).unwrap();
/// }
/// ```
///
/// It registers a function in the executable's `.init_array`, which the C runtime calls
/// before `main` (the technique of the `ctor` crate), and that function calls [`init`](crate::init):
/// in a worker it runs the job and exits, so libtest never starts there; in the test
/// process itself it returns at once. Use it once per test binary (once per file under
/// `tests/`). Ordinary programs should call [`init`](crate::init) first thing in `main` instead.
#[macro_export]
macro_rules! test_init {
    () => {
        const _: () = {
            extern "C" fn __multiproc_test_init() {
                $crate::init();
            }
            #[used]
            #[unsafe(link_section = ".init_array")]
            static __MULTIPROC_TEST_INIT: extern "C" fn() = __multiproc_test_init;
        };
    };
}
