//! The PostgreSQL store: sessions shared by every replica.
//!
//! Two tables. `lattice_sessions` holds one row per session: its agent, a
//! version bumped by every commit, the number of messages, and the lease
//! (a random token and an expiry). `lattice_messages` holds the messages,
//! one row each, keyed by (session, sequence number): a commit inserts the
//! query's new rows and never rewrites old ones, so its cost does not grow
//! with the conversation.
//!
//! The lease is fenced: taking it sets a new token (only when there is
//! none, or it expired); renewing, committing and releasing all name the
//! token, and a commit also names the version it read. A replica that lost
//! its lease (it stalled past the expiry and another took over) can
//! therefore write nothing. A crashed replica's lease expires after
//! `lease_ttl`; a running query renews it every third of that.
//!
//! A replica may keep the conversations it knows (see `cache`): taking a
//! lease then reads only the messages committed after what it knows.
//!
//! Errors never carry the connection string: a failure is "the session
//! store (postgres) is unavailable", logged with its SQLSTATE or kind.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::watch;
use tokio_postgres::NoTls;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{
    Lease, LeaseHolder, SessionStore, StoreError, StoreFuture, StoredPage, StoredSession, cache::HistoryCache,
};
use crate::{
    config::PostgresSettings,
    domain::Message,
    metrics::{Family, Metrics},
};

/// How long a pool waits for a connection, or to make one, before the
/// operation fails as unavailable.
const POOL_TIMEOUT: Duration = Duration::from_secs(2);

/// The schema, one step per version. Applied in order, each once, under an
/// advisory lock (replicas starting together take turns).
const MIGRATIONS: &[&str] = &[
    // 1: sessions, their leases, and their messages.
    "CREATE TABLE lattice_sessions (
        id text PRIMARY KEY,
        agent text NOT NULL,
        version bigint NOT NULL DEFAULT 0,
        message_count bigint NOT NULL DEFAULT 0,
        lease_token uuid,
        lease_expires timestamptz,
        created_at timestamptz NOT NULL DEFAULT now(),
        touched_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE INDEX lattice_sessions_touched ON lattice_sessions (touched_at);
    CREATE TABLE lattice_messages (
        session_id text NOT NULL REFERENCES lattice_sessions (id) ON DELETE CASCADE,
        seq bigint NOT NULL,
        message text NOT NULL,
        PRIMARY KEY (session_id, seq)
    );",
    // 2: the principal that created each session ('' with authentication
    // off, and for sessions created before this version).
    "ALTER TABLE lattice_sessions ADD COLUMN owner text NOT NULL DEFAULT '';",
];

/// The migration lock's key ("lattice" in ASCII).
const MIGRATION_LOCK: i64 = 0x006c_6174_7469_6365;

/// Sessions in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: Pool,
    lease_ttl: Duration,
    idle_ttl: Duration,
    /// The conversations this replica knows, if kept: taking a lease then
    /// reads only the messages committed since.
    cache: Option<Arc<HistoryCache>>,
    /// Leases taken on a conversation this replica knew (only the new
    /// messages read), and on one read whole.
    reads_new_only: Arc<AtomicUsize>,
    reads_whole: Arc<AtomicUsize>,
}

/// Logs a database error by kind (never its text, which may quote values)
/// and maps it to "unavailable".
fn unavailable(what: &str, e: &dyn std::fmt::Debug, code: Option<&str>) -> StoreError {
    warn!(operation = what, sqlstate = code.unwrap_or("-"), error_kind = %short_kind(e), "session store failed");
    StoreError::Unavailable("postgres")
}

/// The variant name of an error's Debug form: enough to tell a refused
/// connection from a timeout without printing its text.
fn short_kind(e: &dyn std::fmt::Debug) -> String {
    format!("{e:?}").split(|c: char| !c.is_alphanumeric() && c != '_').next().unwrap_or("error").to_owned()
}

fn db(what: &'static str) -> impl Fn(tokio_postgres::Error) -> StoreError {
    move |e| unavailable(what, &e, e.code().map(|c| c.code()))
}

fn pool_error(what: &'static str) -> impl Fn(deadpool_postgres::PoolError) -> StoreError {
    move |e| match &e {
        deadpool_postgres::PoolError::Backend(b) => unavailable(what, b, b.code().map(|c| c.code())),
        other => unavailable(what, other, None),
    }
}

/// A count or size as a bigint parameter (larger ones mean "no limit").
fn clamp(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Messages as stored (one JSON document each), in order.
fn parse<'t>(session_id: &str, stored: impl Iterator<Item = &'t str>) -> Result<Vec<Message>, StoreError> {
    stored
        .map(|text| {
            serde_json::from_str(text).map_err(|_| {
                warn!(session_id, "a stored message does not parse");
                StoreError::Unavailable("postgres")
            })
        })
        .collect()
}

impl PostgresStore {
    /// A pool for `settings` (nothing connects yet).
    pub fn new(settings: &PostgresSettings, lease_ttl: Duration, idle_ttl: Duration) -> Result<Self, String> {
        let mut pg: tokio_postgres::Config = settings
            .url
            .parse()
            .map_err(|_| format!("the connection string in {} does not parse", settings.url_env))?;
        pg.connect_timeout(POOL_TIMEOUT);
        pg.application_name("lattice");
        let manager = Manager::from_config(pg, NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .wait_timeout(Some(POOL_TIMEOUT))
            .create_timeout(Some(POOL_TIMEOUT))
            .recycle_timeout(Some(POOL_TIMEOUT))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| format!("cannot build the connection pool: {e}"))?;
        let cache =
            (settings.history_cache_bytes > 0).then(|| Arc::new(HistoryCache::new(settings.history_cache_bytes)));
        Ok(Self { pool, lease_ttl, idle_ttl, cache, reads_new_only: Arc::default(), reads_whole: Arc::default() })
    }

    /// Shows the store's reads and its cache in `metrics`.
    pub fn observe(&self, metrics: &Metrics) {
        let read = |how: &str| vec![("read", how.to_owned())];
        metrics.gauge(Family::SessionHistoryReads, read("new_only"), self.reads_new_only.clone());
        metrics.gauge(Family::SessionHistoryReads, read("whole"), self.reads_whole.clone());
        if let Some(cache) = &self.cache {
            metrics.gauge(Family::SessionHistoryCacheBytes, Vec::new(), cache.held());
        }
    }

    /// Brings the schema up to date (idempotent; safe from many replicas).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut client = self.pool.get().await.map_err(pool_error("migrate"))?;
        let tx = client.transaction().await.map_err(db("migrate"))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).await.map_err(db("migrate"))?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS lattice_migrations (
                version integer PRIMARY KEY,
                applied_at timestamptz NOT NULL DEFAULT now()
            )",
        )
        .await
        .map_err(db("migrate"))?;
        let row = tx
            .query_one("SELECT coalesce(max(version), 0) FROM lattice_migrations", &[])
            .await
            .map_err(db("migrate"))?;
        let applied: i32 = row.try_get(0).map_err(db("migrate"))?;
        for (i, step) in MIGRATIONS.iter().enumerate().skip(applied as usize) {
            let version = i as i32 + 1;
            tx.batch_execute(step).await.map_err(db("migrate"))?;
            tx.execute("INSERT INTO lattice_migrations (version) VALUES ($1)", &[&version])
                .await
                .map_err(db("migrate"))?;
            info!(version, "session store schema migrated");
        }
        tx.commit().await.map_err(db("migrate"))
    }

    fn ttl_ms(&self) -> f64 {
        self.lease_ttl.as_secs_f64() * 1000.0
    }

    fn idle_s(&self) -> f64 {
        self.idle_ttl.as_secs_f64()
    }

    /// The committed messages of a session from `from` to `count`, in order.
    async fn messages(
        client: &deadpool_postgres::Object,
        session_id: &str,
        from: i64,
        count: i64,
    ) -> Result<Vec<Message>, StoreError> {
        let stmt = client
            .prepare_cached(
                "SELECT message FROM lattice_messages WHERE session_id = $1 AND seq >= $2 AND seq < $3 ORDER BY seq",
            )
            .await
            .map_err(db("read"))?;
        let rows = client.query(&stmt, &[&session_id, &from, &count]).await.map_err(db("read"))?;
        let stored: Vec<&str> = rows.iter().map(|r| r.try_get(0)).collect::<Result<_, _>>().map_err(db("read"))?;
        parse(session_id, stored.into_iter())
    }

    /// Keeps the lease alive while its query runs; says so on `lost` if it
    /// can't. Ends when `done` is cancelled (commit or release).
    fn renew(&self, id: String, token: uuid::Uuid, lost: watch::Sender<bool>, done: CancellationToken) {
        let store = self.clone();
        tokio::spawn(async move {
            let every = store.lease_ttl / 3;
            let mut held_until = tokio::time::Instant::now() + store.lease_ttl;
            loop {
                tokio::select! {
                    () = done.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
                let renewed = async {
                    let client = store.pool.get().await.map_err(pool_error("renew"))?;
                    let stmt = client
                        .prepare_cached(
                            "UPDATE lattice_sessions SET lease_expires = now() + $3 * interval '1 millisecond'
                             WHERE id = $1 AND lease_token = $2",
                        )
                        .await
                        .map_err(db("renew"))?;
                    client.execute(&stmt, &[&id, &token, &store.ttl_ms()]).await.map_err(db("renew"))
                };
                let now = tokio::time::Instant::now();
                match renewed.await {
                    Ok(1) => held_until = now + store.lease_ttl,
                    Ok(_) => {
                        warn!(session_id = %id, "the session's lease was taken over");
                        let _ = lost.send(true);
                        return;
                    }
                    // The database is away: the lease holds until it expires.
                    Err(_) if now < held_until => {}
                    Err(_) => {
                        let _ = lost.send(true);
                        return;
                    }
                }
            }
        });
    }
}

/// A lease on one session row.
#[derive(Debug)]
struct PgLease {
    store: PostgresStore,
    id: String,
    token: uuid::Uuid,
    version: i64,
    created: bool,
    /// The session row's creation time, and its messages when the lease
    /// was taken: where a commit's messages go in the cache.
    born: i64,
    count: usize,
    /// Stops the renewer.
    done: CancellationToken,
}

impl LeaseHolder for PgLease {
    fn commit(&self, appended: Vec<Message>) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.done.cancel();
            let rows: Vec<String> = appended
                .iter()
                .map(|m| serde_json::to_string(m).map_err(|_| StoreError::Unavailable("postgres")))
                .collect::<Result<_, _>>()?;
            let n = rows.len() as i64;
            let client = self.store.pool.get().await.map_err(pool_error("commit"))?;
            // One statement, so one round trip and atomic: the version bump
            // (only with our token and the version we read), the new rows
            // numbered after the old ones, and the release. No bump, no rows.
            let stmt = client
                .prepare_cached(
                    "WITH bump AS (
                         UPDATE lattice_sessions
                         SET version = version + 1, message_count = message_count + $4,
                             lease_token = NULL, lease_expires = NULL, touched_at = now()
                         WHERE id = $1 AND lease_token = $2 AND version = $3
                         RETURNING message_count - $4 AS first
                     ), rows AS (
                         INSERT INTO lattice_messages (session_id, seq, message)
                         SELECT $1, bump.first + t.ord - 1, t.m
                         FROM bump, unnest($5::text[]) WITH ORDINALITY AS t(m, ord)
                     )
                     SELECT count(*) FROM bump",
                )
                .await
                .map_err(db("commit"))?;
            let row = client
                .query_one(&stmt, &[&self.id, &self.token, &self.version, &n, &rows])
                .await
                .map_err(db("commit"))?;
            let committed: i64 = row.try_get(0).map_err(db("commit"))?;
            if committed != 1 {
                return Err(StoreError::LeaseLost);
            }
            debug!(session_id = %self.id, appended = n, "session committed");
            if let Some(cache) = &self.store.cache {
                cache.append(&self.id, self.born, self.count, appended);
            }
            Ok(())
        })
    }

    fn release(self: Arc<Self>) -> StoreFuture<'static, ()> {
        self.done.cancel();
        Box::pin(async move {
            let client = self.store.pool.get().await.map_err(pool_error("release"))?;
            // A session its first query created, and that failed, is
            // deleted: a failed query leaves nothing behind.
            let sql = if self.created {
                "DELETE FROM lattice_sessions WHERE id = $1 AND lease_token = $2 AND message_count = 0"
            } else {
                "UPDATE lattice_sessions SET lease_token = NULL, lease_expires = NULL
                 WHERE id = $1 AND lease_token = $2"
            };
            let stmt = client.prepare_cached(sql).await.map_err(db("release"))?;
            client.execute(&stmt, &[&self.id, &self.token]).await.map_err(db("release"))?;
            if let Some(cache) = self.store.cache.as_ref().filter(|_| self.created) {
                cache.forget(&self.id);
            }
            Ok(())
        })
    }
}

impl SessionStore for PostgresStore {
    fn acquire_as<'a>(
        &'a self,
        session_id: &'a str,
        agent: &'a str,
        owner: Option<&'a str>,
        create: bool,
    ) -> StoreFuture<'a, Lease> {
        Box::pin(async move {
            let token = uuid::Uuid::new_v4();
            let client = self.pool.get().await.map_err(pool_error("acquire"))?;
            let (session, version, born) = if create {
                let stmt = client
                    .prepare_cached(
                        "INSERT INTO lattice_sessions (id, agent, lease_token, lease_expires, owner)
                         VALUES ($1, $2, $3, now() + $4 * interval '1 millisecond', $5)
                         ON CONFLICT (id) DO NOTHING
                         RETURNING (extract(epoch FROM created_at) * 1000000)::bigint",
                    )
                    .await
                    .map_err(db("acquire"))?;
                let inserted = client
                    .query_opt(&stmt, &[&session_id, &agent, &token, &self.ttl_ms(), &owner.unwrap_or_default()])
                    .await
                    .map_err(db("acquire"))?;
                let Some(row) = inserted else { return Err(StoreError::Busy) };
                let born: i64 = row.try_get(0).map_err(db("acquire"))?;
                if let Some(cache) = &self.cache {
                    cache.put(session_id, born, &[]);
                }
                (StoredSession { agent: agent.to_owned(), messages: Vec::new() }, 0, born)
            } else {
                // What this replica knows of the conversation: the statement
                // reads only the messages after it, unless the session is
                // another one under the same id (created at another time).
                let known = self.cache.as_ref().and_then(|c| c.get(session_id));
                let known_born = known.as_ref().map(|k| k.born);
                let known_count = known.as_ref().map_or(0, |k| k.messages.len() as i64);
                // One round trip: the lease and, read in the same statement,
                // the history it continues.
                let stmt = client
                    .prepare_cached(
                        "WITH lease AS (
                             UPDATE lattice_sessions
                             SET lease_token = $2, lease_expires = now() + $3 * interval '1 millisecond',
                                 touched_at = now()
                             WHERE id = $1 AND touched_at > now() - $4 * interval '1 second'
                               AND ($5::text IS NULL OR owner = $5)
                               AND (lease_token IS NULL OR lease_expires < now())
                             RETURNING agent, version, message_count,
                                       (extract(epoch FROM created_at) * 1000000)::bigint AS born
                         ), known AS (
                             SELECT CASE WHEN born = $6::bigint AND $7::bigint <= message_count
                                         THEN $7::bigint ELSE 0 END AS start
                             FROM lease
                         )
                         SELECT agent, version, message_count, born, start,
                                ARRAY(SELECT message FROM lattice_messages
                                      WHERE session_id = $1 AND seq >= known.start AND seq < lease.message_count
                                      ORDER BY seq)
                         FROM lease, known",
                    )
                    .await
                    .map_err(db("acquire"))?;
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
                    [&session_id, &token, &self.ttl_ms(), &self.idle_s(), &owner, &known_born, &known_count];
                let row = client.query_opt(&stmt, &params).await.map_err(db("acquire"))?;
                let Some(row) = row else {
                    let exists = client
                        .prepare_cached(
                            "SELECT 1 FROM lattice_sessions WHERE id = $1 AND touched_at > now() - $2 * interval '1 second'
                               AND ($3::text IS NULL OR owner = $3)",
                        )
                        .await
                        .map_err(db("acquire"))?;
                    let found = client
                        .query_opt(&exists, &[&session_id, &self.idle_s(), &owner])
                        .await
                        .map_err(db("acquire"))?;
                    return Err(if found.is_some() { StoreError::Busy } else { StoreError::NotFound });
                };
                let column = |i: usize| row.try_get::<_, i64>(i).map_err(db("acquire"));
                let agent: String = row.try_get(0).map_err(db("acquire"))?;
                let (version, count, born, start) = (column(1)?, column(2)?, column(3)?, column(4)?);
                let stored: Vec<&str> = row.try_get(5).map_err(db("acquire"))?;
                let fresh = if stored.len() as i64 == count - start {
                    parse(session_id, stored.into_iter())
                } else {
                    // The statement waited for the row while the previous
                    // query's commit landed: it took the lease after that
                    // commit, but read the messages as they were before it.
                    // A statement of its own reads them as committed.
                    Self::messages(&client, session_id, start, count).await
                };
                let fresh = match fresh {
                    Ok(m) => m,
                    Err(e) => {
                        // Give the lease back before failing.
                        let undo = "UPDATE lattice_sessions SET lease_token = NULL, lease_expires = NULL
                                    WHERE id = $1 AND lease_token = $2";
                        let _ = client.execute(undo, &[&session_id, &token]).await;
                        return Err(e);
                    }
                };
                let messages = match known.filter(|_| start > 0) {
                    // The known messages, and the rest as read.
                    Some(known) => {
                        self.reads_new_only.fetch_add(1, Ordering::Relaxed);
                        let mut messages = Vec::with_capacity(known.messages.len() + fresh.len());
                        messages.extend_from_slice(&known.messages);
                        let at = known.messages.len();
                        // Released before the cache extends its copy, which
                        // then has no other holder and grows in place.
                        drop(known);
                        if let Some(cache) = &self.cache {
                            cache.append(session_id, born, at, fresh.clone());
                        }
                        messages.extend(fresh);
                        messages
                    }
                    None => {
                        self.reads_whole.fetch_add(1, Ordering::Relaxed);
                        if let Some(cache) = &self.cache {
                            cache.put(session_id, born, &fresh);
                        }
                        fresh
                    }
                };
                (StoredSession { agent, messages }, version, born)
            };
            let count = session.messages.len();
            let (lost_tx, lost) = watch::channel(false);
            let done = CancellationToken::new();
            self.renew(session_id.to_owned(), token, lost_tx, done.clone());
            let holder = PgLease {
                store: self.clone(),
                id: session_id.to_owned(),
                token,
                version,
                created: create,
                born,
                count,
                done,
            };
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
            let client = self.pool.get().await.map_err(pool_error("get"))?;
            // The session and its page in one statement (one snapshot). The
            // page is walked message by message, one index lookup each, and
            // the walk stops at the size asked for: the rest of the
            // conversation is not read. A message's size here is its
            // stored length, which PostgreSQL knows without reading it.
            // A read counts as use, as in the memory store: it moves
            // `touched_at` on, at most every tenth of the idle time. That
            // is a statement of its own, run only then: an UPDATE in this
            // one would make PostgreSQL hold the whole page back until the
            // statement ends (a page of 4 MiB took 5 ms longer).
            let stmt = client
                .prepare_cached(
                    "WITH RECURSIVE s AS (
                         SELECT agent, message_count,
                                touched_at < now() - $2 * interval '100 milliseconds' AS stale
                         FROM lattice_sessions
                         WHERE id = $1 AND touched_at > now() - $2 * interval '1 second'
                           AND ($3::text IS NULL OR owner = $3)
                     ), page (seq, message, upto) AS (
                         SELECT m.seq, m.message, octet_length(m.message)::bigint
                         FROM s JOIN lattice_messages m ON m.session_id = $1 AND m.seq = $4::bigint
                         WHERE m.seq < s.message_count AND $5::bigint > 0 AND $6::bigint > 0
                       UNION ALL
                         SELECT m.seq, m.message, page.upto + octet_length(m.message)
                         FROM page, s JOIN lattice_messages m ON m.session_id = $1
                         WHERE m.seq = page.seq + 1 AND m.seq < s.message_count
                           AND m.seq - $4 < $5 AND page.upto < $6
                     )
                     SELECT agent, message_count, stale, ARRAY(SELECT message FROM page ORDER BY seq) FROM s",
                )
                .await
                .map_err(db("get"))?;
            let (from, most, bytes) = (clamp(from), clamp(most), clamp(bytes));
            let row = client
                .query_opt(&stmt, &[&session_id, &self.idle_s(), &owner, &from, &most, &bytes])
                .await
                .map_err(db("get"))?;
            let row = row.ok_or(StoreError::NotFound)?;
            let (agent, total, stale, stored): (String, i64, bool, Vec<&str>) = (
                row.try_get(0).map_err(db("get"))?,
                row.try_get(1).map_err(db("get"))?,
                row.try_get(2).map_err(db("get"))?,
                row.try_get(3).map_err(db("get"))?,
            );
            if stale {
                let touch = client
                    .prepare_cached(
                        "UPDATE lattice_sessions SET touched_at = now()
                         WHERE id = $1 AND touched_at < now() - $2 * interval '100 milliseconds'",
                    )
                    .await
                    .map_err(db("touch"))?;
                client.execute(&touch, &[&session_id, &self.idle_s()]).await.map_err(db("touch"))?;
            }
            let total = usize::try_from(total).unwrap_or_default();
            Ok(StoredPage { agent, total, messages: parse(session_id, stored.into_iter())? })
        })
    }

    fn delete_as<'a>(&'a self, session_id: &'a str, owner: Option<&'a str>) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let client = self.pool.get().await.map_err(pool_error("delete"))?;
            let stmt = client
                .prepare_cached(
                    "DELETE FROM lattice_sessions WHERE id = $1 AND ($2::text IS NULL OR owner = $2)
                       AND (lease_token IS NULL OR lease_expires < now())",
                )
                .await
                .map_err(db("delete"))?;
            if client.execute(&stmt, &[&session_id, &owner]).await.map_err(db("delete"))? == 1 {
                if let Some(cache) = &self.cache {
                    cache.forget(session_id);
                }
                return Ok(());
            }
            let found = client
                .query_opt(
                    "SELECT 1 FROM lattice_sessions WHERE id = $1 AND ($2::text IS NULL OR owner = $2)",
                    &[&session_id, &owner],
                )
                .await
                .map_err(db("delete"))?;
            Err(if found.is_some() { StoreError::Busy } else { StoreError::NotFound })
        })
    }

    fn ready(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let client = self.pool.get().await.map_err(pool_error("ready"))?;
            client.simple_query("SELECT 1").await.map_err(db("ready"))?;
            Ok(())
        })
    }

    fn name(&self) -> &'static str {
        "postgres"
    }
}

impl PostgresStore {
    /// Deletes sessions idle past the limit (their messages go with them).
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let client = self.pool.get().await.map_err(pool_error("sweep"))?;
        client
            .execute(
                "DELETE FROM lattice_sessions WHERE touched_at < now() - $1 * interval '1 second'
                 AND (lease_token IS NULL OR lease_expires < now())",
                &[&self.idle_s()],
            )
            .await
            .map_err(db("sweep"))
    }
}
