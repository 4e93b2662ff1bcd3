//! Device health: the DRA health service (`v1alpha1.DRAResourceHealth`,
//! `NodeWatchResources`) and the task that feeds NVML's observations into the live inventory.
//!
//! The stream: the kubelet opens one per registered plugin instance and shows each device's
//! health in the status of the pods using it (`allocatedResourcesStatus`). Every response is a
//! full report of the node's devices. The kubelet turns a device it has not heard of for 30
//! seconds into `Unknown`, so the report is sent when the stream opens, whenever a device's
//! health changes, and every [`RESEND`] otherwise.
//!
//! Why serve it even without health events: the kubelet connects to a plugin instance as soon
//! as it registers when that instance offers this service, and it sends its calls to the
//! newest *connected* instance. During a rolling update that makes the kubelet switch to the
//! new instance at once, while the old one is still up, instead of when the old one's
//! connection breaks (which would fail the calls sent in that moment). The new instance's
//! calls then wait until it holds the node ([`crate::cmd::run`]).
//!
//! The watcher ([`watch()`]): a [`HealthSource`] blocks in NVML's event wait, so it runs on a
//! thread of its own and hands observations over a channel to the live inventory, which
//! keeps the conditions ([`gpu_dra_core::health`]) and republishes taints. One source session
//! at a time, never across a driver swap: when the session ends (NVML out of reach: the driver
//! unloaded or upgraded in place) or the inventory reports another driver version, the
//! session is closed and a new one opened for the GPUs of now once NVML answers again
//! ([`crate::driver_swap`]).
//!
//! The `health` subcommand, an operator's view of the same watch, is [`crate::cmd::health`].

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use gpu_dra_device::{HealthObservation, HealthSource};
use gpu_dra_proto::health::v1alpha1 as h;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::inventory::{LiveInventory, Snapshot};

/// How often an unchanged report is sent again (the kubelet's timeout is 30 s).
pub const RESEND: Duration = Duration::from_secs(10);

/// Serves the health of the live inventory's devices.
#[derive(Debug, Clone)]
pub struct HealthService {
    pool: String,
    snapshots: watch::Receiver<Snapshot>,
    stop: watch::Receiver<bool>,
    resend: Duration,
}

impl HealthService {
    /// Reports the devices of `snapshots` in pool `pool`; streams end when `stop` turns true.
    pub fn new(
        pool: String,
        snapshots: watch::Receiver<Snapshot>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        Self {
            pool,
            snapshots,
            stop,
            resend: RESEND,
        }
    }

    /// Sets how often an unchanged report is sent again (tests).
    pub fn resend_every(mut self, every: Duration) -> Self {
        self.resend = every;
        self
    }

    fn report(pool: &str, snapshot: &Snapshot) -> h::NodeWatchResourcesResponse {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        h::NodeWatchResourcesResponse {
            devices: snapshot
                .health
                .devices
                .iter()
                .map(|(name, health)| h::DeviceHealth {
                    device: Some(h::DeviceIdentifier {
                        pool_name: pool.to_string(),
                        device_name: name.clone(),
                    }),
                    health: if health.healthy {
                        h::HealthStatus::Healthy
                    } else {
                        h::HealthStatus::Unhealthy
                    } as i32,
                    last_updated_time: now,
                    health_check_timeout_seconds: 0,
                    message: health.message.clone(),
                })
                .collect(),
        }
    }
}

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<h::NodeWatchResourcesResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl h::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _request: Request<h::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        struct State {
            pool: String,
            snapshots: watch::Receiver<Snapshot>,
            stop: watch::Receiver<bool>,
            tick: tokio::time::Interval,
            first: bool,
        }
        let mut tick = tokio::time::interval(self.resend);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let state = State {
            pool: self.pool.clone(),
            snapshots: self.snapshots.clone(),
            stop: self.stop.clone(),
            tick,
            first: true,
        };
        let stream = futures::stream::unfold(state, |mut st| async move {
            if st.first {
                st.first = false;
                st.tick.tick().await;
            } else {
                tokio::select! {
                    _ = st.stop.wait_for(|s| *s) => return None,
                    changed = st.snapshots.changed() => if changed.is_err() { return None },
                    _ = st.tick.tick() => {}
                }
            }
            if *st.stop.borrow() {
                return None;
            }
            let snapshot = st.snapshots.borrow_and_update().clone();
            let report = HealthService::report(&st.pool, &snapshot);
            Some((Ok(report), st))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// Watches GPU health with `source` until `stop` turns true, feeding `live`. Runs each source
/// session on a thread of its own and opens a new one when it ends or the driver's version
/// changes (see the module doc); ends the conditions whose time is over every second.
pub async fn watch(
    source: Arc<dyn HealthSource>,
    live: Arc<LiveInventory>,
    probe_interval: Duration,
    stop: watch::Receiver<bool>,
) {
    watch_with(source, live, probe_interval, RESTART_PAUSE, stop).await;
}

/// Shortest pause between the end of a health session and the next one.
pub const RESTART_PAUSE: Duration = Duration::from_secs(2);

/// What a session's thread sends.
enum FromSession {
    Observation(HealthObservation),
    Ended(Result<(), gpu_dra_device::DeviceError>),
}

/// [`watch()`] with the pause between sessions given (tests).
pub async fn watch_with(
    source: Arc<dyn HealthSource>,
    live: Arc<LiveInventory>,
    probe_interval: Duration,
    restart_pause: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut expire = tokio::time::interval(Duration::from_secs(1));
    let mut snapshots = live.subscribe();
    let mut failures = 0u32;
    loop {
        let current = live.current();
        let version = current.driver_version.clone();
        let gpus: Vec<String> = current.gpus.iter().map(|g| g.uuid.clone()).collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<FromSession>();
        let stopping = Arc::new(AtomicBool::new(false));
        let thread = {
            let (source, stopping) = (source.clone(), stopping.clone());
            std::thread::Builder::new()
                .name("gpu-health".into())
                .spawn(move || {
                    let mut sink = |o: HealthObservation| {
                        let _ = tx.send(FromSession::Observation(o));
                    };
                    let end = source.watch(&gpus, probe_interval, &stopping, &mut sink);
                    let _ = tx.send(FromSession::Ended(end));
                })
        };
        if let Err(e) = thread {
            tracing::warn!(error = %e, "cannot start the GPU health thread");
            return;
        }
        // Serve this session until it ends, the driver changes or we stop.
        let ended = loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => {
                    stopping.store(true, Ordering::Relaxed);
                    return;
                }
                msg = rx.recv() => match msg {
                    Some(FromSession::Observation(o)) => {
                        failures = 0;
                        tracing::debug!(?o, "health observation");
                        live.observe(&o);
                    }
                    Some(FromSession::Ended(end)) => break end,
                    None => break Ok(()),
                },
                changed = snapshots.changed() => {
                    if changed.is_err() {
                        stopping.store(true, Ordering::Relaxed);
                        return;
                    }
                    let now = snapshots.borrow_and_update().inventory.driver_version.clone();
                    if now != version {
                        tracing::info!(from = %version, to = %now, "the driver changed: reopening the health watch's NVML session");
                        stopping.store(true, Ordering::Relaxed);
                    }
                }
                _ = expire.tick() => live.expire_health(),
            }
        };
        match ended {
            Ok(()) if stopping.load(Ordering::Relaxed) => continue,
            Ok(()) => tracing::info!("the GPU health session ended; opening another"),
            Err(e) => {
                failures += 1;
                if failures == 1 {
                    tracing::warn!(error = %e, "cannot watch GPU health now; retrying until NVML answers (devices keep their last health)");
                } else {
                    tracing::debug!(error = %e, attempt = failures, "GPU health watch still cannot start");
                }
            }
        }
        // A pause before the next session, so a driver that stays away costs little.
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(restart_pause) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use gpu_dra_core::health::HealthPolicy;
    use gpu_dra_device::HealthEvent;
    use gpu_dra_device::fixture::FixtureInventory;
    use gpu_dra_device::testing::t4_inventory;
    use h::dra_resource_health_server::DraResourceHealth;

    fn live() -> Arc<LiveInventory> {
        let inv = t4_inventory(2);
        LiveInventory::with_inventory(
            Arc::new(FixtureInventory::new(inv.clone())),
            inv,
            HealthPolicy::new("gpu.nvidia.com"),
        )
    }

    fn states(r: &h::NodeWatchResourcesResponse) -> Vec<(String, i32)> {
        r.devices
            .iter()
            .map(|d| {
                let id = d.device.as_ref().expect("device");
                (format!("{}/{}", id.pool_name, id.device_name), d.health)
            })
            .collect()
    }

    #[tokio::test]
    async fn reports_health_at_once_on_change_and_again_before_the_kubelet_times_out() {
        let live = live();
        let (stop, stopped) = watch::channel(false);
        let svc = HealthService::new("node-a".into(), live.subscribe(), stopped)
            .resend_every(Duration::from_millis(100));
        let mut stream = svc
            .node_watch_resources(Request::new(h::NodeWatchResourcesRequest {}))
            .await
            .expect("stream")
            .into_inner();
        let healthy = h::HealthStatus::Healthy as i32;
        let first = stream.next().await.expect("report").expect("ok");
        assert_eq!(
            states(&first),
            [
                ("node-a/gpu-0".to_string(), healthy),
                ("node-a/gpu-1".to_string(), healthy)
            ]
        );
        // Unchanged: sent again.
        let again = tokio::time::timeout(Duration::from_secs(2), stream.next()).await;
        assert!(again.is_ok(), "no resend");
        // An XID on GPU 0: reported unhealthy with the reason.
        let uuid = live.current().gpus[0].uuid.clone();
        live.observe(&HealthObservation::Event {
            gpu_uuid: uuid,
            event: HealthEvent::Xid(48),
            instance: None,
        });
        let report = loop {
            let r = stream.next().await.expect("report").expect("ok");
            if r.devices[0].health != healthy {
                break r;
            }
        };
        assert_eq!(report.devices[0].health, h::HealthStatus::Unhealthy as i32);
        assert!(
            report.devices[0].message.contains("XID error 48"),
            "{report:?}"
        );
        assert_eq!(report.devices[1].health, healthy);
        stop.send(true).expect("stop");
        let end = tokio::time::timeout(Duration::from_secs(2), async {
            while stream.next().await.is_some() {}
        })
        .await;
        assert!(end.is_ok(), "the stream did not end on stop");
    }
}
