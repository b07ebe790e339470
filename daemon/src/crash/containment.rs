//! Panics haltd contains on purpose ([`contain`]); every other panic ends the process
//! ([`super::install`]'s hook asks `contained` which one it is).

use std::{
    cell::Cell,
    panic::{catch_unwind, UnwindSafe},
};

thread_local! {
    /// How many [`contain`] calls this thread is inside. Const-initialised: reading it in the
    /// hook allocates nothing.
    static CONTAINED: Cell<u32> = const { Cell::new(0) };
}

/// Restores the depth when [`contain`] returns (also if `catch_unwind` itself were left by
/// a foreign exception).
struct DepthGuard;

impl Drop for DepthGuard {
    fn drop(&mut self) {
        CONTAINED.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// `catch_unwind` for a panic the caller deliberately contains: the hook leaves a panic inside
/// it to the default hook (message on stderr) and the caller gets `Err(payload)` as from
/// `std::panic::catch_unwind`. Every `catch_unwind` in haltd goes through here; one that did
/// not would be ended by the hook as a crash.
pub fn contain<F: FnOnce() -> R + UnwindSafe, R>(f: F) -> std::thread::Result<R> {
    CONTAINED.with(|d| d.set(d.get().saturating_add(1)));
    let _guard = DepthGuard;
    catch_unwind(f)
}

/// Whether the current thread is inside [`contain`]. False while its thread-locals are being
/// destroyed (nothing can be contained there).
pub(super) fn contained() -> bool {
    CONTAINED.try_with(|d| d.get() > 0).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contain_nests_and_restores_the_depth() {
        assert!(!contained());
        let inner = contain(|| {
            assert!(contained());
            let r = contain(|| -> u32 { panic!("inner") });
            assert!(r.is_err());
            assert!(contained(), "the outer containment still holds");
            7
        });
        assert_eq!(inner.ok(), Some(7));
        assert!(!contained());
    }
}
