//! The handle table: `nvmlDevice_t`, `nvmlGpuInstance_t` and `nvmlComputeInstance_t` values
//! are addresses of leaked boxes holding a [`Key`], one per key for the life of the process.
//!
//! Invariant: a handle is only ever looked up by address in the table, never dereferenced,
//! so a foreign or stale pointer is an `INVALID_ARGUMENT`, not undefined behaviour. This is
//! why this module needs no `unsafe`.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard};

use super::{Handle, NvmlReturn, ret};

/// What a handle points at. GPU indices are NVML indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Key {
    /// A full GPU: (GPU).
    Gpu(u32),
    /// A MIG device: (GPU, GI ID, CI ID).
    Mig(u32, u32, u32),
    /// A GPU instance: (GPU, GI ID).
    Gi(u32, u32),
    /// A compute instance: (GPU, GI ID, CI ID).
    Ci(u32, u32, u32),
}

/// Both directions of the handle table.
#[derive(Default)]
struct Registry {
    by_key: HashMap<Key, usize>,
    by_addr: HashMap<usize, Key>,
}

static HANDLES: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

/// Locks `m`, ignoring poisoning.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a guarded call cannot leave these maps half-updated in a way that
    // matters (inserts are paired), so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The handle of `key`, created on first use.
pub(super) fn handle(key: Key) -> Handle {
    let mut reg = lock(&HANDLES);
    if let Some(addr) = reg.by_key.get(&key) {
        return *addr as Handle;
    }
    // Leaked on purpose: handles must stay valid for the life of the process.
    let addr = Box::into_raw(Box::new(key)) as usize;
    reg.by_key.insert(key, addr);
    reg.by_addr.insert(addr, key);
    addr as Handle
}

/// What handle `h` names; `INVALID_ARGUMENT` for a pointer this library did not hand out.
pub(super) fn key_of(h: Handle) -> Result<Key, NvmlReturn> {
    lock(&HANDLES)
        .by_addr
        .get(&(h as usize))
        .copied()
        .ok_or(ret::INVALID_ARGUMENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_pointers_are_not_handles() {
        let x = 5u64;
        assert_eq!(
            key_of(&x as *const u64 as Handle),
            Err(ret::INVALID_ARGUMENT)
        );
        let h = handle(Key::Gpu(3));
        assert_eq!(key_of(h), Ok(Key::Gpu(3)));
        assert_eq!(handle(Key::Gpu(3)), h, "handles are stable");
    }
}
