//! The DRA health service (`v1alpha1.DRAResourceHealth`, `NodeWatchResources`): the kubelet
//! opens one stream per registered plugin instance and shows each device's health in the
//! status of the pods using it.
//!
//! What is reported: every device this node publishes, `HEALTHY`, as a full snapshot when the
//! stream opens; the stream then stays open until the plugin stops. Health events (XID errors,
//! a GPU fallen off the bus, uncorrectable ECC) are not watched yet: no device is ever reported
//! unhealthy (`docs/STATUS.md`).
//!
//! Why serve it already: the kubelet connects to a plugin instance as soon as it registers when
//! that instance offers this service, and it sends its calls to the newest *connected*
//! instance. During a rolling update that makes the kubelet switch to the new instance at once,
//! while the old one is still up, instead of when the old one's connection breaks (which would
//! fail the calls sent in that moment). The new instance's calls then wait until it holds the
//! node (`cli::run`).

use std::pin::Pin;
use std::time::{SystemTime, UNIX_EPOCH};

use futures::Stream;
use gpu_dra_proto::health::v1alpha1 as h;
use tonic::{Request, Response, Status};

/// Serves the health of the devices named at start.
#[derive(Debug, Clone)]
pub struct HealthService {
    pool: String,
    devices: Vec<String>,
    stop: tokio::sync::watch::Receiver<bool>,
}

impl HealthService {
    /// Reports `devices` (ResourceSlice device names) of pool `pool` as healthy; streams end
    /// when `stop` turns true.
    pub fn new(
        pool: String,
        devices: Vec<String>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        Self {
            pool,
            devices,
            stop,
        }
    }

    /// The snapshot sent when a stream opens.
    pub fn snapshot(&self) -> h::NodeWatchResourcesResponse {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        h::NodeWatchResourcesResponse {
            devices: self
                .devices
                .iter()
                .map(|name| h::DeviceHealth {
                    device: Some(h::DeviceIdentifier {
                        pool_name: self.pool.clone(),
                        device_name: name.clone(),
                    }),
                    health: h::HealthStatus::Healthy as i32,
                    last_updated_time: now,
                    health_check_timeout_seconds: 0,
                    message: String::new(),
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
        let first = self.snapshot();
        let mut stop = self.stop.clone();
        let stream = futures::stream::once(async move { Ok(first) }).chain(
            futures::stream::once(async move {
                let _ = stop.wait_for(|s| *s).await;
                None
            })
            .filter_map(
                |x: Option<Result<h::NodeWatchResourcesResponse, Status>>| async move { x },
            ),
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

use futures::StreamExt;

#[cfg(test)]
mod tests {
    use super::*;
    use h::dra_resource_health_server::DraResourceHealth;

    #[tokio::test]
    async fn a_stream_starts_with_every_device_healthy_and_ends_on_stop() {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let svc = HealthService::new(
            "node-a".into(),
            vec!["gpu-0".into(), "gpu-1".into()],
            stopped,
        );
        let mut stream = svc
            .node_watch_resources(Request::new(h::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        let names: Vec<_> = first
            .devices
            .iter()
            .map(|d| {
                let id = d.device.as_ref().unwrap();
                (id.pool_name.as_str(), id.device_name.as_str(), d.health)
            })
            .collect();
        assert_eq!(
            names,
            [
                ("node-a", "gpu-0", h::HealthStatus::Healthy as i32),
                ("node-a", "gpu-1", h::HealthStatus::Healthy as i32)
            ]
        );
        // Open until the plugin stops.
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(50), stream.next()).await;
        assert!(pending.is_err(), "the stream ended early");
        stop.send(true).unwrap();
        assert!(stream.next().await.is_none());
    }
}
