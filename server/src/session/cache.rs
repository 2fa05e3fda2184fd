//! The conversations one replica has read or written, so that taking a
//! session's lease in PostgreSQL reads only the messages committed since.
//!
//! Sound because stored messages never change: a commit only appends rows
//! numbered after the last, so the first `n` messages of a session, once
//! read, are its first `n` messages for good. A session deleted and made
//! again under the same id is another session: entries are keyed by the
//! id and the session row's creation time, and one of another time is not
//! used. Bounded in bytes; the least recently used conversations go first.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
};

use crate::domain::Message;

/// Conversations by session id.
#[derive(Debug)]
pub(super) struct HistoryCache {
    state: Mutex<State>,
    /// The most bytes held at once (see [`size`]).
    budget: usize,
    /// The bytes held, for the metrics (`State::bytes` as last changed).
    held: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<String, Entry>,
    /// What the entries hold (see [`size`]).
    bytes: usize,
    /// Counts uses, for least-recently-used eviction.
    clock: u64,
}

#[derive(Debug)]
struct Entry {
    /// The session row's creation time (microseconds since the epoch).
    born: i64,
    /// The session's first messages, shared with whoever copies them out.
    messages: Arc<Vec<Message>>,
    bytes: usize,
    used: u64,
}

/// What the cache holds of one session.
#[derive(Debug, Clone)]
pub(super) struct Known {
    /// The session row's creation time.
    pub born: i64,
    /// Its first messages.
    pub messages: Arc<Vec<Message>>,
}

impl HistoryCache {
    /// A cache of at most `budget` bytes of messages.
    pub(super) fn new(budget: usize) -> Self {
        Self { state: Mutex::new(State::default()), budget, held: Arc::default() }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// The bytes held, kept current for whoever reads it.
    pub(super) fn held(&self) -> Arc<AtomicUsize> {
        self.held.clone()
    }

    /// What is held of `id`, if anything.
    pub(super) fn get(&self, id: &str) -> Option<Known> {
        let mut state = self.state();
        state.clock += 1;
        let clock = state.clock;
        let entry = state.entries.get_mut(id)?;
        entry.used = clock;
        Some(Known { born: entry.born, messages: entry.messages.clone() })
    }

    /// Records that `id` (created at `born`) begins with `messages` (a
    /// copy is kept, unless they are larger than the whole budget).
    pub(super) fn put(&self, id: &str, born: i64, messages: &[Message]) {
        let bytes = size(messages);
        if bytes > self.budget {
            self.forget(id);
            return;
        }
        let messages = Arc::new(messages.to_vec());
        let mut state = self.state();
        self.forget_locked(&mut state, id);
        state.clock += 1;
        let used = state.clock;
        state.bytes += bytes;
        state.entries.insert(id.to_owned(), Entry { born, messages, bytes, used });
        self.evict(&mut state);
        self.held.store(state.bytes, Ordering::Relaxed);
    }

    /// Records that `id`'s messages from index `at` on are `appended`, if
    /// what is held of it ends at `at` (else the next lease reads them).
    pub(super) fn append(&self, id: &str, born: i64, at: usize, appended: Vec<Message>) {
        let bytes = size(&appended);
        let mut state = self.state();
        let Some(entry) = state.entries.get_mut(id) else { return };
        if entry.born != born || entry.messages.len() != at {
            return;
        }
        Arc::make_mut(&mut entry.messages).extend(appended);
        entry.bytes += bytes;
        let too_large = entry.bytes > self.budget;
        state.bytes += bytes;
        if too_large {
            self.forget_locked(&mut state, id);
        }
        self.evict(&mut state);
        self.held.store(state.bytes, Ordering::Relaxed);
    }

    /// Forgets `id`.
    pub(super) fn forget(&self, id: &str) {
        let mut state = self.state();
        self.forget_locked(&mut state, id);
    }

    fn forget_locked(&self, state: &mut State, id: &str) {
        if let Some(old) = state.entries.remove(id) {
            state.bytes -= old.bytes;
        }
        self.held.store(state.bytes, Ordering::Relaxed);
    }

    /// Evicts the least recently used entries until the cache is within
    /// its budget, and then to seven eighths of it, so that a scan of the
    /// entries is not made for every insertion past the budget.
    fn evict(&self, state: &mut State) {
        if state.bytes <= self.budget {
            return;
        }
        let target = self.budget - self.budget / 8;
        let mut by_age: Vec<(u64, String)> = state.entries.iter().map(|(id, e)| (e.used, id.clone())).collect();
        by_age.sort_unstable();
        for (_, id) in by_age {
            if state.bytes <= target {
                break;
            }
            self.forget_locked(state, &id);
        }
    }

    /// The bytes held (for tests), checked against what the metrics read.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        let bytes = self.state().bytes;
        assert_eq!(self.held.load(Ordering::Relaxed), bytes);
        bytes
    }
}

/// About what a message holds on the heap beyond its text: the block list,
/// the strings' headers, the allocator's rounding. Counted so that a budget
/// of many short messages is not far exceeded.
const OVERHEAD: usize = 128;

/// What `messages` hold, about.
fn size(messages: &[Message]) -> usize {
    messages.iter().map(|m| m.size() + OVERHEAD).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(n: usize, each: usize) -> Vec<Message> {
        (0..n).map(|i| Message::user_text(format!("{i:0each$}"))).collect()
    }

    /// What is put is got back; an append extends it only where the held
    /// messages end, and only for the same incarnation.
    #[test]
    fn appends_extend_only_the_same_incarnation_where_it_ends() {
        let cache = HistoryCache::new(1 << 20);
        cache.put("s", 7, &history(2, 10));
        cache.append("s", 7, 2, history(1, 10));
        assert_eq!(cache.get("s").map(|k| k.messages.len()), Some(3));
        cache.append("s", 7, 2, history(1, 10)); // not where it ends
        cache.append("s", 8, 3, history(1, 10)); // another incarnation
        assert_eq!(cache.get("s").map(|k| (k.born, k.messages.len())), Some((7, 3)));
        assert_eq!(cache.bytes(), 3 * (10 + OVERHEAD));
        cache.forget("s");
        assert!(cache.get("s").is_none());
        assert_eq!(cache.bytes(), 0);
    }

    /// Past the budget the least recently used go first; a conversation
    /// larger than the whole budget is not held.
    #[test]
    fn the_least_recently_used_go_first_past_the_budget() {
        // Each message 100 bytes of text; each conversation three of them.
        let one = 100 + OVERHEAD;
        let cache = HistoryCache::new(3 * 3 * one + one / 2);
        for id in ["a", "b", "c"] {
            cache.put(id, 1, &history(3, 100));
        }
        assert!(cache.get("a").is_some()); // a is now the most recent
        cache.put("d", 1, &history(3, 100));
        // Down to seven eighths: b, then c, the least recently used.
        assert!(cache.get("b").is_none() && cache.get("c").is_none());
        assert!(cache.get("a").is_some() && cache.get("d").is_some());
        assert_eq!(cache.bytes(), 6 * one);
        cache.append("d", 1, 3, history(2, 100));
        assert_eq!(cache.get("d").map(|k| k.messages.len()), Some(5));
        assert_eq!(cache.bytes(), 8 * one);
        cache.put("huge", 1, &history(10, 100));
        assert!(cache.get("huge").is_none(), "larger than the whole budget");
        assert_eq!(cache.bytes(), 8 * one);
        // Grown past the budget, a conversation is no longer held.
        cache.put("d", 1, &history(10, 100));
        assert!(cache.get("d").is_none());
        assert_eq!(cache.bytes(), 3 * one);
    }
}
