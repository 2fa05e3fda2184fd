//! The store's tables, one migration per schema version, and the check
//! that this build and the database agree on the version.
//!
//! Migrations run in one transaction under an advisory lock (replicas
//! starting together take turns), at start-up with `[sessions] migrate =
//! "auto"` (the default) or by `lattice migrate` alone, for teams whose
//! application role may not run DDL. A build older than the database's
//! schema refuses to start: it would not know the columns a newer one
//! relies on.

use tracing::info;

use super::pool::Pool;

/// The schema, one step per version, applied in order, each once.
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
    // 3: the lease token of the last commit, written by the commit itself:
    // a commit whose reply was lost is known by reading it back.
    "ALTER TABLE lattice_sessions ADD COLUMN last_commit uuid;",
    // 4: every query updates its session row twice (the lease, the
    // commit). An index on `touched_at`, which both move, made each update
    // write new entries into both indexes and leave the old row version
    // for VACUUM. The sweep's index is on the minute instead, which most
    // updates leave alone, and rows leave room on their page: most updates
    // then stay on the page (PostgreSQL's HOT updates) and write no index.
    // `touched_minute` is never after `touched_at`, so the sweep finds
    // every idle session through it.
    "ALTER TABLE lattice_sessions ADD COLUMN touched_minute timestamptz NOT NULL DEFAULT now();
     UPDATE lattice_sessions SET touched_minute = date_trunc('minute', touched_at);
     CREATE INDEX lattice_sessions_touched_minute ON lattice_sessions (touched_minute);
     DROP INDEX IF EXISTS lattice_sessions_touched;
     ALTER TABLE lattice_sessions SET (fillfactor = 50);",
    // 5: leases kept between queries (`keep_lease_ms`): `lease_kept` marks
    // a lease its replica keeps after a commit and hands over on request;
    // `lease_wanted` is the request, set by another replica.
    "ALTER TABLE lattice_sessions ADD COLUMN lease_kept boolean NOT NULL DEFAULT false,
         ADD COLUMN lease_wanted boolean NOT NULL DEFAULT false;",
    // 6: a session's messages are deleted with it by a trigger instead of
    // a foreign key. The key checked every message a commit inserted, a
    // lookup of its session row each (about a third of what a commit
    // statement cost the database), though the commit inserts only after
    // bumping that row in the same statement. Deleting a session, by any
    // replica (those of version 5 too), deletes its messages in the same
    // transaction, as the key's cascade did, with one statement for all
    // the sessions a DELETE removes.
    "CREATE FUNCTION lattice_delete_messages() RETURNS trigger LANGUAGE plpgsql AS $$
     BEGIN
         DELETE FROM lattice_messages m USING gone g WHERE m.session_id = g.id;
         RETURN NULL;
     END $$;
     CREATE TRIGGER lattice_sessions_delete_messages AFTER DELETE ON lattice_sessions
         REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION lattice_delete_messages();
     ALTER TABLE lattice_messages DROP CONSTRAINT IF EXISTS lattice_messages_session_id_fkey;",
];

/// The schema version this build uses.
pub const VERSION: i32 = MIGRATIONS.len() as i32;

/// The migration lock's key ("lattice" in ASCII).
const MIGRATION_LOCK: i64 = 0x006c_6174_7469_6365;

/// Why the schema can't be used.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// The database could not be asked (the reason, never the URL).
    #[error("{0}")]
    Unreachable(String),
    /// The database's schema is newer than this build.
    #[error(
        "the session store's schema is version {found}, newer than this build knows ({VERSION}): run a Lattice at \
         least as new as the one that migrated it"
    )]
    Newer {
        /// The database's version.
        found: i32,
    },
    /// Behind, and `migrate = "never"`.
    #[error(
        "the session store's schema is version {found}, this build needs {VERSION}: run `lattice migrate --config \
         FILE` (as a role that may run DDL), or set [sessions] migrate = \"auto\""
    )]
    Behind {
        /// The database's version.
        found: i32,
    },
}

fn unreachable(e: tokio_postgres::Error) -> SchemaError {
    SchemaError::Unreachable(super::failure::reason(&e))
}

/// The database's schema version (0: none yet).
pub async fn version(pool: &Pool) -> Result<i32, SchemaError> {
    let client = pool.get().await.map_err(|e| SchemaError::Unreachable(super::pool_reason(&e)))?;
    // Marked until the answers come: cut off (or failed) before then, the
    // connection is given up, not lent again (see `pool`).
    client.waiting(true);
    let exists = client
        .query_typed_one("SELECT to_regclass('lattice_migrations') IS NOT NULL", &[])
        .await
        .map_err(unreachable)?;
    let version = if exists.try_get::<_, bool>(0).map_err(unreachable)? {
        let row = client.query_typed_one("SELECT coalesce(max(version), 0) FROM lattice_migrations", &[]).await;
        row.and_then(|r| r.try_get(0)).map_err(unreachable)?
    } else {
        0
    };
    client.waiting(false);
    Ok(version)
}

/// Checks that the database's schema is the one this build uses.
pub async fn check(pool: &Pool) -> Result<(), SchemaError> {
    match version(pool).await? {
        found if found > VERSION => Err(SchemaError::Newer { found }),
        found if found < VERSION => Err(SchemaError::Behind { found }),
        _ => Ok(()),
    }
}

/// Brings the schema up to version `to` (idempotent; safe from many
/// replicas); returns the versions applied.
pub async fn migrate(pool: &Pool, to: i32) -> Result<Vec<i32>, SchemaError> {
    let mut client = pool.get().await.map_err(|e| SchemaError::Unreachable(super::pool_reason(&e)))?;
    // Marked until the transaction ends: cut off, failed or refused
    // mid-way, the connection is given up, not lent again (see `pool`).
    client.waiting(true);
    let tx = client.transaction().await.map_err(unreachable)?;
    // Simple-protocol statements only: they pass PgBouncer's transaction
    // pooling, which does not carry prepared statements.
    tx.batch_execute(&format!(
        "SELECT pg_advisory_xact_lock({MIGRATION_LOCK});
         CREATE TABLE IF NOT EXISTS lattice_migrations (
             version integer PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT now()
         )"
    ))
    .await
    .map_err(unreachable)?;
    let rows =
        tx.simple_query("SELECT coalesce(max(version), 0) FROM lattice_migrations").await.map_err(unreachable)?;
    let applied: i32 = rows
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse().ok()),
            _ => None,
        })
        .unwrap_or(0);
    if applied > VERSION {
        return Err(SchemaError::Newer { found: applied });
    }
    let mut done = Vec::new();
    let steps = MIGRATIONS.iter().take(usize::try_from(to).unwrap_or(0));
    for (i, step) in steps.enumerate().skip(usize::try_from(applied).unwrap_or(0)) {
        let version = i as i32 + 1;
        tx.batch_execute(step).await.map_err(unreachable)?;
        tx.batch_execute(&format!("INSERT INTO lattice_migrations (version) VALUES ({version})"))
            .await
            .map_err(unreachable)?;
        info!(version, "session store schema migrated");
        done.push(version);
    }
    tx.commit().await.map_err(unreachable)?;
    client.waiting(false);
    Ok(done)
}
