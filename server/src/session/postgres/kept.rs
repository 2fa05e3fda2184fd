//! Leases a replica keeps between a session's queries (`[sessions]
//! keep_lease_ms`).
//!
//! A commit may keep its lease instead of releasing it: the row keeps a
//! token (a fresh one, so that each commit's token stays its own), marked
//! `lease_kept`. The session's next query on this replica then takes no
//! lease statement: the lease is known held, and the history is what this
//! replica committed. A query costs one write instead of two.
//!
//! Nobody else may take a kept lease: that is what makes using it without
//! asking the database sound. A replica that wants the session instead (a
//! client that moved, a delete) sets `lease_wanted` on the row and tries
//! again; the keeper (this module's task) sees the flag within a
//! [`POLL`] and gives the lease back, unless a query is using it, whose
//! commit then releases instead of keeping. A kept lease unused for
//! `keep_lease_ms` is given back, and every kept lease is given back when
//! the replica shuts down. The keeper renews kept leases as the renewer
//! does running queries'; a replica that crashes leaves them to expire
//! after `lease_ttl_ms`, as it leaves the lease of a query it was running.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use tokio::time::Instant;

use super::backoff::Backoff;

/// How often the keeper looks for leases wanted elsewhere, due for renewal
/// or unused too long.
pub(super) const POLL: Duration = Duration::from_millis(50);

/// How long a query (or a delete) waits for another replica to hand over a
/// lease it keeps, at most.
pub(super) const HANDOVER_WAIT: Duration = Duration::from_millis(1000);

/// Waiting for another replica to hand over a lease it keeps: pauses from
/// 2 ms, doubling up to [`POLL`], for [`HANDOVER_WAIT`] in all at most.
pub(super) fn handover() -> Backoff {
    Backoff::new(Instant::now() + HANDOVER_WAIT, Duration::from_millis(2), POLL)
}

/// What the holder of a session's lease knows of it, while a query uses
/// the lease and while it is kept.
#[derive(Debug, Clone)]
pub(super) struct Held {
    pub(super) token: uuid::Uuid,
    /// The session's version and message count when the lease was taken
    /// (or its last commit kept it).
    pub(super) version: i64,
    pub(super) count: usize,
    /// The session row's creation time (the history cache's key).
    pub(super) born: i64,
    pub(super) agent: String,
    /// The owner the lease was taken for (none with authentication off).
    pub(super) owner: Option<String>,
}

/// A kept lease, as its replica knows it.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) held: Held,
    /// Until when the lease is known held: `lease_ttl` after the start of
    /// the statement that last set its expiry.
    pub(super) held_until: Instant,
    /// When its last query ended.
    pub(super) idle_since: Instant,
    /// Whether a query is using it.
    pub(super) in_use: bool,
}

/// What a query finds kept for its session.
#[derive(Debug)]
pub(super) enum Found {
    /// A lease it may use, marked in use.
    Lease(Entry),
    /// A query of this replica is using it: the session is busy.
    InUse,
    /// A lease kept too close to its expiry to use (the database did not
    /// renew it): no longer kept; give it back, then take a lease anew.
    Stale(Entry),
    /// Nothing kept.
    Nothing,
}

/// What the keeper has to do now.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Due {
    /// Unused for `keep` (no longer kept): give them back.
    pub(super) expired: Vec<(String, uuid::Uuid)>,
    /// Unused and due for renewal.
    pub(super) renew: Vec<(String, uuid::Uuid)>,
    /// Unused: to ask whether another replica wants them.
    pub(super) idle: Vec<(String, uuid::Uuid)>,
    /// In use: another replica that asks for one is told the session is
    /// busy.
    pub(super) in_use: Vec<(String, uuid::Uuid)>,
}

/// The leases this replica keeps, by session id.
#[derive(Debug)]
pub(super) struct Kept {
    entries: Mutex<HashMap<String, Entry>>,
    /// How long an unused lease is kept.
    keep: Duration,
    /// The lease's time to live.
    ttl: Duration,
}

impl Kept {
    pub(super) fn new(keep: Duration, ttl: Duration) -> Self {
        Self { entries: Mutex::default(), keep, ttl }
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // Every change below is one step on the map: a panic elsewhere
        // leaves no half-made entry.
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lease kept for session `id`, for a query of `owner`. A lease
    /// with less than a third of its time to live left is stale: the
    /// keeper renews at a third, so the database is not answering.
    pub(super) fn take(&self, id: &str, owner: Option<&str>) -> Found {
        let mut entries = self.entries();
        let Some(entry) = entries.get_mut(id) else { return Found::Nothing };
        if owner.is_some() && entry.held.owner.as_deref() != owner {
            // Not this principal's session: the database says so.
            return Found::Nothing;
        }
        if entry.in_use {
            return Found::InUse;
        }
        if entry.held_until <= Instant::now() + self.ttl / 3 {
            return entries.remove(id).map_or(Found::Nothing, Found::Stale);
        }
        entry.in_use = true;
        Found::Lease(entry.clone())
    }

    /// Keeps `entry` for session `id`, unused from now.
    pub(super) fn keep(&self, id: &str, mut entry: Entry) {
        entry.in_use = false;
        entry.idle_since = Instant::now();
        self.entries().insert(id.to_owned(), entry);
    }

    /// No longer keeps the lease `token` of session `id`.
    pub(super) fn forget(&self, id: &str, token: uuid::Uuid) {
        let mut entries = self.entries();
        if entries.get(id).is_some_and(|e| e.held.token == token) {
            entries.remove(id);
        }
    }

    /// Stops keeping every lease no query uses, and returns them (to give
    /// back).
    pub(super) fn drain(&self) -> Vec<(String, uuid::Uuid)> {
        let mut entries = self.entries();
        let idle: Vec<String> = entries.iter().filter(|(_, e)| !e.in_use).map(|(id, _)| id.clone()).collect();
        idle.into_iter().filter_map(|id| entries.remove(&id).map(|e| (id, e.held.token))).collect()
    }

    /// Stops keeping the lease `token` of session `id` if no query uses it
    /// (another replica wants it). True: give it back.
    pub(super) fn hand_over(&self, id: &str, token: uuid::Uuid) -> bool {
        let mut entries = self.entries();
        if entries.get(id).is_some_and(|e| e.held.token == token && !e.in_use) {
            entries.remove(id);
            return true;
        }
        false
    }

    /// The lease `token` of session `id` was renewed by a statement that
    /// started at `started`.
    pub(super) fn renewed(&self, id: &str, token: uuid::Uuid, started: Instant) {
        if let Some(entry) = self.entries().get_mut(id).filter(|e| e.held.token == token) {
            entry.held_until = entry.held_until.max(started + self.ttl);
        }
    }

    /// What is due now: leases unused for `keep` leave the map.
    pub(super) fn due(&self) -> Due {
        let now = Instant::now();
        let mut entries = self.entries();
        let mut due = Due::default();
        entries.retain(|id, e| {
            if e.in_use {
                due.in_use.push((id.clone(), e.held.token));
                return true;
            }
            if now >= e.idle_since + self.keep {
                due.expired.push((id.clone(), e.held.token));
                return false;
            }
            if e.held_until <= now + self.ttl * 2 / 3 {
                due.renew.push((id.clone(), e.held.token));
            }
            due.idle.push((id.clone(), e.held.token));
            true
        });
        due
    }

    /// How many leases are kept (in use or not).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(15);
    const KEEP: Duration = Duration::from_secs(30);

    fn entry(token: uuid::Uuid, owner: &str) -> Entry {
        let now = Instant::now();
        Entry {
            held: Held { token, version: 3, count: 6, born: 1, agent: "a".into(), owner: Some(owner.into()) },
            held_until: now + TTL,
            idle_since: now,
            in_use: false,
        }
    }

    /// A kept lease serves one query at a time, of its owner only, and
    /// comes back for the next when the query keeps it again.
    #[tokio::test(start_paused = true)]
    async fn a_kept_lease_serves_one_query_at_a_time() {
        let kept = Kept::new(KEEP, TTL);
        let token = uuid::Uuid::new_v4();
        kept.keep("s", entry(token, "alice"));
        assert!(matches!(kept.take("s", Some("bob")), Found::Nothing));
        let Found::Lease(e) = kept.take("s", Some("alice")) else { panic!("not kept") };
        assert_eq!((e.held.token, e.held.version, e.held.count), (token, 3, 6));
        assert!(matches!(kept.take("s", None), Found::InUse));
        // In use: not handed over, not due.
        assert!(!kept.hand_over("s", token));
        assert_eq!(kept.due(), Due { in_use: vec![("s".to_owned(), token)], ..Due::default() });
        kept.keep("s", e);
        assert!(matches!(kept.take("s", None), Found::Lease(_)));
    }

    /// Unused leases are renewed at a third of their time to live, given
    /// back after `keep`, and one the database did not renew in time is
    /// not used.
    #[tokio::test(start_paused = true)]
    async fn unused_leases_are_renewed_then_given_back() {
        let kept = Kept::new(KEEP, TTL);
        let token = uuid::Uuid::new_v4();
        kept.keep("s", entry(token, ""));
        let idle = vec![("s".to_owned(), token)];
        assert_eq!(kept.due(), Due { idle: idle.clone(), ..Due::default() });
        tokio::time::advance(TTL / 3).await;
        assert_eq!(kept.due(), Due { renew: idle.clone(), idle: idle.clone(), ..Due::default() });
        kept.renewed("s", token, Instant::now());
        assert_eq!(kept.due(), Due { idle: idle.clone(), ..Due::default() });
        // Not renewed since: stale once less than a third is left.
        tokio::time::advance(TTL * 2 / 3).await;
        let Found::Stale(e) = kept.take("s", None) else { panic!("not stale") };
        assert_eq!(e.held.token, token);
        assert_eq!(kept.len(), 0);
        // Unused for `keep`: given back.
        kept.keep("s", Entry { held_until: Instant::now() + TTL, ..entry(token, "") });
        tokio::time::advance(KEEP).await;
        assert_eq!(kept.due(), Due { expired: idle, ..Due::default() });
        assert_eq!(kept.len(), 0);
    }

    /// A handover is asked about again soon at first, then every poll of
    /// the keeper, and waited for a second at most.
    #[tokio::test(start_paused = true)]
    async fn a_handover_is_waited_for_a_second_at_most() {
        let start = Instant::now();
        let mut handover = handover();
        let mut asked = vec![Duration::ZERO];
        while handover.pause().await {
            asked.push(start.elapsed());
        }
        let ms = |n: u64| Duration::from_millis(n);
        assert_eq!(asked[..7], [ms(0), ms(2), ms(6), ms(14), ms(30), ms(62), ms(112)]);
        let last = asked.last().copied().unwrap_or_default();
        assert!(last <= HANDOVER_WAIT && last + POLL >= HANDOVER_WAIT, "last asked at {last:?}");
        assert_eq!(start.elapsed(), last, "gave up without waiting");
    }

    /// Handing over and forgetting act on the lease named, not on a newer
    /// one kept for the same session.
    #[tokio::test(start_paused = true)]
    async fn only_the_lease_named_is_handed_over() {
        let kept = Kept::new(KEEP, TTL);
        let (old, new) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        kept.keep("s", entry(new, ""));
        assert!(!kept.hand_over("s", old));
        kept.forget("s", old);
        assert_eq!(kept.len(), 1);
        assert!(kept.hand_over("s", new));
        assert_eq!(kept.len(), 0);
        kept.keep("s", entry(new, ""));
        kept.keep("t", entry(old, ""));
        let Found::Lease(_) = kept.take("t", None) else { panic!("not kept") };
        assert_eq!(kept.drain(), vec![("s".to_owned(), new)]);
        assert_eq!(kept.len(), 1);
    }
}
