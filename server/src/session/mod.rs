//! Stored conversations and the lease that lets one query at a time change
//! each of them, behind one async trait with two backends: `memory` (one
//! process, bounded and expiring) and `postgres` (shared by every replica).
//!
//! The contract both keep:
//! - [`SessionStore::acquire`] takes a session's lease for one query (or
//!   creates the session) and returns the conversation as last committed.
//!   A second query finds the session [`StoreError::Busy`], on any replica.
//! - The conversation changes only through [`Lease::commit`], which appends
//!   the query's new messages and releases the lease in one step, and only
//!   if the lease is still held. (The PostgreSQL store may keep the lease
//!   for the session's next query on the same replica instead, handing it
//!   to any other replica that asks: to everyone else it stays busy, as a
//!   released lease a query took at once would be.) Dropping a lease
//!   changes nothing; it is released (or, if its holder crashed, it
//!   expires).
//! - Messages are only ever appended: a commit never rewrites history, so
//!   it costs the same for a conversation of 10 turns or 1,000.

mod cache;
mod memory;
mod postgres;

use std::{fmt, future::Future, pin::Pin, sync::Arc};

pub use memory::MemoryStore;
pub use postgres::{PostgresStore, SCHEMA_VERSION, SchemaError, connect_once as connect_postgres_once};
use tokio::{sync::watch, time::Instant};

use crate::domain::Message;

/// A new session id: 128 bits from the operating system's CSPRNG, as 32
/// lowercase hex digits. Unguessable: holding an id is no proof of
/// ownership (sessions are also bound to their principal), but nobody
/// finds one by trying.
pub fn new_id() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    // The OS's generator does not fail once the process runs; were it to,
    // a v4 UUID (122 bits from a CSPRNG as well) is the fallback.
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        bytes = uuid::Uuid::new_v4().into_bytes();
    }
    const HEX: &[u8; 16] = b"0123456789abcdef";
    bytes.iter().flat_map(|b| [HEX[usize::from(b >> 4)] as char, HEX[usize::from(b & 15)] as char]).collect()
}

/// A stored conversation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoredSession {
    /// The agent it belongs to.
    pub agent: String,
    /// The conversation, as committed by successful queries.
    pub messages: Vec<Message>,
}

/// One page of a stored conversation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoredPage {
    /// The agent the session belongs to.
    pub agent: String,
    /// How many messages the whole conversation has.
    pub total: usize,
    /// The page's messages, in order.
    pub messages: Vec<Message>,
}

/// Why a store operation failed. Messages never name the store's address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No such session.
    #[error("session not found")]
    NotFound,
    /// A query runs in the session.
    #[error("another query is running in this session")]
    Busy,
    /// The lease was lost (expired, or taken over) before the commit:
    /// nothing was written.
    #[error("the session's lease was lost before the query could be stored; nothing was written")]
    LeaseLost,
    /// The store holds as many sessions as it may.
    #[error("the session store is full ({0} sessions)")]
    Full(usize),
    /// The store can't be reached; `0` names the backend, never its URL.
    /// Nothing was written.
    #[error("the session store ({0}) is unavailable")]
    Unavailable(&'static str),
    /// The query's deadline passed while the store was asked (to lease or
    /// to commit): nothing was written.
    #[error("the query's deadline passed while the session store was asked")]
    Deadline,
    /// A commit was sent, its reply was lost, and the store could not be
    /// asked again before the query's deadline: the turn may or may not be
    /// stored. Read the session to know.
    #[error("the session store did not say whether the turn was stored; read the session to know")]
    CommitOutcomeUnknown,
}

/// A future the store returns from a trait object.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// Where conversations live.
pub trait SessionStore: Send + Sync + fmt::Debug {
    /// Takes the session's lease for one query, creating the session when
    /// `create` is set (its id must then be new), owned by `owner`. With an
    /// owner, a session of another owner is [`StoreError::NotFound`]; with
    /// none (authentication off), any session is found.
    fn acquire_as<'a>(
        &'a self,
        session_id: &'a str,
        agent: &'a str,
        owner: Option<&'a str>,
        create: bool,
    ) -> StoreFuture<'a, Lease>;
    /// A page of the conversation as last committed (of `owner`'s
    /// sessions, when set): the messages from index `from` on, at most
    /// `most` of them, ending with the first that takes the page's size to
    /// `bytes` or past it. Sizes are the store's own measure, close to but
    /// not exactly the size on the wire ([`Message::size`] in memory, the
    /// stored JSON's length in PostgreSQL): the caller trims to its exact
    /// limit. Only the page is read, so
    /// paging through a long conversation reads it once. Past the end, the
    /// page is empty.
    fn page_as<'a>(
        &'a self,
        session_id: &'a str,
        owner: Option<&'a str>,
        from: usize,
        most: usize,
        bytes: usize,
    ) -> StoreFuture<'a, StoredPage>;
    /// Deletes a session (of `owner`'s, when set; refused while a query
    /// runs in it).
    fn delete_as<'a>(&'a self, session_id: &'a str, owner: Option<&'a str>) -> StoreFuture<'a, ()>;

    /// [`SessionStore::acquire_as`], waiting for the store no later than
    /// `deadline` (the query's): past it, [`StoreError::Deadline`], and a
    /// lease the store may have granted meanwhile is given back.
    fn acquire_until<'a>(
        &'a self,
        session_id: &'a str,
        agent: &'a str,
        owner: Option<&'a str>,
        create: bool,
        deadline: Instant,
    ) -> StoreFuture<'a, Lease> {
        let _ = deadline;
        self.acquire_as(session_id, agent, owner, create)
    }

    /// [`SessionStore::acquire_as`] with no owner.
    fn acquire<'a>(&'a self, session_id: &'a str, agent: &'a str, create: bool) -> StoreFuture<'a, Lease> {
        self.acquire_as(session_id, agent, None, create)
    }
    /// The whole conversation as last committed (of `owner`'s sessions,
    /// when set).
    fn get_as<'a>(&'a self, session_id: &'a str, owner: Option<&'a str>) -> StoreFuture<'a, StoredSession> {
        Box::pin(async move {
            let page = self.page_as(session_id, owner, 0, usize::MAX, usize::MAX).await?;
            Ok(StoredSession { agent: page.agent, messages: page.messages })
        })
    }
    /// [`SessionStore::get_as`] with no owner.
    fn get<'a>(&'a self, session_id: &'a str) -> StoreFuture<'a, StoredSession> {
        self.get_as(session_id, None)
    }
    /// [`SessionStore::delete_as`] with no owner.
    fn delete<'a>(&'a self, session_id: &'a str) -> StoreFuture<'a, ()> {
        self.delete_as(session_id, None)
    }
    /// Whether the store can serve now (for health).
    fn ready(&self) -> StoreFuture<'_, ()>;
    /// The backend's name, for logs and errors.
    fn name(&self) -> &'static str;
}

/// What a backend does for a lease it handed out.
pub trait LeaseHolder: Send + Sync + fmt::Debug {
    /// Appends `appended` to the conversation at the version the lease was
    /// taken at, and releases the lease, atomically; or does nothing and
    /// fails if the lease is no longer held. Waits for the store until
    /// `deadline` at the latest (the store's own timeout when `None`). An
    /// error means nothing was written, except
    /// [`StoreError::CommitOutcomeUnknown`].
    fn commit(&self, appended: Vec<Message>, deadline: Option<Instant>) -> StoreFuture<'_, ()>;
    /// Releases the lease without changes (best effort: an unreleased lease
    /// expires). What can be done at once is done before it returns; the
    /// rest is the future.
    fn release(self: Arc<Self>) -> StoreFuture<'static, ()>;
}

/// The right to run one query in a session. The conversation changes only
/// through [`Lease::commit`]; dropping the lease releases it.
#[derive(Debug)]
pub struct Lease {
    /// The conversation when the lease was taken.
    pub session: StoredSession,
    /// Whether this lease created the session.
    pub created: bool,
    holder: Option<Arc<dyn LeaseHolder>>,
    /// Turns true if the lease is lost while the query runs.
    lost: watch::Receiver<bool>,
}

impl Lease {
    /// A lease over `holder`; `lost` turns true if it is lost.
    pub fn new(
        session: StoredSession,
        created: bool,
        holder: Arc<dyn LeaseHolder>,
        lost: watch::Receiver<bool>,
    ) -> Self {
        Self { session, created, holder: Some(holder), lost }
    }

    /// Appends a successful query's new messages and releases the lease.
    pub async fn commit(self, appended: Vec<Message>) -> Result<(), StoreError> {
        self.commit_inner(appended, None).await
    }

    /// [`Lease::commit`], waiting for the store until `deadline` at the
    /// latest (the query's). Ok: stored once. An error: nothing stored,
    /// and the lease given back, except [`StoreError::CommitOutcomeUnknown`].
    pub async fn commit_until(self, appended: Vec<Message>, deadline: Instant) -> Result<(), StoreError> {
        self.commit_inner(appended, Some(deadline)).await
    }

    async fn commit_inner(mut self, appended: Vec<Message>, deadline: Option<Instant>) -> Result<(), StoreError> {
        let Some(holder) = self.holder.take() else { return Err(StoreError::LeaseLost) };
        holder.commit(appended, deadline).await
    }

    /// Releases the lease without changes, and waits until it is released:
    /// the session's next query finds it free.
    pub async fn release(mut self) {
        if let Some(holder) = self.holder.take() {
            let _ = holder.release().await;
        }
    }

    /// Releases the lease without changes, waiting for it until `deadline`
    /// at the latest; past it the release goes on in the background (bounded
    /// by the store's own timeout).
    pub async fn release_until(mut self, deadline: Instant) {
        if let Some(holder) = self.holder.take() {
            let release = tokio::spawn(holder.release());
            let _ = tokio::time::timeout_at(deadline, release).await;
        }
    }

    /// Resolves if the lease is lost while held (it could not be renewed):
    /// the query must stop, and its commit would fail.
    pub async fn lost(&self) {
        let mut lost = self.lost.clone();
        // A closed channel means the renewer ended with the lease: not lost.
        if lost.wait_for(|l| *l).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Lease {
    /// Released at once where the backend can, else in the background (an
    /// unreleased lease expires anyway).
    fn drop(&mut self) {
        let Some(holder) = self.holder.take() else { return };
        let release = holder.release();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(release);
        }
    }
}

#[cfg(test)]
mod tests;
