//! Telling waiters that the state changed: a change counter in the state's lock file, which
//! every writer increments after it replaced the state, and a futex wait on that counter.
//!
//! The problem: NVML's `nvmlEventSetWait` sleeps until an event arrives. A real driver
//! blocks in the kernel; the simulator's events arrive through the state file, written by
//! other processes (the tools, a test, another process's NVML). Polling the file costs every
//! waiting process a wake-up and a few `stat`s ten times a second, which on a machine with a
//! thousand simulated nodes is a thousand plugins' health threads spinning.
//!
//! How: the lock file `state.json.lock` is never replaced (only the state file is, by a
//! rename), so every process of the host, containers included (they see the node's
//! `etc/gpu-sim` through a bind mount), maps the same page of it. Its first four bytes are a
//! counter. A writer, holding the exclusive lock, increments it and wakes the futex on it
//! (`FUTEX_WAKE` without the private flag: the kernel keys a shared futex by file and offset,
//! so waiters in other processes and mount namespaces are woken). A waiter reads the counter
//! before it reads the state, then sleeps with `FUTEX_WAIT` on the value it read: a change
//! between the two returns at once, so no wake-up is lost. A waiter maps the file read-only
//! (containers mount the folder read-only; the kernel allows `FUTEX_WAIT` there).
//!
//! Invariants: the lock file is never truncated or replaced (writers only lengthen it to hold
//! the counter; a mapping past a shortened file's end would fault); the counter only grows
//! (wrapping at 2^32, which a waiter cannot miss: it compares for inequality); a file shorter than the counter (a lock file of an older version,
//! or one no writer has touched yet) gives waiters no counter, and they fall back to sleeping
//! for their poll interval; so does a writer that does not count (the harness's own edits of
//! the file), which is why waiters still re-read the state every second or so.

// `mmap`/`futex` on the lock file: raw C calls, each block with its SAFETY comment.
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Bytes of the lock file the counter takes.
const COUNTER_LEN: u64 = 4;

/// A shared mapping of the counter at the start of a lock file.
pub struct ChangeCounter {
    addr: *mut libc::c_void,
}

// SAFETY: the mapping is plain shared memory owned by this value; every access goes through
// `AtomicU32`, which is safe from any thread.
unsafe impl Send for ChangeCounter {}
// SAFETY: as above.
unsafe impl Sync for ChangeCounter {}

/// What [`ChangeCounter::wait`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// The counter differs from the value given (a writer counted a change), or a wake-up
    /// arrived.
    Changed,
    /// The time ran out with the counter unchanged.
    TimedOut,
}

impl ChangeCounter {
    /// Maps the counter of `lock` for writing, making the file long enough first; `lock`
    /// must be open for writing.
    pub fn for_writer(lock: &File) -> std::io::Result<ChangeCounter> {
        if lock.metadata()?.len() < COUNTER_LEN {
            lock.set_len(COUNTER_LEN)?;
        }
        ChangeCounter::map(lock, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// Maps the counter of `lock` for waiting, or `None` when the file holds no counter yet
    /// (no writer of this version has written the state since the file was made).
    pub fn for_waiter(lock: &File) -> Option<ChangeCounter> {
        if lock.metadata().ok()?.len() < COUNTER_LEN {
            return None;
        }
        ChangeCounter::map(lock, libc::PROT_READ).ok()
    }

    fn map(file: &File, prot: libc::c_int) -> std::io::Result<ChangeCounter> {
        // SAFETY: a fresh shared mapping of `COUNTER_LEN` bytes of an open file, at an
        // address the kernel picks; nothing else in this process refers to it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                COUNTER_LEN as usize,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(ChangeCounter { addr })
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: `addr` is a live, page-aligned mapping of at least four bytes (the file is
        // at least that long), valid until `drop`, and only accessed atomically.
        unsafe { AtomicU32::from_ptr(self.addr.cast()) }
    }

    /// The counter now.
    pub fn value(&self) -> u32 {
        self.word().load(Ordering::SeqCst)
    }

    /// Counts one change and wakes every waiter of every process. Only for a mapping made
    /// by [`Self::for_writer`], by a process holding the state's exclusive lock.
    pub fn count(&self) {
        self.word().fetch_add(1, Ordering::SeqCst);
        // SAFETY: FUTEX_WAKE on a live, aligned word of this mapping; the kernel reads no
        // memory of ours beyond the address.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.addr,
                libc::FUTEX_WAKE,
                libc::c_int::MAX,
                std::ptr::null::<libc::timespec>(),
            );
        }
    }

    /// Sleeps until the counter is no longer `seen` or `timeout` passes. May return
    /// [`Waited::Changed`] early (a signal, or the counter went back to `seen` after a wrap):
    /// callers check what they wait for and wait again.
    pub fn wait(&self, seen: u32, timeout: Duration) -> Waited {
        if self.value() != seen {
            return Waited::Changed;
        }
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: FUTEX_WAIT on a live, aligned word of this mapping, with a relative
        // timeout that lives for the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.addr,
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
            )
        };
        if rc == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT) {
            Waited::TimedOut
        } else {
            Waited::Changed
        }
    }
}

impl Drop for ChangeCounter {
    fn drop(&mut self) {
        // SAFETY: `addr` is the mapping made in `map`, unmapped once, here.
        unsafe {
            libc::munmap(self.addr, COUNTER_LEN as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn lock_file(dir: &std::path::Path) -> File {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(dir.join("state.json.lock"))
            .expect("lock file")
    }

    #[test]
    fn a_waiter_is_woken_by_a_count_through_another_open_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let writer = ChangeCounter::for_writer(&lock_file(dir.path())).expect("map");
        let reader = File::open(dir.path().join("state.json.lock")).expect("open read-only");
        let waiter = ChangeCounter::for_waiter(&reader).expect("a counter");
        let seen = waiter.value();
        let t = Instant::now();
        let counting = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            writer.count();
        });
        // Without the wake-up this would sleep the whole minute.
        let mut waited = waiter.wait(seen, Duration::from_secs(60));
        while waited == Waited::Changed && waiter.value() == seen {
            waited = waiter.wait(seen, Duration::from_secs(60));
        }
        counting.join().expect("writer");
        assert_eq!(waited, Waited::Changed);
        assert_eq!(waiter.value(), seen.wrapping_add(1));
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    }

    #[test]
    fn an_unchanged_counter_times_out_and_a_changed_one_returns_at_once() {
        let dir = tempfile::tempdir().expect("tmp");
        let writer = ChangeCounter::for_writer(&lock_file(dir.path())).expect("map");
        let waiter = ChangeCounter::for_waiter(&lock_file(dir.path())).expect("a counter");
        let seen = waiter.value();
        assert_eq!(
            waiter.wait(seen, Duration::from_millis(20)),
            Waited::TimedOut
        );
        writer.count();
        let t = Instant::now();
        assert_eq!(waiter.wait(seen, Duration::from_secs(60)), Waited::Changed);
        assert!(t.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn a_lock_file_without_a_counter_gives_waiters_none() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = lock_file(dir.path());
        assert!(ChangeCounter::for_waiter(&file).is_none());
        ChangeCounter::for_writer(&file).expect("map");
        assert_eq!(file.metadata().expect("stat").len(), COUNTER_LEN);
        assert!(ChangeCounter::for_waiter(&file).is_some());
    }
}
