//! The embedded store: one process's memory, bounded in sessions and
//! expiring the idle ones, with the same lease contract as PostgreSQL.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{sync::watch, time::Instant};

use super::{Lease, LeaseHolder, SessionStore, StoreError, StoreFuture, StoredPage, StoredSession};
use crate::domain::Message;

/// Sessions held in this process.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    /// The most sessions held at once; a new one past it is refused.
    max_sessions: usize,
    /// Sessions untouched this long are deleted.
    idle_ttl: Duration,
}

#[derive(Debug)]
struct State {
    slots: HashMap<String, Slot>,
    /// Hands out lease tokens.
    next_token: u64,
    /// When idle sessions were last swept out.
    swept: Instant,
}

#[derive(Debug)]
struct Slot {
    /// The agent it belongs to.
    agent: String,
    /// The conversation, shared with whoever is copying it out: copies are
    /// made after the store's lock is released, so a long conversation's
    /// copy holds up no other session. Only commits change it, and by then
    /// the copy is made (a commit that finds one still under way copies it
    /// first).
    messages: Arc<Vec<Message>>,
    /// The principal that created it ("" with authentication off).
    owner: String,
    /// The token of the lease that holds it, if any.
    leased: Option<u64>,
    /// Last acquired, committed or read.
    touched: Instant,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(crate::config::defaults::MAX_SESSIONS, Duration::from_secs(crate::config::defaults::IDLE_TTL_S))
    }
}

impl MemoryStore {
    /// A store of at most `max_sessions`, forgetting those idle for `idle_ttl`.
    pub fn new(max_sessions: usize, idle_ttl: Duration) -> Self {
        let state = State { slots: HashMap::new(), next_token: 0, swept: Instant::now() };
        Self { inner: Arc::new(Inner { state: Mutex::new(state), max_sessions, idle_ttl }) }
    }

    /// The state, with idle sessions swept out at most every tenth of the
    /// idle time (a scan of every session: amortized over the operations).
    fn state(&self) -> MutexGuard<'_, State> {
        let mut state = crate::sync::lock(&self.inner.state);
        let now = Instant::now();
        if now.duration_since(state.swept) >= self.inner.idle_ttl / 10 {
            state.swept = now;
            let ttl = self.inner.idle_ttl;
            state.slots.retain(|_, s| s.leased.is_some() || now.duration_since(s.touched) < ttl);
        }
        state
    }

    /// A slot, unless it has been idle past the limit (then it is gone).
    fn live<'s>(&self, state: &'s mut State, id: &str) -> Option<&'s mut Slot> {
        let ttl = self.inner.idle_ttl;
        let expired = state.slots.get(id).is_some_and(|s| s.leased.is_none() && s.touched.elapsed() >= ttl);
        if expired {
            state.slots.remove(id);
        }
        state.slots.get_mut(id)
    }
}

/// Whether `owner` (if any) owns the slot.
fn owns(owner: Option<&str>, slot: &Slot) -> bool {
    owner.is_none_or(|o| slot.owner == o)
}

/// A lease on one slot.
#[derive(Debug)]
struct MemoryLease {
    store: MemoryStore,
    id: String,
    token: u64,
    created: bool,
}

impl LeaseHolder for MemoryLease {
    fn commit(&self, appended: Vec<Message>, _deadline: Option<tokio::time::Instant>) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let mut state = self.store.state();
            let slot = state.slots.get_mut(&self.id).filter(|s| s.leased == Some(self.token));
            let slot = slot.ok_or(StoreError::LeaseLost)?;
            Arc::make_mut(&mut slot.messages).extend(appended);
            slot.leased = None;
            slot.touched = Instant::now();
            Ok(())
        })
    }

    fn release(self: Arc<Self>) -> StoreFuture<'static, ()> {
        let mut state = self.store.state();
        if let Some(slot) = state.slots.get_mut(&self.id).filter(|s| s.leased == Some(self.token)) {
            slot.leased = None;
            // A session created by a query that failed stays empty: forget
            // it, so a failed query leaves nothing behind.
            if self.created && slot.messages.is_empty() {
                state.slots.remove(&self.id);
            }
        }
        Box::pin(async { Ok(()) })
    }
}

impl SessionStore for MemoryStore {
    fn acquire_as<'a>(
        &'a self,
        session_id: &'a str,
        agent: &'a str,
        owner: Option<&'a str>,
        create: bool,
    ) -> StoreFuture<'a, Lease> {
        Box::pin(async move {
            let mut state = self.state();
            state.next_token += 1;
            let token = state.next_token;
            let now = Instant::now();
            let (agent, history) = if create {
                if self.live(&mut state, session_id).is_some() {
                    return Err(StoreError::Busy);
                }
                if state.slots.len() >= self.inner.max_sessions {
                    return Err(StoreError::Full(self.inner.max_sessions));
                }
                let owner = owner.unwrap_or_default().to_owned();
                let messages = Arc::default();
                let slot = Slot { agent: agent.to_owned(), messages, owner, leased: Some(token), touched: now };
                state.slots.insert(session_id.to_owned(), slot);
                (agent.to_owned(), Arc::default())
            } else {
                let slot = self.live(&mut state, session_id).filter(|s| owns(owner, s)).ok_or(StoreError::NotFound)?;
                if slot.leased.is_some() {
                    return Err(StoreError::Busy);
                }
                slot.leased = Some(token);
                slot.touched = now;
                (slot.agent.clone(), slot.messages.clone())
            };
            drop(state);
            // The copy the query owns, made outside the lock.
            let session = StoredSession { agent, messages: Vec::clone(&history) };
            drop(history);
            let holder = MemoryLease { store: self.clone(), id: session_id.to_owned(), token, created: create };
            // Nothing takes a lease away in one process: never lost.
            let (_, lost) = watch::channel(false);
            Ok(Lease::new(session, create, Arc::new(holder), lost))
        })
    }

    fn page_as<'a>(
        &'a self,
        session_id: &'a str,
        owner: Option<&'a str>,
        from: usize,
        most: usize,
        bytes: usize,
    ) -> StoreFuture<'a, StoredPage> {
        Box::pin(async move {
            let mut state = self.state();
            let slot = self.live(&mut state, session_id).filter(|s| owns(owner, s)).ok_or(StoreError::NotFound)?;
            slot.touched = Instant::now();
            let (agent, all) = (slot.agent.clone(), slot.messages.clone());
            drop(state);
            // Only the page is copied, outside the lock.
            let mut size = 0usize;
            let messages = all
                .get(from..)
                .unwrap_or_default()
                .iter()
                .take(most)
                .take_while(|m| {
                    let before = size;
                    size = size.saturating_add(m.size());
                    before < bytes
                })
                .cloned()
                .collect();
            Ok(StoredPage { agent, total: all.len(), messages })
        })
    }

    fn delete_as<'a>(&'a self, session_id: &'a str, owner: Option<&'a str>) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut state = self.state();
            match self.live(&mut state, session_id).filter(|s| owns(owner, s)) {
                None => Err(StoreError::NotFound),
                Some(s) if s.leased.is_some() => Err(StoreError::Busy),
                Some(_) => {
                    state.slots.remove(session_id);
                    Ok(())
                }
            }
        })
    }

    fn ready(&self) -> StoreFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}
