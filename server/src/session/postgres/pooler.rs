//! Whether the database is reached through a pooler in transaction mode
//! (PgBouncer's `pool_mode = transaction`), which hands each transaction of
//! a client connection to whichever server connection is free. Through one,
//! statements must be sent unnamed and one at a time on a connection (see
//! `conn::Mode`).
//!
//! Two connections of the probe's own show it. The first runs two
//! transactions, then the second opens one and keeps it open, and the
//! first runs a third. Connected directly (or through a session pooler, or
//! a plain TCP proxy), each connection has a server process of its own:
//! the first's transactions all run on one, at once, and the second's is
//! another. Through a transaction pooler, one of these shows instead,
//! whichever server connection the pooler hands out:
//! - the first's second transaction runs on another process than its
//!   first (a pooler handing out its idle server connections in turn,
//!   PgBouncer's `server_round_robin`, with two or more idle);
//! - the second is served by the first's process (the most recently freed
//!   handed out first, PgBouncer's default; or only one idle);
//! - the first's third transaction runs on another process, or waits for
//!   one (the pool is full).
//!
//! A direct connection never shows any of them, so other clients of the
//! pooler taking server connections meanwhile cannot hide it, only show
//! it another way.

use std::{future::Future, time::Duration};

use deadpool_postgres::Connect;
use tokio_postgres::{Client, SimpleQueryMessage};
use tracing::debug;

use super::{PostgresStore, failure};

/// How long the probe lets the pooler take the first connection's server
/// connection back before the second asks for one.
const HAND_BACK: Duration = Duration::from_millis(20);

/// How long the first connection's second transaction may wait for a
/// server connection before the wait itself shows a pooler.
const WAIT: Duration = Duration::from_millis(500);

impl PostgresStore {
    /// Probes for a pooler in transaction mode (see the module docs),
    /// unless that is known already: if one is found, statements are sent
    /// unnamed, one at a time on each connection; if not, they may be
    /// pipelined. Err: the reason the database could not be asked.
    pub(super) async fn find_pooler(&self) -> Result<(), String> {
        if !self.mode.unknown() {
            return Ok(());
        }
        if let Some(how) = self.transaction_pooled().await? {
            self.mode.transaction_pooler(how);
        } else {
            debug!("no pooler in transaction mode in front of the database");
            self.mode.direct();
        }
        Ok(())
    }

    /// How the probe found a pooler in transaction mode, if it did.
    async fn transaction_pooled(&self) -> Result<Option<&'static str>, String> {
        let connect = async || self.connector.connect(&self.pg).await.map_err(|e| failure::reason(&e));
        let (first, first_task) = connect().await?;
        let (second, second_task) = connect().await?;
        let probe = async {
            let before = [process(&first).await?, process(&first).await?];
            tokio::time::sleep(HAND_BACK).await;
            second.simple_query("BEGIN").await.map_err(|e| failure::reason(&e))?;
            verdict(before, process(&second).await?, process(&first)).await
        };
        let pooled = probe.await;
        drop((first, second));
        first_task.abort();
        second_task.abort();
        pooled
    }
}

/// What the probe shows, given the server processes of the first
/// connection's two transactions (`before`), of the second's open one
/// (`second`), and the first's third transaction (`next`, which may wait
/// for a server connection): how a pooler in transaction mode showed, or
/// None.
async fn verdict(
    before: [i32; 2],
    second: i32,
    next: impl Future<Output = Result<i32, String>>,
) -> Result<Option<&'static str>, String> {
    const MOVED: &str = "a connection's next transaction ran on another server process";
    if before[0] != before[1] {
        return Ok(Some(MOVED));
    }
    if second == before[1] {
        return Ok(Some("a second connection was served by the first's server process"));
    }
    match tokio::time::timeout(WAIT, next).await {
        Ok(after) => Ok((after? != before[1]).then_some(MOVED)),
        Err(_) => Ok(Some("a connection's next transaction waited for another's")),
    }
}

/// The server process serving `client`'s transaction.
async fn process(client: &Client) -> Result<i32, String> {
    let messages = client.simple_query("SELECT pg_backend_pid()").await.map_err(|e| failure::reason(&e))?;
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0)?.parse().ok(),
            _ => None,
        })
        .ok_or_else(|| "pg_backend_pid() gave no row".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct: a process of each connection's own, and the first's
    /// transactions all on its own, at once. A pooler: the first's second
    /// transaction moved, a process shared, the third transaction moved, or
    /// kept waiting [`WAIT`] (and no longer).
    #[tokio::test(start_paused = true)]
    async fn a_pooler_shows_by_a_move_a_shared_process_or_a_wait() {
        let start = tokio::time::Instant::now();
        assert_eq!(verdict([7, 7], 8, async { Ok(7) }).await, Ok(None));
        let moved = Ok(Some("a connection's next transaction ran on another server process"));
        assert_eq!(verdict([7, 9], 8, std::future::pending()).await, moved);
        assert!(verdict([7, 7], 7, std::future::pending()).await.is_ok_and(|v| v.is_some()));
        assert_eq!(verdict([7, 7], 8, async { Ok(9) }).await, moved);
        assert_eq!(start.elapsed(), Duration::ZERO, "no answer waited for");
        let waited = verdict([7, 7], 8, std::future::pending()).await;
        assert_eq!(waited, Ok(Some("a connection's next transaction waited for another's")));
        assert_eq!(start.elapsed(), WAIT);
        let failed = verdict([7, 7], 8, async { Err("the connection was closed".to_owned()) }).await;
        assert_eq!(failed, Err("the connection was closed".to_owned()));
    }
}
