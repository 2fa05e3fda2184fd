//! The pool's connections (the readiness probe, session reads, deletes,
//! sweeps, and with `pipeline_connections = 0` queries' statements):
//! deadpool-postgres's, each marked while a statement on it awaits its
//! answer.
//!
//! A statement cut off before its answer (the store's timeout, a client
//! gone) leaves the mark, and the pool gives that connection up instead of
//! lending it again. A connection that went silent without closing (a
//! proxy whose upstream vanished keeps acknowledging, so the kernel never
//! gives up on it) would otherwise fail every statement sent on it, the
//! readiness probe's included, until something closed it. One cut off for
//! a slow answer costs a new connection, nothing more.

use std::{
    ops::{Deref, DerefMut},
    sync::atomic::{AtomicBool, Ordering},
};

use deadpool::managed::{Metrics, RecycleError, RecycleResult};
use deadpool_postgres::ClientWrapper;

use super::conn::Statements;

/// The pool.
pub(super) type Pool = deadpool::managed::Pool<Manager>;
/// A connection lent by the pool.
pub(super) type Object = deadpool::managed::Object<Manager>;

/// deadpool-postgres's manager, whose connections carry the mark.
#[derive(Debug)]
pub(super) struct Manager(pub(super) deadpool_postgres::Manager);

/// A pooled connection, its mark, and the statements prepared on it.
#[derive(Debug)]
pub(super) struct Pooled {
    client: ClientWrapper,
    waiting: AtomicBool,
    /// Kept from one loan to the next: recycling (`RecyclingMethod::Fast`)
    /// discards no prepared statement.
    pub(super) statements: Statements,
}

impl Pooled {
    /// A statement was sent (true) or has its answer, rows or an error
    /// (false).
    pub(super) fn waiting(&self, waiting: bool) {
        self.waiting.store(waiting, Ordering::Relaxed);
    }
}

impl Deref for Pooled {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        &self.client
    }
}

impl DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut ClientWrapper {
        &mut self.client
    }
}

impl deadpool::managed::Manager for Manager {
    type Type = Pooled;
    type Error = tokio_postgres::Error;

    async fn create(&self) -> Result<Pooled, tokio_postgres::Error> {
        let client = self.0.create().await?;
        Ok(Pooled { client, waiting: AtomicBool::new(false), statements: Statements::default() })
    }

    async fn recycle(&self, conn: &mut Pooled, metrics: &Metrics) -> RecycleResult<tokio_postgres::Error> {
        if *conn.waiting.get_mut() {
            return Err(RecycleError::message("a statement on it was cut off before its answer"));
        }
        self.0.recycle(&mut conn.client, metrics).await
    }

    fn detach(&self, conn: &mut Pooled) {
        self.0.detach(&mut conn.client);
    }
}
