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
//! Every wait on the database is bounded: a query's lease and commit by the
//! query's deadline, everything else by `store_timeout`; connections have
//! TCP keepalives and a user timeout. A commit whose reply was lost (a
//! reset connection, a failover) is resolved by asking again on another
//! connection: its lease is given back by token, which fences off the
//! commit still in flight, or, if that finds the token gone, the commit's
//! token is read back. Only when no answer comes before the deadline is the
//! outcome unknown ([`StoreError::CommitOutcomeUnknown`]).
//!
//! With `keep_lease_ms`, a commit keeps its lease for the session's next
//! query on this replica, which then takes no lease statement; another
//! replica that wants the session asks for it (see `kept`).
//!
//! A query's own statements (its lease, renewals, commit, release and
//! read-back) share a few connections, several in flight on each (see
//! `shared`), once the store has found no pooler in transaction mode in
//! front of the database (see `pooler`); everything else takes a pooled
//! connection of its own.
//!
//! Statements are prepared once per connection and cached (each then runs in
//! one round trip, planned once), or, with `[sessions] prepared_statements =
//! false`, sent with their parameter types as unnamed statements (one round
//! trip, planned each time): what PgBouncer's transaction pooling needs
//! before 1.21, which does not carry prepared statements between
//! transactions. The store finds that out by itself, too: a prepared
//! statement the database lost (or finds taken) did not run, and is sent
//! again unnamed, as every statement is from then on (see `conn`).
//!
//! Errors never carry the connection string: a failure is "the session
//! store (postgres) is unavailable", logged with the reason (a SQLSTATE, a
//! TLS verdict, a refused or reset connection).

mod acquire;
mod backoff;
mod binding;
mod commit;
mod conn;
mod connect;
mod failure;
mod group;
mod keeper;
mod kept;
mod lease;
mod pool;
mod pooler;
mod renew;
mod schema;
mod shared;
mod tls;
mod url;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use acquire::Holder;
use conn::{Conn, Handle, Mode, Param, SaidOnce, bounded, db, pool_error, pool_reason, unavailable};
use deadpool_postgres::{ManagerConfig, RecyclingMethod, Runtime};
use lease::PgLease;
use pool::Pool;
pub use schema::{SchemaError, VERSION as SCHEMA_VERSION};
use tokio::time::Instant;
use tokio_postgres::{SimpleQueryMessage, types::Type};
use tracing::warn;

use super::{Lease, SessionStore, StoreError, StoreFuture, StoredPage, StoredSession, cache::HistoryCache};
use crate::{
    config::PostgresSettings,
    domain::Message,
    metrics::{Family, Metrics},
};

/// Sessions in PostgreSQL.
///
/// One allocation shared by its clones: a query's lease, its commit and
/// the tasks they start each hold one, at the cost of one count.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

impl std::ops::Deref for PostgresStore {
    type Target = Inner;

    fn deref(&self) -> &Inner {
        &self.inner
    }
}

/// What a [`PostgresStore`] is made of.
#[derive(Debug, Clone)]
pub struct Inner {
    pool: Pool,
    lease_ttl: Duration,
    idle_ttl: Duration,
    /// How long any statement but a query's lease and commit may wait.
    timeout: Duration,
    /// How statements are sent: prepared or not, pipelined or not.
    mode: Arc<Mode>,
    /// How new connections are made (for the pooler probe), and word of
    /// each one made (for leases not yet given back).
    pg: tokio_postgres::Config,
    connector: connect::Connector,
    /// The connections queries' own statements share, if any (else they
    /// take pooled ones).
    shared: Option<Arc<shared::Shared>>,
    /// Whether start-up (and health, until it succeeds) migrates the
    /// schema, or only checks it.
    migrate: bool,
    /// The conversations this replica knows, if kept: taking a lease then
    /// reads only the messages committed since.
    cache: Option<Arc<HistoryCache>>,
    /// Leases taken on a conversation this replica knew (only the new
    /// messages read), and on one read whole.
    reads_new_only: Arc<AtomicUsize>,
    reads_whole: Arc<AtomicUsize>,
    /// The leases this replica keeps between queries, if it keeps any;
    /// and the queries that used one (no lease statement, nothing read).
    kept: Option<Arc<kept::Kept>>,
    reads_kept: Arc<AtomicUsize>,
    /// Kept leases handed to another replica.
    handovers: Arc<AtomicUsize>,
    /// Why the readiness probe fails, said once.
    unready: Arc<SaidOnce>,
    /// 1 while the readiness probe succeeds, 0 while it fails.
    up: Arc<AtomicUsize>,
    /// How queries' commits ended.
    commits: Arc<commit::Outcomes>,
    /// Stops the keeper (started with the first lease kept).
    keeper: Arc<keeper::Keeper>,
    /// Commits waiting for their statement, grouped (see `group`).
    group: Arc<group::Group>,
    /// Renews the leases of running queries (see `renew`).
    renewer: Arc<renew::Renewer>,
    /// The runtime's busy poller (`server.busy_poll_us`), which a query's
    /// statement on its way keeps polling.
    poller: Option<Arc<crate::busy_poll::Poller>>,
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

/// One connection to the database at `url` (libpq's forms; TLS as its
/// `sslmode` says), made as the store makes its own, outside any pool: for
/// tools that time the database itself, as `lattice-bench` does. Err: why
/// (never the URL).
pub async fn connect_once(url: &str) -> Result<tokio_postgres::Client, String> {
    use deadpool_postgres::Connect as _;
    let target = url::parse(url)?;
    let connector = connect::Connector::new(target.tls);
    // (The connection's task runs on until the client is dropped.)
    let (client, _task) = connector.connect(&target.config).await.map_err(|e| failure::reason(&e))?;
    Ok(client)
}

impl PostgresStore {
    /// A pool for `settings` (nothing connects yet). Err: the connection
    /// string can't be used (said without quoting it).
    pub fn new(settings: &PostgresSettings, lease_ttl: Duration, idle_ttl: Duration) -> Result<Self, String> {
        let target = url::parse(&settings.url)
            .map_err(|why| format!("the connection string in {}: {why}", settings.url_source()))?;
        let timeout = settings.store_timeout;
        let pg = connect::prepared(target.config, timeout);
        let mut connector = connect::Connector::new(target.tls);
        if let Some(path) = &settings.url_file {
            connector = connector.reread(path.clone(), timeout);
        }
        let (pg_probe, connector_probe) = (pg.clone(), connector.clone());
        let shared = (settings.pipeline_connections > 0)
            .then(|| Arc::new(shared::Shared::new(pg.clone(), connector.clone(), settings.pipeline_connections)));
        let manager = pool::Manager(deadpool_postgres::Manager::from_connect(
            pg,
            connector,
            ManagerConfig { recycling_method: RecyclingMethod::Fast },
        ));
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| format!("cannot build the connection pool: {e}"))?;
        let cache =
            (settings.history_cache_bytes > 0).then(|| Arc::new(HistoryCache::new(settings.history_cache_bytes)));
        let inner = Inner {
            pool,
            lease_ttl,
            idle_ttl,
            timeout,
            mode: Arc::new(Mode::new(settings.prepared_statements)),
            pg: pg_probe,
            connector: connector_probe,
            shared,
            migrate: settings.migrate,
            cache,
            reads_new_only: Arc::default(),
            reads_whole: Arc::default(),
            kept: (!settings.keep_lease.is_zero()).then(|| Arc::new(kept::Kept::new(settings.keep_lease, lease_ttl))),
            reads_kept: Arc::default(),
            handovers: Arc::default(),
            unready: Arc::default(),
            up: Arc::default(),
            commits: Arc::default(),
            keeper: Arc::default(),
            group: Arc::default(),
            renewer: Arc::new(renew::Renewer::new(lease_ttl, timeout)),
            poller: None,
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Keeps `poller` polling while a query's statement (its lease, its
    /// history, its commit) is on its way (see [`crate::busy_poll`]).
    pub fn poll_with(mut self, poller: Option<Arc<crate::busy_poll::Poller>>) -> Self {
        Arc::make_mut(&mut self.inner).poller = poller;
        self
    }

    /// Marks a query's statement in flight on the busy poller, if any,
    /// until dropped.
    fn polling(&self) -> Option<crate::busy_poll::InFlight<'_>> {
        self.poller.as_ref().map(|p| p.call())
    }

    /// `statement`, a query's own, awaited with the busy poller polling.
    async fn polled<T>(&self, statement: impl std::future::Future<Output = T>) -> T {
        let _polling = self.polling();
        statement.await
    }

    /// Shows the store's reads and its cache in `metrics`.
    pub fn observe(&self, metrics: &Metrics) {
        let read = |how: &str| vec![("read", how.to_owned())];
        metrics.gauge(Family::SessionHistoryReads, read("new_only"), self.reads_new_only.clone());
        metrics.gauge(Family::SessionHistoryReads, read("whole"), self.reads_whole.clone());
        if self.kept.is_some() {
            metrics.gauge(Family::SessionHistoryReads, read("kept"), self.reads_kept.clone());
            metrics.gauge(Family::SessionLeaseHandovers, Vec::new(), self.handovers.clone());
        }
        for (outcome, count) in self.commits.each() {
            metrics.gauge(Family::SessionCommits, vec![("outcome", outcome.to_owned())], count);
        }
        metrics.gauge(Family::SessionStoreUp, Vec::new(), self.up.clone());
        let sent = |how: &str| vec![("sent", how.to_owned())];
        metrics.gauge(Family::SessionCommitStatements, sent("alone"), self.group.alone.clone());
        metrics.gauge(Family::SessionCommitStatements, sent("grouped"), self.group.grouped.clone());
        metrics.gauge(Family::SessionGroupedCommits, Vec::new(), self.group.grouped_commits.clone());
        if let Some(cache) = &self.cache {
            metrics.gauge(Family::SessionHistoryCacheBytes, Vec::new(), cache.held());
        }
    }

    /// Makes the schema usable: brings it up to date with `migrate =
    /// "auto"`, else checks that it is this build's; then looks for a
    /// pooler in transaction mode in front of the database (statements are
    /// pipelined only once none is found). Within the store's timeout.
    pub async fn prepare_schema(&self) -> Result<(), SchemaError> {
        let work = async {
            if self.migrate {
                schema::migrate(&self.pool, schema::VERSION).await?;
            } else {
                schema::check(&self.pool).await?;
            }
            self.find_pooler().await.map_err(SchemaError::Unreachable)
        };
        tokio::time::timeout(self.timeout, work)
            .await
            .unwrap_or_else(|_| Err(SchemaError::Unreachable("the database did not answer in time".into())))
    }

    /// Brings the schema up to date (idempotent; safe from many replicas),
    /// whatever `migrate` says: `lattice migrate`; then looks for a pooler
    /// in transaction mode, as [`PostgresStore::prepare_schema`] does.
    /// Returns the versions applied.
    pub async fn migrate(&self) -> Result<Vec<i32>, SchemaError> {
        let applied = schema::migrate(&self.pool, schema::VERSION).await?;
        self.find_pooler().await.map_err(SchemaError::Unreachable)?;
        Ok(applied)
    }

    /// [`PostgresStore::migrate`] up to `version` at most (this build's at
    /// most): a database as an older build left it, to test what migrating
    /// it further keeps.
    pub async fn migrate_to(&self, version: i32) -> Result<Vec<i32>, SchemaError> {
        schema::migrate(&self.pool, version.min(schema::VERSION)).await
    }

    /// A connection from the pool, for `what`.
    async fn conn(&self, what: &'static str) -> Result<Conn<'_>, StoreError> {
        let client = self.pool.get().await.map_err(pool_error(what))?;
        Ok(Conn { client: Handle::Pooled(Box::new(client)), mode: &self.mode })
    }

    /// A connection for a query's own statements (`what`): a shared one,
    /// if there are any, else one from the pool.
    async fn query_conn(&self, what: &'static str) -> Result<Conn<'_>, StoreError> {
        let Some(shared) = self.shared.as_ref().filter(|_| self.mode.pipelined()) else {
            return self.conn(what).await;
        };
        let lent = shared.get().await.map_err(db(what))?;
        Ok(Conn { client: Handle::Shared(lent), mode: &self.mode })
    }

    /// The deadline of a statement that has only the store's timeout.
    fn soon(&self) -> Instant {
        Instant::now() + self.timeout
    }

    fn ttl_ms(&self) -> f64 {
        self.lease_ttl.as_secs_f64() * 1000.0
    }

    fn idle_s(&self) -> f64 {
        self.idle_ttl.as_secs_f64()
    }

    /// The committed messages of a session from `from` to `count`, in order.
    async fn messages(client: &Conn<'_>, session_id: &str, from: i64, count: i64) -> Result<Vec<Message>, StoreError> {
        let rows = client
            .rows(
                "SELECT message FROM lattice_messages WHERE session_id = $1 AND seq >= $2 AND seq < $3 ORDER BY seq",
                &[(&session_id, Type::TEXT), (&from, Type::INT8), (&count, Type::INT8)],
            )
            .await
            .map_err(db("read"))?;
        let stored: Vec<&str> = rows.iter().map(|r| r.try_get(0)).collect::<Result<_, _>>().map_err(db("read"))?;
        parse(session_id, stored.into_iter())
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
        self.acquire_until(session_id, agent, owner, create, self.soon())
    }

    fn acquire_until<'a>(
        &'a self,
        session_id: &'a str,
        agent: &'a str,
        owner: Option<&'a str>,
        create: bool,
        deadline: Instant,
    ) -> StoreFuture<'a, Lease> {
        Box::pin(async move {
            if !create && let Some(kept) = &self.kept {
                match kept.take(session_id, owner) {
                    kept::Found::Lease(entry) => return self.kept_lease(session_id, entry, deadline).await,
                    kept::Found::InUse => return Err(StoreError::Busy),
                    kept::Found::Stale(entry) => {
                        // Given back before a lease is taken anew: else
                        // this replica would wait for itself to hand it
                        // over.
                        let give_back = self.give_back_later(session_id.to_owned(), entry.held.token, false);
                        let _ = tokio::time::timeout_at(deadline, give_back).await;
                    }
                    kept::Found::Nothing => {}
                }
            }
            // Boxed on its own: a kept lease's future stays small (a query
            // copies it once), and only a lease taken from the database
            // carries the statements' futures.
            Box::pin(self.take_lease(session_id, agent, owner, create, deadline)).await
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
        Box::pin(bounded(self.soon(), "get", StoreError::Unavailable("postgres"), async move {
            let client = self.conn("get").await?;
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
            let (from, most, bytes) = (clamp(from), clamp(most), clamp(bytes));
            let params: [Param<'_>; 6] = [
                (&session_id, Type::TEXT),
                (&self.idle_s(), Type::FLOAT8),
                (&owner, Type::TEXT),
                (&from, Type::INT8),
                (&most, Type::INT8),
                (&bytes, Type::INT8),
            ];
            let row = client
                .maybe_row(
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
                    &params,
                )
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
                client
                    .exec(
                        "UPDATE lattice_sessions SET touched_at = now(), touched_minute = date_trunc('minute', now())
                         WHERE id = $1 AND touched_at < now() - $2 * interval '100 milliseconds'",
                        &[(&session_id, Type::TEXT), (&self.idle_s(), Type::FLOAT8)],
                    )
                    .await
                    .map_err(db("touch"))?;
            }
            let total = usize::try_from(total).unwrap_or_default();
            Ok(StoredPage { agent, total, messages: parse(session_id, stored.into_iter())? })
        }))
    }

    fn delete_as<'a>(&'a self, session_id: &'a str, owner: Option<&'a str>) -> StoreFuture<'a, ()> {
        Box::pin(bounded(self.soon(), "delete", StoreError::Unavailable("postgres"), async move {
            // A lease this replica keeps is given back first; one another
            // replica keeps is asked for, and waited for a little.
            if let Some(kept) = &self.kept {
                match kept.take(session_id, owner) {
                    kept::Found::InUse => return Err(StoreError::Busy),
                    kept::Found::Lease(e) | kept::Found::Stale(e) => {
                        self.give_back(session_id, e.held.token, false).await?;
                    }
                    kept::Found::Nothing => {}
                }
            }
            let mut handover = kept::handover();
            loop {
                let client = self.conn("delete").await?;
                let deleted = client
                    .exec(
                        "DELETE FROM lattice_sessions WHERE id = $1 AND ($2::text IS NULL OR owner = $2)
                           AND (lease_token IS NULL OR lease_expires < now())",
                        &[(&session_id, Type::TEXT), (&owner, Type::TEXT)],
                    )
                    .await
                    .map_err(db("delete"))?;
                if deleted == 1 {
                    if let Some(cache) = &self.cache {
                        cache.forget(session_id);
                    }
                    return Ok(());
                }
                match self.holder("delete", &client, session_id, owner, None).await? {
                    Holder::Missing => return Err(StoreError::NotFound),
                    Holder::Busy => return Err(StoreError::Busy),
                    // Kept elsewhere and asked for, or released just now.
                    Holder::Kept | Holder::Free => {
                        drop(client);
                        if !handover.pause().await {
                            return Err(StoreError::Busy);
                        }
                    }
                }
            }
        }))
    }

    fn ready(&self) -> StoreFuture<'_, ()> {
        let probe = bounded(self.soon(), "ready", StoreError::Unavailable("postgres"), async move {
            let client = self.conn("ready").await?;
            // Reachable is not enough: a server that takes no writes fails
            // every query.
            let answer =
                client.send(client.client.simple_query("SHOW transaction_read_only")).await.map_err(db("ready"))?;
            let read_only =
                answer.iter().any(|m| matches!(m, SimpleQueryMessage::Row(row) if row.get(0) == Some("on")));
            if read_only {
                return Err(unavailable("ready", failure::TAKES_NO_WRITES));
            }
            Ok(())
        });
        // Health asks every second.
        Box::pin(async move {
            let answer = self.unready.run("ready", probe).await;
            self.up.store(usize::from(answer.is_ok()), Ordering::Relaxed);
            answer
        })
    }

    fn name(&self) -> &'static str {
        "postgres"
    }
}

impl PostgresStore {
    /// Deletes sessions idle past the limit (their messages go with them).
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        bounded(self.soon(), "sweep", StoreError::Unavailable("postgres"), async {
            let client = self.conn("sweep").await?;
            client
                .exec(
                    "DELETE FROM lattice_sessions
                     WHERE touched_minute < now() - $1 * interval '1 second'
                       AND touched_at < now() - $1 * interval '1 second'
                     AND (lease_token IS NULL OR lease_expires < now())",
                    &[(&self.idle_s(), Type::FLOAT8)],
                )
                .await
                .map_err(db("sweep"))
        })
        .await
    }
}
