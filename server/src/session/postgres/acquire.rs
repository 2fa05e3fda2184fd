//! Taking a session's lease: creating the session, or taking its row's lease
//! and, in the same statement, reading the messages this replica does not
//! know yet; then the renewer.

use super::*;

impl PostgresStore {
    /// Takes session `session_id`'s lease from the database (see
    /// [`SessionStore::acquire_until`]), waiting a little for another
    /// replica to hand over a lease it keeps; a failure gives back
    /// whatever the database may have granted.
    pub(super) async fn take_lease(
        &self,
        session_id: &str,
        agent: &str,
        owner: Option<&str>,
        create: bool,
        deadline: Instant,
    ) -> Result<Lease, StoreError> {
        let token = uuid::Uuid::new_v4();
        let taken = tokio::time::timeout_at(deadline, async {
            // A lease another replica keeps is asked for, and waited
            // for a little (see `kept`).
            let mut handover = kept::handover();
            loop {
                match self.polled(self.lease(session_id, agent, owner, create, token)).await {
                    Ok(Some(lease)) => return Ok(lease),
                    Ok(None) if handover.pause().await => {}
                    Ok(None) => return Err(StoreError::Busy),
                    Err(e) => return Err(e),
                }
            }
        })
        .await;
        let (failed, wait) = match taken {
            Ok(Ok(lease)) => return Ok(lease),
            Ok(Err(e @ (StoreError::Busy | StoreError::NotFound))) => return Err(e),
            // Failed with time left: the lease is given back before the
            // client hears, so that its retry finds the session free.
            Ok(Err(e)) => (e, true),
            Err(_) => {
                warn!(operation = "acquire", "session store did not answer before the query's deadline");
                (StoreError::Deadline, false)
            }
        };
        // The store may have granted the lease (a reply lost, a history
        // that did not read, the deadline): give it back by token,
        // within the store's timeout, waited for until the deadline.
        let give_back = self.give_back_later(session_id.to_owned(), token, create);
        if wait {
            let _ = tokio::time::timeout_at(deadline, give_back).await;
        }
        Err(failed)
    }

    /// Takes a session's lease (see [`SessionStore::acquire_as`]) under
    /// `token`. Ok(None): another replica keeps it, and was asked to hand
    /// it over (or it was released just now): try again shortly.
    pub(super) async fn lease(
        &self,
        session_id: &str,
        agent: &str,
        owner: Option<&str>,
        create: bool,
        token: uuid::Uuid,
    ) -> Result<Option<Lease>, StoreError> {
        let client = self.query_conn("acquire").await?;
        // The lease holds until `lease_ttl` after the statement was sent.
        let sent = Instant::now();
        let (session, version, born) = if create {
            let owner = owner.unwrap_or_default();
            let params: [Param<'_>; 5] = [
                (&session_id, Type::TEXT),
                (&agent, Type::TEXT),
                (&token, Type::UUID),
                (&self.ttl_ms(), Type::FLOAT8),
                (&owner, Type::TEXT),
            ];
            let inserted = client
                .maybe_row(
                    "INSERT INTO lattice_sessions (id, agent, lease_token, lease_expires, owner)
                     VALUES ($1, $2, $3, now() + $4 * interval '1 millisecond', $5)
                     ON CONFLICT (id) DO NOTHING
                     RETURNING (extract(epoch FROM created_at) * 1000000)::bigint",
                    &params,
                )
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
            // the history it continues (no read at all when this replica
            // knows all of it).
            let params: [Param<'_>; 7] = [
                (&session_id, Type::TEXT),
                (&token, Type::UUID),
                (&self.ttl_ms(), Type::FLOAT8),
                (&self.idle_s(), Type::FLOAT8),
                (&owner, Type::TEXT),
                (&known_born, Type::INT8),
                (&known_count, Type::INT8),
            ];
            let row = client
                .maybe_row(
                    "WITH lease AS (
                         UPDATE lattice_sessions
                         SET lease_token = $2, lease_expires = now() + $3 * interval '1 millisecond',
                             lease_kept = false, lease_wanted = false, touched_at = now(), touched_minute = date_trunc('minute', now())
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
                            CASE WHEN start < message_count
                                 THEN ARRAY(SELECT message FROM lattice_messages
                                            WHERE session_id = $1 AND seq >= known.start
                                              AND seq < lease.message_count
                                            ORDER BY seq)
                                 ELSE '{}'::text[] END
                     FROM lease, known",
                    &params,
                )
                .await
                .map_err(db("acquire"))?;
            let Some(row) = row else {
                return match self.holder("acquire", &client, session_id, owner, Some(self.idle_s())).await? {
                    Holder::Missing => Err(StoreError::NotFound),
                    Holder::Busy => Err(StoreError::Busy),
                    Holder::Kept | Holder::Free => Ok(None),
                };
            };
            let column = |i: usize| row.try_get::<_, i64>(i).map_err(db("acquire"));
            let agent: String = row.try_get(0).map_err(db("acquire"))?;
            let (version, count, born, start) = (column(1)?, column(2)?, column(3)?, column(4)?);
            let stored: Vec<&str> = row.try_get(5).map_err(db("acquire"))?;
            let fresh = if stored.len() as i64 == count - start {
                parse(session_id, stored.into_iter())?
            } else {
                // The statement waited for the row while the previous
                // query's commit landed: it took the lease after that
                // commit, but read the messages as they were before it.
                // A statement of its own reads them as committed. (On an
                // error the caller gives the lease back.)
                Self::messages(&client, session_id, start, count).await?
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
        let (renewal, lost) = self.renew(session_id, token, sent + self.lease_ttl);
        let held =
            kept::Held { token, version, count, born, agent: session.agent.clone(), owner: owner.map(str::to_owned) };
        let holder = PgLease { store: self.clone(), id: session_id.to_owned(), held, created: create, renewal };
        Ok(Some(Lease::new(session, create, Arc::new(holder), lost)))
    }

    /// A lease this replica kept from the session's last query (see
    /// `kept`): no statement, unless the history must be read (this
    /// replica's cache no longer holds it). Err: the lease is given back.
    pub(super) async fn kept_lease(
        &self,
        session_id: &str,
        entry: kept::Entry,
        deadline: Instant,
    ) -> Result<Lease, StoreError> {
        let known = self
            .cache
            .as_ref()
            .and_then(|c| c.get(session_id))
            .filter(|k| k.born == entry.held.born && k.messages.len() == entry.held.count);
        let messages = match known {
            Some(known) => {
                self.reads_kept.fetch_add(1, Ordering::Relaxed);
                known.messages.as_ref().clone()
            }
            None => {
                // Nobody else can commit while the lease is kept: the
                // history is the first `count` messages.
                let count = clamp(entry.held.count);
                let read = async {
                    let client = self.conn("read").await?;
                    Self::messages(&client, session_id, 0, count).await
                };
                // Boxed: a kept lease found in the cache never carries it.
                match Box::pin(self.polled(bounded(deadline, "read", StoreError::Deadline, read))).await {
                    Ok(messages) => {
                        self.reads_whole.fetch_add(1, Ordering::Relaxed);
                        if let Some(cache) = &self.cache {
                            cache.put(session_id, entry.held.born, &messages);
                        }
                        messages
                    }
                    Err(e) => {
                        let give_back = self.give_back_later(session_id.to_owned(), entry.held.token, false);
                        let _ = tokio::time::timeout_at(deadline, give_back).await;
                        return Err(e);
                    }
                }
            }
        };
        let (renewal, lost) = self.renew(session_id, entry.held.token, entry.held_until);
        let session = StoredSession { agent: entry.held.agent.clone(), messages };
        let holder =
            PgLease { store: self.clone(), id: session_id.to_owned(), held: entry.held, created: false, renewal };
        Ok(Lease::new(session, false, Arc::new(holder), lost))
    }

    /// Who holds session `id`'s lease, when taking it (or deleting the
    /// session: `what`) failed; a lease another replica keeps is asked for
    /// (`lease_wanted`). The session is missing when not `owner`'s (if set)
    /// or idle past `idle_s` (if set).
    pub(super) async fn holder(
        &self,
        what: &'static str,
        client: &Conn<'_>,
        session_id: &str,
        owner: Option<&str>,
        idle_s: Option<f64>,
    ) -> Result<Holder, StoreError> {
        let row = client
            .maybe_row(
                "WITH s AS (
                     SELECT lease_token IS NOT NULL AND lease_expires >= now() AS held, lease_kept AS kept
                     FROM lattice_sessions
                     WHERE id = $1 AND ($2::text IS NULL OR owner = $2)
                       AND ($3::float8 IS NULL OR touched_at > now() - $3 * interval '1 second')
                 ), asked AS (
                     UPDATE lattice_sessions SET lease_wanted = true
                     WHERE id = $1 AND lease_kept AND NOT lease_wanted AND lease_token IS NOT NULL
                       AND EXISTS (SELECT 1 FROM s WHERE held AND kept)
                     RETURNING 1
                 )
                 SELECT held, kept FROM s",
                &[(&session_id, Type::TEXT), (&owner, Type::TEXT), (&idle_s, Type::FLOAT8)],
            )
            .await
            .map_err(db(what))?;
        let Some(row) = row else { return Ok(Holder::Missing) };
        let (held, kept): (bool, bool) = (row.try_get(0).map_err(db(what))?, row.try_get(1).map_err(db(what))?);
        Ok(match (held, kept) {
            (false, _) => Holder::Free,
            (true, false) => Holder::Busy,
            (true, true) => Holder::Kept,
        })
    }
}

/// Who holds a session's lease (see [`PostgresStore::holder`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holder {
    /// No such session (of this owner).
    Missing,
    /// Nobody (released just now).
    Free,
    /// A running query.
    Busy,
    /// A replica keeps it between queries, and was asked for it.
    Kept,
}
