//! A driver upgraded in place under a running plugin (`gpu-sim upgrade-driver`): the plugin
//! notices, loads NVML again from a fresh lookup, names the new files in the specs of new
//! claims and of the claims it prepared before (same devices and CDI names), republishes its
//! slices with the new `driverVersion`, and fails `/healthz` while NVML cannot be reached for
//! longer than its grace.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod fake_api;

use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_dra_core::health::HealthPolicy;
use gpu_dra_kubelet_plugin::cdi_io::CdiHost;
use gpu_dra_kubelet_plugin::host::{DriverRoots, HostArgs};
use gpu_dra_kubelet_plugin::inventory::LiveInventory;
use gpu_dra_kubelet_plugin::publish::{self, PublisherConfig};
use gpu_dra_kubelet_plugin::testing::{PluginCommand, allocated_claim, connect_dra};
use gpu_dra_proto::dra::v1;
use gpu_dra_sim::testing::SimHost;
use gpu_dra_sim::upgrade::UpgradeStyle;
use serde_json::json;

const NEW: &str = "590.44.01";
const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";
const UID_OLD: &str = "a0000000-0000-4000-8000-00000000000a";
const UID_NEW: &str = "b0000000-0000-4000-8000-00000000000b";

fn host_args(host: &SimHost) -> HostArgs {
    HostArgs {
        driver_root: host.root().to_path_buf(),
        container_driver_root: None,
        dev_root: host.root().to_path_buf(),
        sysfs_root: host.sysfs_root(),
        nvml_lib: None,
    }
}

/// `GET path` on `addr`: the status code and body, or `None` when nothing answers.
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    Some((code, body))
}

fn free_address() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

async fn prepare(cmd: &PluginCommand, uid: &str, name: &str) -> Result<(), String> {
    let mut client = connect_dra(cmd.socket()).await.map_err(|e| e.to_string())?;
    let answer = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1::Claim {
                namespace: "ns".into(),
                uid: uid.into(),
                name: name.into(),
            }],
        })
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    match answer.claims.get(uid) {
        Some(r) if r.error.is_empty() => Ok(()),
        Some(r) => Err(r.error.clone()),
        None => Err(format!("claim {uid} missing from the answer")),
    }
}

/// The host paths a claim's spec mounts.
fn mounts(cmd: &PluginCommand, uid: &str) -> Vec<String> {
    mounts_of(&spec_bytes(cmd, uid))
}

/// The host paths a spec mounts.
fn mounts_of(spec: &[u8]) -> Vec<String> {
    let spec: serde_json::Value = serde_json::from_slice(spec).unwrap();
    spec["containerEdits"]["mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["hostPath"].as_str().map(str::to_owned))
        .collect()
}

fn spec_bytes(cmd: &PluginCommand, uid: &str) -> Vec<u8> {
    std::fs::read(
        cmd.cdi_dir()
            .join(format!("k8s.gpu.nvidia.com-claim_{uid}.json")),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_plugin_follows_the_upgrade_and_its_prepared_claims_specs_follow_it() {
    for style in [UpgradeStyle::Container, UpgradeStyle::Package] {
        let host = Arc::new(SimHost::new("dgx-h100"));
        let old = host.profile().driver_version.clone();
        let tmp = tempfile::tempdir().unwrap();
        let http = free_address();
        let cmd = PluginCommand::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"), tmp.path())
            .node_name(NODE)
            .host_root(host.root())
            .sysfs_root(&host.sysfs_root())
            .http_address(&http)
            .env("DRIVER_CHECK_INTERVAL_SECONDS", "1")
            .env("NVML_UNREACHABLE_GRACE_SECONDS", "1");
        let claims = vec![
            allocated_claim("ns", "old", UID_OLD, DRIVER, NODE, &[("gpu", "gpu-0")], &[]),
            allocated_claim("ns", "new", UID_NEW, DRIVER, NODE, &[("gpu", "gpu-1")], &[]),
        ];
        std::fs::write(cmd.claims_file(), serde_json::to_vec(&claims).unwrap()).unwrap();
        let _plugin = cmd.spawn().unwrap();
        cmd.wait_for(&cmd.socket(), "the DRA socket");
        prepare(&cmd, UID_OLD, "old").await.unwrap();
        let before = spec_bytes(&cmd, UID_OLD);
        assert!(
            mounts(&cmd, UID_OLD)
                .iter()
                .any(|m| m.ends_with(&format!("libnvidia-ml.so.{old}"))),
            "{style:?}: the first spec names the old NVML"
        );

        let swap = {
            let host = host.clone();
            std::thread::spawn(move || host.upgrade_driver(NEW, style, Duration::from_secs(5)))
        };
        // /healthz while NVML cannot be reached.
        let mut failing = None;
        while !swap.is_finished() {
            if let Some((503, body)) = get(&http, "/healthz") {
                failing = Some(body);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        swap.join().unwrap();
        let body = failing.unwrap_or_else(|| {
            panic!(
                "{style:?}: /healthz said ok all through the window in which NVML could not be reached; plugin log:\n{}",
                cmd.log()
            )
        });
        assert!(body.contains("NVML"), "{style:?}: {body}");

        // A new claim after the swap: its spec names the new files only.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut result = prepare(&cmd, UID_NEW, "new").await;
        while result.is_err() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(500)).await;
            result = prepare(&cmd, UID_NEW, "new").await;
        }
        if let Err(e) = result {
            panic!("{style:?}: a claim prepared after the upgrade failed: {e}");
        }
        let now = mounts(&cmd, UID_NEW);
        for lib in ["libnvidia-ml", "libcuda"] {
            assert!(
                now.iter().any(|m| m.ends_with(&format!("{lib}.so.{NEW}"))),
                "{style:?}: {lib} of {NEW} not mounted: {now:#?}"
            );
        }
        assert!(
            !now.iter().any(|m| m.contains(&old)),
            "{style:?}: the new claim's spec names files of {old}: {now:#?}"
        );
        for m in &now {
            assert!(
                Path::new(m).exists(),
                "{style:?}: {m} does not exist on the host"
            );
        }
        // The claim prepared before: its spec follows the new driver (a container restarted
        // in its pod starts from it), with the same devices and CDI names, also when the
        // kubelet prepares it again. Rewritten without a call, as soon as the plugin saw the
        // new version.
        let deadline = Instant::now() + Duration::from_secs(10);
        while mounts(&cmd, UID_OLD).iter().any(|m| m.contains(&old)) {
            assert!(
                Instant::now() < deadline,
                "{style:?}: the old claim's spec still names files of {old} 10 s after the swap: {:#?}\n{}",
                mounts(&cmd, UID_OLD),
                cmd.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        prepare(&cmd, UID_OLD, "old").await.unwrap();
        let then = mounts_of(&before);
        let now = mounts(&cmd, UID_OLD);
        assert!(
            !now.iter().any(|m| m.contains(&old)),
            "{style:?}: the old claim's spec still names files of {old}: {now:#?}"
        );
        assert_eq!(
            now.iter().filter(|m| m.contains(NEW)).count(),
            then.iter().filter(|m| m.contains(&old)).count(),
            "{style:?}: every versioned file has its new one: {now:#?}"
        );
        for m in &now {
            assert!(
                Path::new(m).exists(),
                "{style:?}: {m} does not exist on the host"
            );
        }
        let devices =
            |b: &[u8]| serde_json::from_slice::<serde_json::Value>(b).unwrap()["devices"].clone();
        assert_eq!(
            devices(&spec_bytes(&cmd, UID_OLD)),
            devices(&before),
            "{style:?}: the old claim's devices changed"
        );
        assert!(
            !cmd.log().contains("reachable: false"),
            "{style:?}: the swap made GPUs unreachable in the health watch:\n{}",
            cmd.log()
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while get(&http, "/healthz").map(|(c, _)| c) != Some(200) {
            assert!(
                Instant::now() < deadline,
                "{style:?}: /healthz did not recover: {:?}",
                get(&http, "/healthz")
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The health watch opened a new NVML session on the new driver.
        let deadline = Instant::now() + Duration::from_secs(20);
        while cmd
            .log()
            .matches("watching GPU health through NVML")
            .count()
            < 2
        {
            assert!(
                Instant::now() < deadline,
                "{style:?}: no new health session after the swap:\n{}",
                cmd.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_are_republished_with_the_new_driver_version() {
    let host = SimHost::new("t4");
    let api = fake_api::FakeApi::new();
    const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
    api.collection("/api/v1/nodes", "v1", "Node").collection(
        SLICES,
        "resource.k8s.io/v1",
        "ResourceSlice",
    );
    api.put(
        "/api/v1/nodes",
        json!({"metadata": {"name": NODE, "uid": "node-uid-1"}}),
    );
    let (_, backend) = host_args(&host).nvml_inventory().unwrap();
    let live = LiveInventory::discover(Arc::new(backend), HealthPolicy::new(DRIVER)).unwrap();
    let mut config = PublisherConfig::new(NODE, DRIVER);
    config.rediscover_interval = Duration::from_secs(1);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(publish::run(api.client(), config, live, async {
        let _ = stop_rx.await;
    }));
    let version = |api: &fake_api::FakeApi| -> Option<String> {
        api.list(SLICES)
            .first()
            .and_then(|s| {
                s["spec"]["devices"][0]["attributes"]["driverVersion"]["version"].as_str()
            })
            .map(str::to_owned)
    };
    let wait = |want: &'static str| {
        let api = api.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while version(&api).as_deref() != Some(want) {
                assert!(
                    Instant::now() < deadline,
                    "timed out waiting for driverVersion {want}; published: {:?}",
                    version(&api)
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    wait("580.95.5").await;
    host.upgrade_driver(NEW, UpgradeStyle::Container, Duration::from_secs(2));
    wait("590.44.1").await;
    stop_tx.send(()).unwrap();
    let _ = task.await;
}

#[test]
fn the_host_files_are_scanned_again_for_a_new_version_in_both_file_layouts() {
    for profile in ["t4", "h100-usr-local-nvidia"] {
        let host = SimHost::new(profile);
        let old = host.profile().driver_version.clone();
        let tmp = tempfile::tempdir().unwrap();
        // The driver installed on the host, read by the plugin elsewhere.
        let roots = DriverRoots {
            host: "/".into(),
            here: host.root().to_path_buf(),
        };
        let cdi = CdiHost::discover(tmp.path().to_path_buf(), &roots, host.root(), &old, None);
        let named = |cdi: &CdiHost| -> Vec<String> {
            cdi.spec("uid-1", &[])
                .container_edits
                .mounts
                .iter()
                .map(|m| m.host_path.clone())
                .collect()
        };
        let before = named(&cdi);
        host.upgrade_driver(NEW, UpgradeStyle::Container, Duration::ZERO);
        cdi.refresh(&old);
        assert_eq!(named(&cdi), before, "{profile}: same version, no scan");
        cdi.refresh(NEW);
        let after = named(&cdi);
        assert_eq!(cdi.driver_version(), NEW);
        assert!(
            !after.iter().any(|m| m.contains(&old)),
            "{profile}: {after:#?}"
        );
        assert_eq!(
            after.iter().filter(|m| m.contains(NEW)).count(),
            before.iter().filter(|m| m.contains(&old)).count(),
            "{profile}: every versioned file of the old driver has its new one: {after:#?}"
        );
        for m in &after {
            assert!(
                host.root().join(m.trim_start_matches('/')).exists(),
                "{profile}: {m} is not a file of the host"
            );
        }
    }
}
