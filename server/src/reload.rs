//! Files that change under a running server — the API listener's
//! certificate and key, the certificates Lattice presents to hooks and
//! tools, the tokens file — followed one way: re-read every [`EVERY`],
//! compared by content (not by modification time or size, which a rewrite
//! can keep), and applied when they changed.
//!
//! A read that fails is tried again at the next look, with what was in force
//! kept (mid-rotation a file can be missing for a moment). What the caller
//! refuses to apply (a certificate that doesn't load) is not offered again
//! until the content changes: the same bytes would fail the same way.

use std::{sync::Weak, time::Duration};

/// How often followed files are read again.
pub const EVERY: Duration = Duration::from_secs(1);

/// Follows what `read` gives every `every`, for as long as `owner` lives
/// (the task ends when it is dropped). When it differs from what was last
/// seen (`seen` at first), `apply` gets the owner and the new value; a
/// failed read goes to `unreadable` and changes nothing.
pub async fn follow<O, T: PartialEq>(
    owner: Weak<O>,
    every: Duration,
    mut seen: T,
    mut read: impl FnMut(&O) -> Result<T, String>,
    mut apply: impl FnMut(&O, &T),
    unreadable: impl Fn(&str),
) {
    loop {
        tokio::time::sleep(every).await;
        let Some(owner) = owner.upgrade() else { return };
        match read(&owner) {
            Err(e) => unreadable(&e),
            Ok(now) if now == seen => {}
            Ok(now) => {
                apply(&owner, &now);
                seen = now;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Reads that fail change nothing and are retried; an unchanged value
    /// is not applied again; each change is applied once; the task ends
    /// with its owner.
    #[tokio::test(start_paused = true)]
    async fn each_change_is_applied_once_and_failed_reads_are_retried() {
        let reads: Vec<Result<&str, String>> =
            vec![Ok("a"), Err("gone".into()), Ok("a"), Ok("b"), Ok("b"), Err("gone".into()), Ok("c")];
        let owner = Arc::new(Mutex::new(reads.into_iter()));
        let applied = Arc::new(Mutex::new(Vec::new()));
        let failed = Arc::new(Mutex::new(0));
        let (seen_applied, seen_failed) = (applied.clone(), failed.clone());
        let task = tokio::spawn(follow(
            Arc::downgrade(&owner),
            EVERY,
            "a",
            |reads: &Mutex<std::vec::IntoIter<Result<&str, String>>>| reads.lock().unwrap().next().unwrap_or(Ok("c")),
            move |_, v: &&str| seen_applied.lock().unwrap().push(v.to_string()),
            move |_| *seen_failed.lock().unwrap() += 1,
        ));
        tokio::time::sleep(EVERY * 10).await;
        assert_eq!(*applied.lock().unwrap(), ["b", "c"]);
        assert_eq!(*failed.lock().unwrap(), 2);
        drop(owner);
        tokio::time::sleep(EVERY * 2).await;
        assert!(task.is_finished(), "the task ends with its owner");
    }
}
