//! Connections that every query's own statements share (its lease,
//! renewals, commit, release and read-back), several in flight on each.
//!
//! tokio-postgres pipelines the statements sent on one connection at once:
//! it writes them together and PostgreSQL's backend reads them together,
//! runs them one after another and answers in order. Each statement is
//! still its own transaction (its own `Sync`), so a failed statement fails
//! alone and every outcome is what it would be on a connection of its own;
//! under load, though, the database's backend and Lattice both spend far
//! less per statement than with one connection each (fewer wake-ups, reads
//! and writes).
//!
//! A connection that closed (a reset, a failover) is replaced by the next
//! statement that picks its slot. A statement cut off before its answer
//! (its query's deadline, a client gone) retires its connection from the
//! slot: a connection that went silent without closing must not take new
//! statements for the kernel's time to notice. Statements already in
//! flight on a retired connection keep it until they end.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicBool, AtomicUsize, Ordering},
};

use deadpool_postgres::{ClientWrapper, Connect};
use tokio_postgres::Config;

use super::{conn::Statements, connect::Connector};

/// A fixed number of shared connections; a statement takes the one with
/// the fewest tasks on it (the first, when the store is idle).
pub(super) struct Shared {
    pg: Config,
    connector: Connector,
    first: Slot,
    more: Box<[Slot]>,
}

#[derive(Default)]
struct Slot {
    /// Tasks holding the slot's connection.
    users: AtomicUsize,
    /// The slot's connection, while it is open and not retired.
    live: Mutex<Option<Arc<Connection>>>,
    /// Held while a connection is made for the slot, so that the
    /// statements waiting for one share it.
    making: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("connections", &(1 + self.more.len())).finish_non_exhaustive()
    }
}

/// A shared connection and the statements prepared on it.
pub(super) struct Connection {
    pub(super) client: ClientWrapper,
    pub(super) statements: Statements,
}

/// A shared connection lent to a task for its statements. Dropped while
/// one of them awaits its answer, it retires the connection from its slot.
pub(super) struct Lent<'a> {
    user: User<'a>,
    pub(super) client: Arc<Connection>,
    waiting: AtomicBool,
}

/// A task counted among a slot's users until it is dropped.
struct User<'a>(&'a Slot);

impl Drop for User<'_> {
    fn drop(&mut self) {
        self.0.users.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Lent<'_> {
    /// A statement was sent (true) or has its answer, rows or an error
    /// (false).
    pub(super) fn waiting(&self, waiting: bool) {
        self.waiting.store(waiting, Ordering::Relaxed);
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if *self.waiting.get_mut() {
            self.user.0.retire(&self.client);
        }
    }
}

impl Slot {
    fn open(&self) -> Option<Arc<Connection>> {
        let live = crate::sync::lock(&self.live);
        live.as_ref().filter(|c| !c.client.is_closed()).cloned()
    }

    /// Takes `client` out of the slot, if it is still there.
    fn retire(&self, client: &Arc<Connection>) {
        let mut live = crate::sync::lock(&self.live);
        if live.as_ref().is_some_and(|c| Arc::ptr_eq(c, client)) {
            *live = None;
        }
    }
}

impl Shared {
    /// `connections` slots (at least one), connected to `pg` as the pool's
    /// are, on first use.
    pub(super) fn new(pg: Config, connector: Connector, connections: usize) -> Self {
        let more = (1..connections).map(|_| Slot::default()).collect();
        Self { pg, connector, first: Slot::default(), more }
    }

    /// The connection of the slot with the fewest users, made if it has
    /// none open. (On a quiet store that is always the first, so that one
    /// query after another finds the same backend, as on a connection of
    /// their own.)
    pub(super) async fn get(&self) -> Result<Lent<'_>, tokio_postgres::Error> {
        let users = |s: &Slot| s.users.load(Ordering::Relaxed);
        let slot = self.more.iter().fold(&self.first, |best, s| if users(s) < users(best) { s } else { best });
        slot.users.fetch_add(1, Ordering::Relaxed);
        let user = User(slot);
        let lend = |user, client| Lent { user, client, waiting: AtomicBool::new(false) };
        if let Some(client) = slot.open() {
            return Ok(lend(user, client));
        }
        let _making = slot.making.lock().await;
        if let Some(client) = slot.open() {
            return Ok(lend(user, client));
        }
        let (client, task) = self.connector.connect(&self.pg).await?;
        let client =
            Arc::new(Connection { client: ClientWrapper::new(client, task), statements: Statements::default() });
        *crate::sync::lock(&slot.live) = Some(client.clone());
        Ok(lend(user, client))
    }
}
