//! Fixtures shared by the driver's unit tests: a driver on a simulated A100 host with claims in
//! memory, claim builders, a recording sharing executor and a node that ran NVIDIA's driver.
//!
//! Everything lives under one temporary root (checkpoint, `cdi/`, `host/`), so a test that
//! builds a second driver on the same root sees the first one's state, as after a restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use gpu_dra_core::checkpoint::{Checkpoint, Imported};
use gpu_dra_core::plan::{Plan, SharingGroup};
use gpu_dra_device::testing::a100_inventory;
use k8s_openapi::api::resource::v1::DeviceRequestAllocationResult;
use serde_json::{Value, json};

use super::{ClaimRef, Driver, lock};
use crate::sharing::{Applied, SharingError, SharingExecutor};
use crate::testing::{DriverBuilder, MemoryClaims, allocated_claim, simulate_host};

pub(super) const DRIVER: &str = "gpu.nvidia.com";
pub(super) const NODE: &str = "node-a";

/// A driver on a simulated host under `dir`, and the claims it reads.
pub(super) struct Env {
    pub(super) dir: tempfile::TempDir,
    pub(super) claims: Arc<MemoryClaims>,
    pub(super) driver: Arc<Driver>,
}

/// A driver for an A100 node with 4 GPUs whose state lives in `dir` (as after a restart when
/// another driver used `dir` before).
pub(super) fn driver_in(dir: &Path, claims: Arc<MemoryClaims>) -> Driver {
    DriverBuilder::new(dir, a100_inventory(4, 1))
        .node_name(NODE)
        .claims(claims)
        .checkpoint_path(dir.join(gpu_dra_core::checkpoint::FILE_NAME))
        .build()
        .expect("driver")
}

/// A fresh [`Env`]: an empty node, no claims.
pub(super) fn env() -> Env {
    let dir = tempfile::tempdir().expect("tempdir");
    simulate_host(&dir.path().join("host"), &a100_inventory(4, 1)).expect("host");
    let claims = Arc::new(MemoryClaims::default());
    let driver = Arc::new(driver_in(dir.path(), claims.clone()));
    Env {
        dir,
        claims,
        driver,
    }
}

/// Adds claim `ns/name` with `devices` as `(request, device)` results.
pub(super) fn add(env: &Env, name: &str, uid: &str, devices: &[(&str, &str)]) -> ClaimRef {
    env.claims
        .insert(allocated_claim("ns", name, uid, DRIVER, NODE, devices, &[]));
    ClaimRef {
        namespace: "ns".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

/// `name` with `device` allocated under request `gpu` and `configs`, its one allocation
/// result changed by `edit`.
pub(super) fn add_allocated(
    env: &Env,
    name: &str,
    uid: &str,
    device: &str,
    configs: &[(&str, &[&str], Value)],
    edit: impl FnOnce(&mut DeviceRequestAllocationResult),
) -> ClaimRef {
    let mut c = allocated_claim("ns", name, uid, DRIVER, NODE, &[("gpu", device)], configs);
    if let Some(results) = c
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .and_then(|d| d.results.as_mut())
    {
        edit(&mut results[0]);
    }
    env.claims.insert(c);
    ClaimRef {
        namespace: "ns".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

/// `name` with `device` allocated under request `gpu` with admin access, and `configs`.
pub(super) fn add_admin(
    env: &Env,
    name: &str,
    uid: &str,
    device: &str,
    configs: &[(&str, &[&str], Value)],
) -> ClaimRef {
    add_allocated(env, name, uid, device, configs, |r| {
        r.admin_access = Some(true);
    })
}

/// Where the driver writes claim `uid`'s CDI spec.
pub(super) fn spec_path(env: &Env, uid: &str) -> PathBuf {
    env.dir
        .path()
        .join("cdi")
        .join(gpu_dra_core::cdi::spec_file_name(uid))
}

/// The checkpoint as it is durable on disk (the file and its journal).
pub(super) fn on_disk(env: &Env) -> Checkpoint {
    super::durable_checkpoint(&env.dir.path().join(gpu_dra_core::checkpoint::FILE_NAME))
        .expect("valid")
}

/// A sharing executor that applies nothing and records every call.
#[derive(Default)]
pub(super) struct Recording(Mutex<Vec<String>>);

impl Recording {
    /// Every call so far: `apply <uid>`, `release <uid>`, `release_imported <uid> ...`.
    pub(super) fn calls(&self) -> Vec<String> {
        lock(&self.0).clone()
    }
}

impl SharingExecutor for Recording {
    fn apply<'a>(
        &'a self,
        plan: &'a Plan,
        group: &'a SharingGroup,
    ) -> BoxFuture<'a, Result<Applied, SharingError>> {
        lock(&self.0).push(format!("apply {}", plan.claim_uid));
        let state = group.sharing.as_ref().map(|_| json!({"group": "c0"}));
        Box::pin(async move {
            Ok(Applied {
                state,
                edits: Default::default(),
            })
        })
    }

    fn release<'a>(
        &'a self,
        claim_uid: &'a str,
        _state: Option<&'a Value>,
    ) -> BoxFuture<'a, Result<(), SharingError>> {
        lock(&self.0).push(format!("release {claim_uid}"));
        Box::pin(async { Ok(()) })
    }

    fn release_imported<'a>(
        &'a self,
        claim_uid: &'a str,
        imported: &'a Imported,
    ) -> BoxFuture<'a, Result<(), SharingError>> {
        lock(&self.0).push(format!(
            "release_imported {claim_uid} timesliced={} mps={}",
            imported.time_sliced_gpus.join(","),
            imported.mps_control_daemons.join(",")
        ));
        Box::pin(async { Ok(()) })
    }
}

/// A driver like [`driver_in`]'s with `sharing` and boot ID `boot`.
pub(super) fn recording_driver(
    dir: &Path,
    claims: Arc<MemoryClaims>,
    sharing: Arc<Recording>,
    boot: &str,
) -> Driver {
    DriverBuilder::new(dir, a100_inventory(4, 1))
        .node_name(NODE)
        .claims(claims)
        .checkpoint_path(dir.join(gpu_dra_core::checkpoint::FILE_NAME))
        .sharing(sharing)
        .boot_id(boot)
        .build()
        .expect("driver")
}

pub(super) const NVIDIA_V2: &str = include_str!("../../../core/testdata/nvidia-checkpoint-v2.json");
pub(super) const NV_TIME_SLICED: &str = "3f0c1b7e-8a55-4d2a-9b61-0c3e5f7a9d11";
pub(super) const NV_MPS: &str = "7c4d1e55-2a6b-4f9e-b8d1-7cae3f5b9b33";
pub(super) const NV_STARTED: &str = "9e6f3a77-4c8d-4b1a-8e2f-9d0b5a7c1d44";
/// The boot NVIDIA's fixture was written in (`v2.nodeBootID`).
pub(super) const NV_BOOT: &str = "c8a1f4de-6b2e-4f0a-9d37-5e81b2c4a6f0";

/// A node that ran NVIDIA's driver: its checkpoint (completed claims, one of them with MPS,
/// and one half prepared) and their spec files; the driver imports them when it starts.
pub(super) fn nvidia_node() -> (Env, Arc<Recording>, Driver) {
    let env = env();
    let legacy = env
        .dir
        .path()
        .join(gpu_dra_core::checkpoint::LEGACY_FILE_NAME);
    std::fs::write(&legacy, NVIDIA_V2).expect("nvidia checkpoint");
    let cdi = env.dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).expect("cdi");
    for uid in [NV_TIME_SLICED, NV_MPS, NV_STARTED] {
        std::fs::write(
            cdi.join(gpu_dra_core::cdi::nvidia_spec_file_name(uid)),
            "cdiVersion: 0.5.0\n",
        )
        .expect("nvidia spec");
    }
    let sharing = Arc::new(Recording::default());
    let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), NV_BOOT);
    (env, sharing, driver)
}

/// Where NVIDIA's driver wrote claim `uid`'s CDI spec.
pub(super) fn nvidia_spec(env: &Env, uid: &str) -> PathBuf {
    env.dir
        .path()
        .join("cdi")
        .join(gpu_dra_core::cdi::nvidia_spec_file_name(uid))
}
