//! Per-claim locks: at most one prepare or unprepare runs for a claim UID at a time.
//!
//! The problem: a map from UID to an async mutex grows with every claim ever seen unless
//! entries are removed, and removing an entry while an operation waits on (or holds) the old
//! mutex lets the next caller create a second mutex for the same UID, so two operations run
//! on one claim at once.
//!
//! The fix: each entry counts its users, the operations that hold or wait for its mutex. A
//! user registers under the map lock before it waits ([`ClaimLocks::join`]) and leaves when
//! its [`ClaimLockUser`] is dropped: after the operation, or when a waiting operation is
//! cancelled (the kubelet gave up on the call). The entry is removed when the last user
//! leaves, under the map lock, so a new caller either joins the existing mutex or finds none
//! and creates one that no one else can hold. The map therefore holds exactly the claims
//! with an operation in progress or queued, whatever the outcome of each operation.
//!
//! Rejected: `Arc::strong_count` on a shared mutex. It works when every clone belongs to a
//! user, but a cancelled `lock_owned` future drops its clone at a point the owner does not
//! control, so the count could keep an entry alive; an explicit count has no such gap.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

type ClaimMutex = Arc<tokio::sync::Mutex<()>>;

struct Entry {
    mutex: ClaimMutex,
    users: usize,
}

/// The per-UID locks of the claims with operations in progress or queued.
#[derive(Default)]
pub struct ClaimLocks {
    map: Mutex<HashMap<String, Entry>>,
}

impl ClaimLocks {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // Plain counters behind a short lock: a panic elsewhere leaves them consistent.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a user of `uid`'s lock; call [`ClaimLockUser::lock`] to wait for it.
    pub fn join(&self, uid: &str) -> ClaimLockUser<'_> {
        let mut map = self.map();
        let entry = map.entry(uid.to_owned()).or_insert_with(|| Entry {
            mutex: ClaimMutex::default(),
            users: 0,
        });
        entry.users += 1;
        ClaimLockUser {
            locks: self,
            uid: uid.to_owned(),
            mutex: entry.mutex.clone(),
        }
    }

    /// Number of claims whose lock is held or awaited.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// True when no claim's lock is held or awaited.
    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }
}

/// One operation's registration on a claim's lock; leaving (drop) removes the lock when no
/// one else uses it. Drop the guard from [`ClaimLockUser::lock`] first (declare it after).
pub struct ClaimLockUser<'a> {
    locks: &'a ClaimLocks,
    uid: String,
    mutex: ClaimMutex,
}

impl ClaimLockUser<'_> {
    /// Waits for the claim's lock.
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.mutex.lock().await
    }

    /// The claim's lock if it is free now.
    pub fn try_lock(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        self.mutex.try_lock().ok()
    }
}

impl Drop for ClaimLockUser<'_> {
    fn drop(&mut self) {
        let mut map = self.locks.map();
        if let Some(entry) = map.get_mut(&self.uid) {
            entry.users = entry.users.saturating_sub(1);
            if entry.users == 0 {
                map.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lock_lives_while_someone_holds_or_waits_for_it() {
        let locks = ClaimLocks::default();
        let a = locks.join("a");
        let held = a.lock().await;
        let b = locks.join("a");
        assert!(Arc::ptr_eq(&a.mutex, &b.mutex), "one mutex per claim");
        assert!(b.try_lock().is_none());
        drop(held);
        drop(a);
        // b still waits: the entry stays, and a newcomer shares b's mutex.
        let c = locks.join("a");
        assert!(Arc::ptr_eq(&b.mutex, &c.mutex));
        let _held = b.lock().await;
        assert!(c.try_lock().is_none(), "c waits for b");
        drop(_held);
        drop(b);
        drop(c);
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn a_cancelled_waiter_leaves_no_lock_behind() {
        let locks = ClaimLocks::default();
        let a = locks.join("a");
        let held = a.lock().await;
        let waiter = async {
            let user = locks.join("a");
            let _guard = user.lock().await;
        };
        // Polled once (it queues), then dropped as a cancelled gRPC call would be.
        assert!(futures::FutureExt::now_or_never(waiter).is_none());
        assert_eq!(locks.len(), 1);
        drop(held);
        drop(a);
        assert!(locks.is_empty());
    }
}
