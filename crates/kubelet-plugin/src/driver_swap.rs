//! The NVIDIA driver upgraded in place under the running plugin (the GPU Operator restarts its
//! driver container with a new version; a host's package is upgraded and the module reloaded).
//!
//! The problem: the driver's files carry the version in their names
//! (`libnvidia-ml.so.<version>`, `libcuda.so.<version>`), so after the swap a library path
//! resolved at start names a file that is gone, the loader hands out the old library again for
//! that path while anything keeps it loaded, and CDI specs naming the old files would fail
//! every new container. Nothing told the plugin, and `/healthz` kept saying ok.
//!
//! What the plugin does:
//! - every NVML session (discovery, each MIG operation, the health watch) loads the library
//!   from a fresh lookup and no session is kept across claims, so the new driver is reached
//!   through its own file ([`gpu_dra_nvml::NvmlLibrary`]);
//! - [`follow`] checks every few seconds, for the cost of a few `stat`s, whether the library a
//!   session would load is still the same file, and rediscovers at once when it is not, and
//!   on every check while NVML cannot be reached; a discovery that finds another version has
//!   the CDI host files scanned again before prepares see it
//!   ([`crate::inventory::LiveInventory::on_driver_version`]), and its inventory wakes the
//!   publisher, which republishes the slices with the new `driverVersion`;
//! - the health watch ends its session when NVML goes away and opens a new one when the
//!   driver answers again ([`crate::health::watch`]);
//! - claims prepared before get their specs rewritten for the new files (same devices, same
//!   CDI IDs) by the cleanup pass a new version triggers, and by any prepare answered from the
//!   checkpoint ([`crate::driver`]'s `respec`): running containers keep the files they
//!   mounted, containers created afterwards (a restart, a new pod of a shared claim) start;
//! - [`NvmlLiveness`] makes `/healthz` fail while NVML has been out of reach for longer than a
//!   grace, so the kubelet's liveness probe restarts the container when the plugin cannot
//!   recover by itself (a driver root mount that went stale in its container, a swap that
//!   never completes). The grace (default 30 s) plus the chart's probe (3 failures 10 s apart)
//!   keep one slow swap or discovery from restarting it.
//!
//! Rejected: restarting the process on every version change (the kubelet's calls would fail
//! while it restarts, and an in-place recovery is what a failed probe would get anyway);
//! watching the driver root with inotify (a containerized root is a mount that is replaced as
//! a whole, which inotify on the old mount does not report).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::debug;

use crate::http::Liveness;
use crate::inventory::LiveInventory;

/// What identifies the driver a session would load now (the library file's path and
/// identity), or `None` when it cannot be told (no library, or an inventory fixture).
pub type DriverIdentity = Box<dyn Fn() -> Option<String> + Send + Sync>;

/// Rediscovers whenever `identity` changes, and on every check while NVML cannot be reached,
/// until `stop` turns true. Checks every `every`.
pub async fn follow(
    live: Arc<LiveInventory>,
    identity: DriverIdentity,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let identity: Arc<dyn Fn() -> Option<String> + Send + Sync> = Arc::from(identity);
    let probe = {
        let identity = identity.clone();
        move || {
            let identity = identity.clone();
            async move {
                tokio::task::spawn_blocking(move || identity())
                    .await
                    .ok()
                    .flatten()
            }
        }
    };
    let mut last = probe().await;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tick.tick() => {}
        }
        let now = probe().await;
        let changed = now != last;
        if changed || live.nvml_unreachable().is_some() {
            if changed {
                debug!(before = ?last, now = ?now, "the NVML library changed; rediscovering");
            }
            // Failures are recorded (and logged once) by the live inventory.
            let _ = live.rediscover().await;
        }
        last = now;
    }
}

/// `/healthz`: fails while NVML has been out of reach for longer than `grace`.
pub struct NvmlLiveness {
    live: Arc<LiveInventory>,
    grace: Duration,
}

impl NvmlLiveness {
    /// Fails `/healthz` once `live`'s discoveries have failed for NVML being out of reach for
    /// longer than `grace`.
    pub fn new(live: Arc<LiveInventory>, grace: Duration) -> Self {
        NvmlLiveness { live, grace }
    }
}

impl Liveness for NvmlLiveness {
    fn check(&self) -> Result<(), String> {
        match self.live.nvml_unreachable() {
            Some((for_, why)) if for_ > self.grace => Err(format!(
                "NVML cannot be reached for {}s (longer than the {}s grace): {why}",
                for_.as_secs(),
                self.grace.as_secs()
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_dra_core::health::HealthPolicy;
    use gpu_dra_device::testing::t4_inventory;
    use gpu_dra_device::{DeviceError, GpuInventory, Inventory};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An inventory that fails to initialise NVML while `down`, and counts discoveries.
    struct Swappable {
        inventory: Mutex<Inventory>,
        down: Mutex<bool>,
        discoveries: AtomicUsize,
    }

    impl GpuInventory for Swappable {
        fn discover(&self) -> Result<Inventory, DeviceError> {
            self.discoveries.fetch_add(1, Ordering::SeqCst);
            if *self.down.lock().expect("lock") {
                return Err(DeviceError::Init {
                    path: "libnvidia-ml.so.1 under /".into(),
                    reason: "no such library".into(),
                });
            }
            Ok(self.inventory.lock().expect("lock").clone())
        }
    }

    #[tokio::test]
    async fn a_changed_library_is_rediscovered_and_a_long_outage_fails_the_liveness_check() {
        let inv = t4_inventory(1);
        let backend = Arc::new(Swappable {
            inventory: Mutex::new(inv.clone()),
            down: Mutex::new(false),
            discoveries: AtomicUsize::new(0),
        });
        let live = LiveInventory::with_inventory(
            backend.clone(),
            inv.clone(),
            HealthPolicy::new("gpu.nvidia.com"),
        );
        let refreshed = Arc::new(Mutex::new(Vec::new()));
        live.on_driver_version({
            let refreshed = refreshed.clone();
            Arc::new(move |i: &Inventory| {
                refreshed
                    .lock()
                    .expect("lock")
                    .push(i.driver_version.clone())
            })
        });
        let library = Arc::new(Mutex::new(Some("libnvidia-ml.so.580.95.05".to_string())));
        let identity: DriverIdentity = {
            let library = library.clone();
            Box::new(move || library.lock().expect("lock").clone())
        };
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(follow(
            live.clone(),
            identity,
            Duration::from_millis(20),
            stop,
        ));
        let liveness = NvmlLiveness::new(live.clone(), Duration::from_millis(200));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            backend.discoveries.load(Ordering::SeqCst),
            0,
            "an unchanged library costs no discovery"
        );

        // The swap: the library is gone and NVML cannot be initialised.
        *backend.down.lock().expect("lock") = true;
        *library.lock().expect("lock") = None;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(backend.discoveries.load(Ordering::SeqCst) >= 2, "retried");
        assert!(liveness.check().is_ok(), "within the grace");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let why = liveness.check().expect_err("past the grace");
        assert!(
            why.starts_with("NVML cannot be reached for 0s (longer than the 0s grace): cannot initialise NVML from libnvidia-ml.so.1 under /"),
            "{why}"
        );
        assert_eq!(live.current().driver_version, inv.driver_version, "kept");

        // The new driver: found, listeners told before the inventory changes, liveness back.
        let mut new = inv.clone();
        new.driver_version = "590.44.01".into();
        *backend.inventory.lock().expect("lock") = new;
        *backend.down.lock().expect("lock") = false;
        *library.lock().expect("lock") = Some("libnvidia-ml.so.590.44.01".into());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(live.current().driver_version, "590.44.01");
        assert_eq!(*refreshed.lock().expect("lock"), ["590.44.01"]);
        assert!(liveness.check().is_ok());
        assert!(live.nvml_unreachable().is_none());
        stop_tx.send(true).expect("stop");
        task.await.expect("follow ends on stop");
    }
}
