//! Stored conversations, behind a trait so that a persistent, shared store
//! can replace the in-memory one.
//!
//! One query at a time per session: a query holds the session's lease for
//! its whole run; a second query (or a delete) finds it taken.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use crate::domain::Message;

/// A stored conversation.
#[derive(Debug, Clone, Default)]
pub struct StoredSession {
    /// The agent it belongs to.
    pub agent: String,
    /// The conversation, as committed by successful queries.
    pub messages: Vec<Message>,
}

/// Why a store operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No such session.
    #[error("session not found")]
    NotFound,
    /// A query runs in the session.
    #[error("another query is running in this session")]
    Busy,
}

/// Where conversations live.
pub trait SessionStore: Send + Sync + std::fmt::Debug {
    /// Takes the session's lease, creating the session when `create` is set.
    fn lease(&self, session_id: &str, agent: &str, create: bool) -> Result<Lease, StoreError>;
    /// A copy of a session.
    fn get(&self, session_id: &str) -> Result<StoredSession, StoreError>;
    /// Deletes a session (refused while leased).
    fn delete(&self, session_id: &str) -> Result<(), StoreError>;
}

#[derive(Debug, Default)]
struct Slot {
    session: StoredSession,
    leased: bool,
}

/// The in-memory store.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    slots: Arc<Mutex<HashMap<String, Slot>>>,
}

/// The right to run one query in a session. Released on drop; the
/// conversation changes only through [`Lease::commit`].
#[derive(Debug)]
pub struct Lease {
    store: MemoryStore,
    session_id: String,
    /// The conversation when the lease was taken.
    pub session: StoredSession,
    /// Whether the session was created by this lease (and has no messages yet).
    pub created: bool,
}

impl Lease {
    /// The session's id.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// Stores the conversation a successful query produced.
    pub fn commit(self, messages: Vec<Message>) {
        let mut slots = self.store.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = slots.get_mut(&self.session_id) {
            slot.session.messages = messages;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut slots = self.store.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = slots.get_mut(&self.session_id) {
            slot.leased = false;
            // A session created by a query that failed stays empty: forget it,
            // so a failed query leaves nothing behind.
            if self.created && slot.session.messages.is_empty() {
                slots.remove(&self.session_id);
            }
        }
    }
}

impl SessionStore for MemoryStore {
    fn lease(&self, session_id: &str, agent: &str, create: bool) -> Result<Lease, StoreError> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let created = create && !slots.contains_key(session_id);
        if created {
            slots.insert(
                session_id.to_owned(),
                Slot { session: StoredSession { agent: agent.to_owned(), messages: Vec::new() }, leased: false },
            );
        }
        let slot = slots.get_mut(session_id).ok_or(StoreError::NotFound)?;
        if slot.leased {
            return Err(StoreError::Busy);
        }
        slot.leased = true;
        Ok(Lease { store: self.clone(), session_id: session_id.to_owned(), session: slot.session.clone(), created })
    }

    fn get(&self, session_id: &str) -> Result<StoredSession, StoreError> {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.get(session_id).map(|s| s.session.clone()).ok_or(StoreError::NotFound)
    }

    fn delete(&self, session_id: &str) -> Result<(), StoreError> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        match slots.get(session_id) {
            None => Err(StoreError::NotFound),
            Some(s) if s.leased => Err(StoreError::Busy),
            Some(_) => {
                slots.remove(session_id);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_has_one_lease_at_a_time_and_changes_only_on_commit() {
        let store = MemoryStore::default();
        let lease = store.lease("s", "a", true).unwrap();
        assert_eq!(store.lease("s", "a", false).unwrap_err(), StoreError::Busy);
        assert_eq!(store.delete("s").unwrap_err(), StoreError::Busy);
        lease.commit(vec![Message::user_text("hi")]);
        let lease = store.lease("s", "a", false).unwrap();
        assert_eq!(lease.session.messages.len(), 1);
        drop(lease); // no commit: unchanged
        assert_eq!(store.get("s").unwrap().messages.len(), 1);
        store.delete("s").unwrap();
        assert_eq!(store.get("s").unwrap_err(), StoreError::NotFound);
    }

    #[test]
    fn a_failed_first_query_leaves_no_session() {
        let store = MemoryStore::default();
        drop(store.lease("new", "a", true).unwrap());
        assert_eq!(store.get("new").unwrap_err(), StoreError::NotFound);
    }
}
