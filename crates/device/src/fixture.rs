//! The fixture backend: serves an inventory held in memory (built in code or read from JSON).
//!
//! Used by unit tests and by `discover --fixture`-style tooling. The inventory can be replaced
//! at runtime ([`FixtureInventory::set`]) so tests can exercise rediscovery, and a failure can
//! be injected ([`FixtureInventory::fail`]) to exercise error paths.

use std::sync::Mutex;

use crate::{DeviceError, GpuInventory, Inventory};

/// An in-memory [`GpuInventory`].
#[derive(Debug)]
pub struct FixtureInventory {
    state: Mutex<Result<Inventory, String>>,
}

impl FixtureInventory {
    /// Serves `inventory`.
    pub fn new(inventory: Inventory) -> Self {
        Self {
            state: Mutex::new(Ok(inventory)),
        }
    }

    /// Parses an inventory from JSON (the camelCase form `discover --output json` prints under
    /// `inventory`).
    pub fn from_json(json: &str) -> Result<Self, DeviceError> {
        Self::from_json_named(json, "<inline>")
    }

    /// Parses an inventory from JSON read from `source` (a file name, for the error message).
    pub fn from_json_named(json: &str, source: &str) -> Result<Self, DeviceError> {
        let inventory = serde_json::from_str(json).map_err(|e| DeviceError::Fixture {
            path: source.into(),
            reason: e.to_string(),
        })?;
        Ok(Self::new(inventory))
    }

    /// Replaces the inventory served from now on (and clears an injected failure).
    pub fn set(&self, inventory: Inventory) {
        *self.lock() = Ok(inventory);
    }

    /// Makes every discovery fail with `reason` until [`FixtureInventory::set`] is called.
    pub fn fail(&self, reason: &str) {
        *self.lock() = Err(reason.to_string());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Result<Inventory, String>> {
        // A panic while holding the lock cannot leave the plain data half-written.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl GpuInventory for FixtureInventory {
    fn discover(&self) -> Result<Inventory, DeviceError> {
        self.lock().clone().map_err(|reason| DeviceError::Fixture {
            path: "<injected>".into(),
            reason,
        })
    }

    /// Compares in place, without the copy a discovery makes.
    fn still_current(&self, known: &Inventory, names: &[&str]) -> Result<bool, DeviceError> {
        match &*self.lock() {
            Ok(now) => Ok(names
                .iter()
                .all(|name| crate::same_device(known, now, name))),
            Err(reason) => Err(DeviceError::Fixture {
                path: "<injected>".into(),
                reason: reason.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv() -> Inventory {
        crate::testing::inventory([])
    }

    #[test]
    fn serves_replaces_and_fails() {
        let f = FixtureInventory::new(inv());
        assert_eq!(f.discover().unwrap(), inv());
        f.fail("boom");
        assert!(f.discover().unwrap_err().to_string().contains("boom"));
        let mut other = inv();
        other.driver_version = "570.1.2".into();
        f.set(other.clone());
        assert_eq!(f.discover().unwrap(), other);
    }

    #[test]
    fn still_current_compares_only_the_named_devices() {
        use crate::testing::{a100, inventory, mig_1g5gb, t4};
        let known = inventory([
            a100(0).mig(mig_1g5gb(0)).mig(mig_1g5gb(1)).build(),
            t4(1).build(),
        ]);
        let f = FixtureInventory::new(known.clone());
        let mig0 = known.gpus[0].mig_devices[0].device_name(&known.gpus[0]);
        assert!(f.still_current(&known, &[&mig0, "gpu-1"]).unwrap());
        assert!(f.still_current(&known, &[]).unwrap());
        assert!(
            !f.still_current(&known, &["gpu-9"]).unwrap(),
            "unknown name"
        );
        // The T4 is replaced by another board under the same name.
        let mut other = known.clone();
        other.gpus[1].uuid = "GPU-00000000-0000-0000-0000-0000000000ff".into();
        f.set(other.clone());
        assert!(!f.still_current(&known, &["gpu-1"]).unwrap());
        // Lost, or a failing backend.
        let mut lost = known.clone();
        lost.gpus.truncate(1);
        lost.lost_gpus = vec![1];
        f.set(lost);
        assert!(!f.still_current(&known, &["gpu-1"]).unwrap());
        f.fail("unloaded");
        assert!(f.still_current(&known, &["gpu-1"]).is_err());
    }

    #[test]
    fn json_round_trip_and_errors_name_the_file() {
        let json = serde_json::to_string(&inv()).unwrap();
        assert_eq!(
            FixtureInventory::from_json(&json)
                .unwrap()
                .discover()
                .unwrap(),
            inv()
        );
        assert_eq!(
            FixtureInventory::from_json_named(&json, "inv.json")
                .unwrap()
                .discover()
                .unwrap(),
            inv()
        );
        let err = FixtureInventory::from_json_named("{", "inv.json").unwrap_err();
        assert!(err.to_string().contains("inv.json"), "{err}");
    }
}
