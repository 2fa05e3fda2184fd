//! One way to take a lock whose holder panicked: take it over.
//!
//! Every lock in the server guards a plain value (a list of audit entries,
//! a token table, a certificate config, a connection handle) that a panic
//! cannot leave half-changed: a holder that panicked did so before or after
//! its one assignment or push. So the value is taken over as it is, never
//! refused and never skipped: an audit entry is not dropped, a token table
//! is not reported unavailable.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// `mutex`, locked.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `lock`, read.
pub fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

/// `lock`, written.
pub fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}
