//! The lease contract on the memory store, on tokio's paused clock.

use std::time::Duration;

use super::*;

fn text(t: &str) -> Message {
    Message::user_text(t)
}

/// One lease at a time; the conversation changes only on commit, which
/// appends; a dropped lease changes nothing.
#[tokio::test(start_paused = true)]
async fn a_session_has_one_lease_at_a_time_and_changes_only_on_commit() {
    let store = MemoryStore::default();
    let lease = store.acquire("s", "a", true).await.unwrap();
    assert!(lease.created);
    assert_eq!(store.acquire("s", "a", false).await.unwrap_err(), StoreError::Busy);
    assert_eq!(store.delete("s").await.unwrap_err(), StoreError::Busy);
    lease.commit(vec![text("hi")]).await.unwrap();
    let lease = store.acquire("s", "a", false).await.unwrap();
    assert_eq!(lease.session.messages.len(), 1);
    drop(lease); // no commit: unchanged
    let lease = store.acquire("s", "a", false).await.unwrap();
    lease.commit(vec![text("again")]).await.unwrap();
    assert_eq!(store.get("s").await.unwrap().messages, vec![text("hi"), text("again")]);
    store.delete("s").await.unwrap();
    assert_eq!(store.get("s").await.unwrap_err(), StoreError::NotFound);
}

/// A first query that fails leaves no session behind.
#[tokio::test(start_paused = true)]
async fn a_failed_first_query_leaves_no_session() {
    let store = MemoryStore::default();
    drop(store.acquire("new", "a", true).await.unwrap());
    assert_eq!(store.get("new").await.unwrap_err(), StoreError::NotFound);
}

/// Sessions idle past the limit are gone; a leased one is kept however
/// long its query runs.
#[tokio::test(start_paused = true)]
async fn idle_sessions_expire() {
    let store = MemoryStore::new(10, Duration::from_secs(60));
    store.acquire("old", "a", true).await.unwrap().commit(vec![text("x")]).await.unwrap();
    let running = store.acquire("busy", "a", true).await.unwrap();
    tokio::time::advance(Duration::from_secs(59)).await;
    assert!(store.get("old").await.is_ok(), "read: touched again");
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(store.get("old").await.unwrap_err(), StoreError::NotFound);
    running.commit(vec![text("y")]).await.unwrap();
    assert_eq!(store.get("busy").await.unwrap().messages.len(), 1);
}

/// Past the cap a new session is refused clearly; expired ones make room.
#[tokio::test(start_paused = true)]
async fn the_session_cap_is_enforced() {
    let store = MemoryStore::new(2, Duration::from_secs(60));
    for id in ["a", "b"] {
        store.acquire(id, "x", true).await.unwrap().commit(vec![text(id)]).await.unwrap();
    }
    assert_eq!(store.acquire("c", "x", true).await.unwrap_err(), StoreError::Full(2));
    assert!(store.acquire("a", "x", false).await.is_ok(), "existing sessions go on");
    tokio::time::advance(Duration::from_secs(61)).await;
    assert!(store.acquire("c", "x", true).await.is_ok());
}

/// Session ids carry 128 random bits: 32 hex digits, never repeated.
#[test]
fn session_ids_are_128_random_bits() {
    let ids: std::collections::HashSet<String> = (0..1000).map(|_| new_id()).collect();
    assert_eq!(ids.len(), 1000);
    for id in &ids {
        assert_eq!(id.len(), 32, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()), "{id}");
    }
    // Every bit position takes both values across the sample.
    let (mut ones, mut zeros) = (0u128, 0u128);
    for id in &ids {
        let v = u128::from_str_radix(id, 16).unwrap();
        ones |= v;
        zeros |= !v;
    }
    assert_eq!((ones, zeros), (u128::MAX, u128::MAX));
}
