//! Prepare: from the kubelet's claim reference to the CDI device IDs it answers with.
//!
//! A prepare takes the claim's lock, then:
//! 1. answers from the checkpoint when the claim is completed and its effects are still there
//!    (idempotent, no side effect, even when the claim is gone from the API server);
//! 2. otherwise undoes what an earlier try left (a half-prepared entry, or a completed one
//!    whose effects are gone) through [`Driver::unprepare_locked`], keeping its MIG instances;
//! 3. reads the claim, creates or finds its dynamic MIG instances ([`super::dynamic`]), plans
//!    it against the live inventory, reserves its devices ([`super::holders`]) and applies the
//!    plan: checkpoint `PrepareStarted` (with the devices) -> sharing -> CDI spec -> checkpoint
//!    `PrepareCompleted` (with the sharing state). `PrepareStarted` is written durably only
//!    when sharing follows; for a claim whose only effect is its spec it is staged in memory
//!    and written with `PrepareCompleted`, so such a prepare makes one checkpoint write. The
//!    spec and `PrepareCompleted` are written concurrently (see the comment there).
//!
//! A failure at any step after the first write undoes the claim through the same
//! [`Driver::unprepare_locked`], so a failed prepare leaves neither an entry, a spec, sharing
//! nor a reservation behind.
//!
//! Stale effects: a completed claim is prepared again when it was prepared in another boot of
//! the node (its recorded boot ID differs) or its CDI spec file is missing (e.g. `/var/run/cdi`
//! is a tmpfs a reboot emptied). The answer is the same, because CDI IDs are a function of
//! claim UID and device name, and both halves are the usual crash-safe steps, so a crash in
//! between leaves a state the next prepare finishes. A completed claim whose spec names the
//! files of another driver version (upgraded in place since) keeps its entry and gets its
//! spec rewritten ([`super::respec`]).

use std::time::Instant;

use gpu_dra_core::cdi::{
    SpecDevice, cdi_device_id, metadata_cdi_device_id, metadata_device, metadata_request_of,
};
use gpu_dra_core::checkpoint::{ClaimEntry, DynamicMigInstance, PrepareState, PreparedDevice};
use gpu_dra_core::consumable_shares;
use gpu_dra_core::device_metadata::{self, Rendering, RequestFile};
use gpu_dra_core::plan::{self, ClaimInput, Plan, PlanError};
use gpu_dra_device::Inventory;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::Value;
use tracing::{info, warn};

use super::unprepare::Keep;
use super::{ClaimRef, Driver, DriverError, blocking, dynamic, lock};
use crate::inventory::Published;

/// Refuses a sharing config that reaches a device allocated with admin access (from the
/// claim or its DeviceClass), with the api crate's message.
fn refuse_sharing_with_admin_access(plan: &Plan) -> Result<(), PlanError> {
    for group in plan.groups.iter().filter(|g| g.sharing.is_some()) {
        let admin = group
            .devices
            .iter()
            .filter_map(|&i| plan.devices.get(i))
            .find(|d| d.admin_access);
        if let (Some(device), Some(index)) = (admin, group.config_index) {
            let request = device.request_names.first().map_or("", String::as_str);
            return Err(PlanError::Config {
                index,
                errors: gpu_dra_api::admin_access_sharing(request).into(),
            });
        }
    }
    Ok(())
}

impl Driver {
    /// Prepares one claim; returns its devices with CDI IDs. Its devices are checked against
    /// what the node publishes now.
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, DriverError> {
        self.prepare_as_published(claim, &self.inventory.published())
            .await
    }

    /// The live inventory claims are prepared against; the publisher marks in it what it
    /// published ([`LiveInventory::mark_published`](crate::inventory::LiveInventory::mark_published)).
    pub fn live_inventory(&self) -> &std::sync::Arc<crate::inventory::LiveInventory> {
        &self.inventory
    }

    /// What the node publishes now: a kubelet call takes it when it arrives and prepares its
    /// claims against it ([`Driver::prepare_as_published`]).
    pub fn published(&self) -> Published {
        self.inventory.published()
    }

    /// Prepares one claim of a kubelet call; its devices are checked against `published`, what
    /// the node had published when the call arrived (see [`crate::inventory::Published`]).
    pub async fn prepare_as_published(
        &self,
        claim: &ClaimRef,
        published: &Published,
    ) -> Result<Vec<PreparedDevice>, DriverError> {
        let started = Instant::now();
        let in_flight = self.in_flight();
        let result = self.prepare_inner(claim, published).await;
        drop(in_flight);
        self.metrics
            .observe("prepare", started.elapsed().as_secs_f64(), result.is_ok());
        match &result {
            Ok(devices) => {
                info!(claim.uid = %claim.uid, claim = %format!("{}/{}", claim.namespace, claim.name), devices = devices.len(), "prepared");
                // Also for repeats: the sink sends nothing when the status is already written.
                if let Some(status) = &self.claim_status {
                    status.prepared(claim, devices, &self.inventory.current());
                }
            }
            Err(e) => warn!(claim.uid = %claim.uid, error = %e, "prepare failed"),
        }
        result
    }

    async fn prepare_inner(
        &self,
        claim: &ClaimRef,
        published: &Published,
    ) -> Result<Vec<PreparedDevice>, DriverError> {
        self.failpoints.hit("prepare.start").await?;
        let user = self.claim_locks.join(&claim.uid);
        let _guard = user.lock().await;
        // A claim prepared before (or half prepared) is undone first, except for its MIG
        // instances, which the new try reuses when it needs them again.
        let kept = match self.journal.entry(&claim.uid) {
            Some(e) if e.state == PrepareState::PrepareCompleted => {
                let Some(reason) = self.stale_reason(&claim.uid, &e) else {
                    // The same CDI IDs, with a spec that names the driver of now.
                    self.rewrite_stale_spec(&claim.uid, &e).await?;
                    // Its daemon pods in the shape of now, where no client would notice.
                    self.reshape_claim_daemons(&claim.uid).await;
                    return Ok(e.devices);
                };
                info!(claim.uid = %claim.uid, %reason, "preparing the claim again");
                self.unprepare_locked(&claim.uid, Keep::MigInstances)
                    .await?;
                e.dynamic_mig
            }
            Some(e) => {
                self.unprepare_locked(&claim.uid, Keep::MigInstances)
                    .await?;
                e.dynamic_mig
            }
            None => Vec::new(),
        };
        let result = self.prepare_fresh(claim, kept, published).await;
        if result.is_err() && self.journal.entry(&claim.uid).is_some() {
            // Undo whatever was done; the checkpoint says what that may be.
            if let Err(e) = self.unprepare_locked(&claim.uid, Keep::Nothing).await {
                warn!(claim.uid = %claim.uid, error = %e, "rollback after failed prepare failed");
            }
            lock(&self.holders).release(&claim.uid);
        }
        result
    }

    /// Why a completed claim's recorded answer cannot be trusted any more, if it cannot.
    fn stale_reason(&self, uid: &str, entry: &ClaimEntry) -> Option<String> {
        if let (Some(now), Some(then)) = (&self.settings.boot_id, &entry.boot_id)
            && now != then
        {
            return Some(format!(
                "the node rebooted since it was prepared (boot ID {then}, now {now})"
            ));
        }
        let ours = self.cdi.spec_path(uid);
        let theirs = entry
            .imported
            .is_some()
            .then(|| self.cdi.nvidia_spec_path(uid));
        if !(ours.exists() || theirs.is_some_and(|p| p.exists())) {
            return Some(format!("its CDI spec {} is missing", ours.display()));
        }
        // The device metadata files its spec mounts (whether or not the plugin writes them
        // now: the answer names them).
        entry
            .devices
            .iter()
            .flat_map(|d| &d.cdi_device_ids)
            .filter_map(|id| metadata_request_of(uid, id))
            .find_map(|request| self.metadata.missing(uid, &request))
            .map(|path| format!("its device metadata file {} is missing", path.display()))
    }

    /// The device metadata files of a claim ([`device_metadata`]), when the plugin writes
    /// them: one per request, its devices' attributes from `inventory`, the one the claim is
    /// prepared against.
    fn metadata_files(
        &self,
        rc: &ResourceClaim,
        input: &ClaimInput,
        inventory: &Inventory,
    ) -> Result<Vec<RequestFile>, DriverError> {
        let settings = &self.settings.device_metadata;
        if !settings.enabled {
            return Ok(Vec::new());
        }
        let pod_claim_name = device_metadata::pod_claim_name(rc)?;
        Ok(device_metadata::request_files(
            input,
            pod_claim_name.as_deref(),
            inventory,
            Rendering {
                driver: &self.settings.driver_name,
                pool: &self.settings.node_name,
                list_forms: settings.list_forms,
            },
        ))
    }

    /// Prepares a claim that has no entry (or only the MIG instances in `kept`).
    async fn prepare_fresh(
        &self,
        claim: &ClaimRef,
        kept: Vec<DynamicMigInstance>,
        published: &Published,
    ) -> Result<Vec<PreparedDevice>, DriverError> {
        let rc = self
            .claims
            .get(&claim.namespace, &claim.name)
            .await?
            .ok_or_else(|| DriverError::ClaimNotFound {
                claim: format!("{}/{}", claim.namespace, claim.name),
            })?;
        let input = plan::claim_input(
            &rc,
            &claim.uid,
            &self.settings.driver_name,
            &self.settings.node_name,
        )?;
        // Planned against the hardware of now, and refused for a device that is not the one
        // this node published under its name (see crate::inventory).
        let names: Vec<&str> = input.devices.iter().map(|d| d.device.as_str()).collect();
        // Dynamic MIG devices exist once their instances do: created (or found) first, so the
        // live inventory below has them with their IDs and capability nodes.
        if dynamic::names_static_instances(&self.inventory.snapshot(), &names) {
            self.inventory
                .rediscover()
                .await
                .map_err(crate::inventory::ResolveError::from)?;
        }
        let (wanted, stale) = dynamic::intents(&self.inventory.snapshot(), &names, kept);
        self.drop_stale_instances(&claim.uid, stale).await?;
        if !wanted.is_empty() {
            self.ensure_instances(claim, wanted).await?;
        }
        let inventory = self
            .inventory
            .resolve(&claim.uid, &names, published)
            .await?;
        let plan = plan::plan(&input, &inventory, self.decoder.as_ref())?;
        refuse_sharing_with_admin_access(&plan)?;
        let metadata = self.metadata_files(&rc, &input, &inventory)?;
        self.failpoints.hit("prepare.after_plan").await?;
        // On refusal nothing else is done yet: only MIG instances (if any), which the caller
        // undoes.
        let shareable = self.inventory.partitioning().shareable_devices(&inventory);
        lock(&self.holders).reserve(claim, &plan, &shareable)?;
        let result = self.apply_plan(claim, &plan, &metadata).await;
        if result.is_err() && self.journal.entry(&claim.uid).is_none() {
            // The entry's first write failed: the reservation is all there is to undo.
            lock(&self.holders).release(&claim.uid);
        }
        result
    }

    async fn apply_plan(
        &self,
        claim: &ClaimRef,
        plan: &Plan,
        metadata: &[RequestFile],
    ) -> Result<Vec<PreparedDevice>, DriverError> {
        let mut devices: Vec<PreparedDevice> = plan
            .devices
            .iter()
            .map(|d| PreparedDevice {
                device: d.device.clone(),
                pool: self.settings.node_name.clone(),
                request_names: d.request_names.clone(),
                cdi_device_ids: vec![cdi_device_id(&claim.uid, &d.device)],
                uuid: d.uuid.clone(),
                admin_access: d.admin_access,
                share_id: d.share_id.clone(),
                memory_share_bytes: d.memory_share.map(|s| s.bytes),
                sharing_strategy: plan
                    .groups
                    .get(d.group)
                    .and_then(|g| g.sharing.as_ref())
                    .map(|s| crate::sharing::executor::strategy_name(s).to_owned()),
                extra: Default::default(),
            })
            .collect();
        // A request's metadata device goes with the first of its devices: the kubelet gives a
        // container the CDI devices of the requests it uses, so a container that uses one
        // request of the claim sees that request's file only.
        for file in metadata {
            if let Some(d) = devices
                .iter_mut()
                .find(|d| d.request_names.contains(&file.request))
            {
                d.cdi_device_ids
                    .push(metadata_cdi_device_id(&claim.uid, &file.request));
            }
        }
        let entry = ClaimEntry {
            state: PrepareState::PrepareStarted,
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            devices: devices.clone(),
            sharing: None,
            boot_id: self.settings.boot_id.clone(),
            driver_version: None,
            imported: None,
            dynamic_mig: self
                .journal
                .entry(&claim.uid)
                .map(|e| e.dynamic_mig)
                .unwrap_or_default(),
            extra: Default::default(),
        };
        // Durable before sharing touches the GPU, so that a crash leaves a record to undo. A
        // claim whose only effect is its CDI spec needs none: a spec without an entry is stray
        // and the cleanup removes it (the claim's lock keeps it from a spec being prepared).
        // The entry is then only staged and reaches the disk with `PrepareCompleted`: one
        // durable commit for the claim.
        if plan.groups.iter().any(|g| g.sharing.is_some()) {
            self.journal
                .persist(|cp| {
                    cp.claims.insert(claim.uid.clone(), entry);
                })
                .await?;
        } else {
            self.journal.stage(|cp| {
                cp.claims.insert(claim.uid.clone(), entry);
            });
        }
        self.failpoints
            .hit("prepare.after_checkpoint_started")
            .await?;

        let mut sharing_states = Vec::new();
        let mut sharing_edits: Vec<(usize, gpu_dra_core::cdi::ContainerEdits)> = Vec::new();
        for group in &plan.groups {
            let applied = self.sharing.apply(plan, group).await?;
            if let Some(state) = applied.state {
                sharing_states.push(state);
            }
            for &i in &group.devices {
                sharing_edits.push((i, applied.edits.clone()));
            }
        }
        // Kept with `PrepareCompleted` (one write): releasing works from the claim UID alone,
        // so an entry that lost it in a crash is still undone completely.
        let sharing = (!sharing_states.is_empty()).then(|| Value::Array(sharing_states));
        self.failpoints.hit("prepare.after_sharing").await?;
        // With the boot recorded in the entry the content of the spec and the metadata files
        // needs no fsync: after a power loss the next boot prepares the claim again before
        // trusting them.
        let sync_content = self.settings.boot_id.is_none();
        // Before the spec that mounts them.
        if !metadata.is_empty() {
            let store = self.metadata.clone();
            let files = metadata.to_vec();
            let uid = claim.uid.clone();
            blocking(move || store.write(&uid, &files, sync_content)).await??;
            self.failpoints.hit("prepare.after_metadata").await?;
        }

        let mut spec_devices = Vec::with_capacity(plan.devices.len());
        for d in &plan.devices {
            spec_devices.push(SpecDevice {
                device: d.device.clone(),
                node_paths: self.cdi.device_nodes(&d.nodes)?,
            });
        }
        let (mut spec, driver_version) = self.cdi.versioned_spec(&claim.uid, &spec_devices);
        // A share (its memory, its `shares`) is told to the containers that get its device,
        // whatever the sharing strategy (only MPS enforces memory).
        for (d, dev) in plan.devices.iter().zip(spec.devices.iter_mut()) {
            dev.container_edits.env.extend(consumable_shares::share_env(
                d.memory_share.as_ref(),
                d.shares,
            ));
        }
        // Sharing edits (the MPS pipe directory mount and env) go on the group's devices, so a
        // container gets them exactly when it gets one of those devices.
        for (i, edits) in sharing_edits {
            if let Some(dev) = spec.devices.get_mut(i) {
                let ce = &mut dev.container_edits;
                ce.env.extend(edits.env);
                ce.device_nodes.extend(edits.device_nodes);
                ce.mounts.extend(edits.mounts);
                ce.hooks.extend(edits.hooks);
            }
        }
        spec.devices.extend(metadata.iter().map(|f| {
            metadata_device(
                &claim.uid,
                &f.request,
                self.metadata
                    .path(&claim.uid, &f.request)
                    .to_string_lossy()
                    .into_owned(),
                f.container_path.clone(),
            )
        }));
        // MPS clients get no control tool (the operator's front end, `quit` included).
        let spec = gpu_dra_core::sharing::without_control_tool(spec);
        // The spec and the completed entry are written at once (their fsyncs overlap): a
        // completed entry whose spec is missing is prepared again by the next prepare
        // (`stale_reason`), and a spec without a completed entry is undone, so either may
        // reach the disk first. Both are there before the kubelet is answered.
        let cdi = self.cdi.clone();
        let uid = claim.uid.clone();
        let (written, completed) = tokio::join!(
            blocking(move || cdi.write(&uid, &spec, sync_content)),
            self.journal.persist(|cp| {
                if let Some(e) = cp.claims.get_mut(&claim.uid) {
                    e.state = PrepareState::PrepareCompleted;
                    e.sharing = sharing;
                    e.driver_version = Some(driver_version);
                }
            })
        );
        written??;
        self.failpoints.hit("prepare.after_cdi_write").await?;
        completed?;
        self.metrics.prepared_devices.inc_by(devices.len() as i64);
        self.failpoints
            .hit("prepare.after_checkpoint_completed")
            .await?;
        Ok(devices)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpu_dra_device::testing::a100_inventory;
    use serde_json::json;

    use super::*;
    use crate::claims::{ClaimSource, ClaimSourceError};
    use crate::driver::fixtures::*;
    use crate::testing::{DriverBuilder, MemoryClaims, allocated_claim, simulate_host};

    #[tokio::test]
    async fn prepare_writes_a_valid_spec_is_idempotent_and_unprepare_cleans_up() {
        let env = env();
        let c = add(
            &env,
            "a",
            "uid-a",
            &[
                ("gpu", "gpu-1"),
                ("mig", "gpu-0-mig-1g5gb-19-0"),
                ("mig", "gpu-0-mig-1g5gb-19-1"),
            ],
        );
        let devices = env.driver.prepare(&c).await.expect("prepares");
        assert_eq!(devices.len(), 3);
        assert_eq!(
            devices[0].cdi_device_ids,
            ["k8s.gpu.nvidia.com/claim=uid-a-gpu-1"]
        );
        assert_eq!(devices[0].pool, NODE);

        let path = spec_path(&env, "uid-a");
        let mut spec =
            container_device_interface::spec::read_spec(&path, 0).expect("CDI crate reads it");
        let cdi_devices = spec.validate().expect("CDI crate validates it");
        assert_eq!(cdi_devices.len(), 3);
        let raw: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("spec")).expect("json");
        // Two MIG devices of GPU 0: each has the parent node and its own capability nodes.
        let nodes = |i: usize| -> Vec<String> {
            raw["devices"][i]["containerEdits"]["deviceNodes"]
                .as_array()
                .expect("nodes")
                .iter()
                .map(|n| n["path"].as_str().expect("path").to_owned())
                .collect()
        };
        assert_eq!(nodes(1)[0], "/dev/nvidia0");
        assert_eq!(nodes(2)[0], "/dev/nvidia0");
        assert_eq!(nodes(1).len(), 3);
        assert_ne!(nodes(1)[1..], nodes(2)[1..]);
        assert!(
            raw["containerEdits"]["mounts"]
                .as_array()
                .expect("mounts")
                .iter()
                .any(|m| m["containerPath"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05")
        );

        let cp = on_disk(&env);
        assert_eq!(cp.claims["uid-a"].state, PrepareState::PrepareCompleted);
        // Repeat: same answer, no new work even if the claim vanished from the API server.
        env.claims.remove("ns", "a");
        assert_eq!(env.driver.prepare(&c).await.expect("repeat"), devices);

        env.driver.unprepare(&c).await.expect("unprepares");
        assert!(!path.exists());
        assert!(on_disk(&env).claims.is_empty());
        env.driver
            .unprepare(&c)
            .await
            .expect("unknown claim unprepare succeeds");
    }

    #[tokio::test]
    async fn concurrent_prepares_of_one_claim_prepare_it_once() {
        let env = env();
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-3")]);
        let (x, y) = tokio::join!(env.driver.prepare(&a), env.driver.prepare(&a));
        assert_eq!(x.expect("x"), y.expect("y"));
        assert_eq!(on_disk(&env).claims.len(), 1);
    }

    #[tokio::test]
    async fn missing_device_node_fails_without_leaving_a_spec_or_a_reservation() {
        let env = env();
        std::fs::remove_file(env.dir.path().join("host/dev/nvidia2")).expect("rm");
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-2")]);
        let err = env
            .driver
            .prepare(&a)
            .await
            .expect_err("missing node")
            .to_string();
        assert!(
            err.contains("dev/nvidia2") && err.contains("missing"),
            "{err}"
        );
        assert!(!spec_path(&env, "uid-a").exists());
        assert!(on_disk(&env).claims.is_empty());
        std::fs::write(env.dir.path().join("host/dev/nvidia2"), "").expect("restore");
        env.driver.prepare(&a).await.expect("retry works");
    }

    #[tokio::test]
    async fn errors_are_clear_for_unallocated_replaced_and_sharing_claims() {
        let env = env();
        let mut c = allocated_claim("ns", "u", "uid-u", DRIVER, NODE, &[], &[]);
        c.status = None;
        env.claims.insert(c);
        let r = ClaimRef {
            namespace: "ns".into(),
            name: "u".into(),
            uid: "uid-u".into(),
        };
        assert!(
            env.driver
                .prepare(&r)
                .await
                .expect_err("unallocated")
                .to_string()
                .contains("not allocated")
        );
        let r2 = ClaimRef {
            uid: "uid-old".into(),
            ..r.clone()
        };
        assert!(
            env.driver
                .prepare(&r2)
                .await
                .expect_err("replaced")
                .to_string()
                .contains("replaced")
        );
        let missing = ClaimRef {
            name: "nope".into(),
            ..r
        };
        assert!(
            env.driver
                .prepare(&missing)
                .await
                .expect_err("missing")
                .to_string()
                .contains("not found")
        );

        let ts = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing"}});
        env.claims.insert(allocated_claim(
            "ns",
            "t",
            "uid-t",
            DRIVER,
            NODE,
            &[("gpu", "gpu-1")],
            &[("FromClaim", &[], ts)],
        ));
        let t = ClaimRef {
            namespace: "ns".into(),
            name: "t".into(),
            uid: "uid-t".into(),
        };
        let err = env
            .driver
            .prepare(&t)
            .await
            .expect_err("sharing")
            .to_string();
        assert!(
            err.contains("sharing.strategy") && err.contains("exclusive use only"),
            "{err}"
        );
        assert!(
            on_disk(&env).claims.is_empty(),
            "failed prepare leaves no entry"
        );
    }

    const BOOT_1: &str = "1b7a3c2e-5d4f-4a6b-9c8d-0e1f2a3b4c5d";
    const BOOT_2: &str = "2c8b4d3f-6e5a-4b7c-8d9e-1f2a3b4c5d6e";

    fn time_sliced_claim(env: &Env, name: &str, uid: &str, device: &str) -> ClaimRef {
        let ts = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}});
        env.claims.insert(allocated_claim(
            "ns",
            name,
            uid,
            DRIVER,
            NODE,
            &[("gpu", device)],
            &[("FromClaim", &["gpu"], ts)],
        ));
        ClaimRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[tokio::test]
    async fn same_boot_and_spec_present_answers_from_the_checkpoint_without_side_effects() {
        let env = env();
        let sharing = Arc::new(Recording::default());
        let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_1);
        let c = time_sliced_claim(&env, "a", "uid-a", "gpu-1");
        let first = driver.prepare(&c).await.expect("prepares");
        assert_eq!(
            on_disk(&env).claims["uid-a"].boot_id.as_deref(),
            Some(BOOT_1)
        );
        let spec = std::fs::read(spec_path(&env, "uid-a")).expect("spec");
        std::fs::write(spec_path(&env, "uid-a"), b"marker").expect("mark");
        env.claims.remove("ns", "a");

        let restarted =
            recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_1);
        assert_eq!(restarted.prepare(&c).await.expect("repeat"), first);
        assert_eq!(sharing.calls(), ["apply uid-a"], "sharing applied once");
        assert_eq!(
            std::fs::read(spec_path(&env, "uid-a")).expect("spec"),
            b"marker",
            "the spec is not rewritten"
        );
        assert_ne!(spec, b"marker");
    }

    #[tokio::test]
    async fn a_missing_spec_is_regenerated_by_the_repeat_prepare_with_the_same_answer() {
        let env = env();
        let sharing = Arc::new(Recording::default());
        let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_1);
        let c = time_sliced_claim(&env, "a", "uid-a", "gpu-1");
        let first = driver.prepare(&c).await.expect("prepares");
        let spec = std::fs::read(spec_path(&env, "uid-a")).expect("spec");
        // The CDI root is a tmpfs that was emptied.
        std::fs::remove_dir_all(env.dir.path().join("cdi")).expect("wipe");

        assert_eq!(driver.prepare(&c).await.expect("repeat"), first);
        assert_eq!(
            std::fs::read(spec_path(&env, "uid-a")).expect("spec back"),
            spec
        );
        assert_eq!(
            sharing.calls(),
            ["apply uid-a", "release uid-a", "apply uid-a"],
            "sharing undone and applied again"
        );
        let cp = on_disk(&env);
        assert_eq!(cp.claims["uid-a"].state, PrepareState::PrepareCompleted);
        assert_eq!(cp.claims["uid-a"].devices, first);
    }

    #[tokio::test]
    async fn after_a_reboot_sharing_is_reapplied_and_the_spec_rewritten() {
        let env = env();
        let sharing = Arc::new(Recording::default());
        let driver = recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_1);
        let c = time_sliced_claim(&env, "a", "uid-a", "gpu-1");
        let first = driver.prepare(&c).await.expect("prepares");
        std::fs::write(spec_path(&env, "uid-a"), b"old boot").expect("mark");

        let rebooted =
            recording_driver(env.dir.path(), env.claims.clone(), sharing.clone(), BOOT_2);
        assert_eq!(rebooted.prepare(&c).await.expect("repeat"), first);
        assert_eq!(
            sharing.calls(),
            ["apply uid-a", "release uid-a", "apply uid-a"]
        );
        let spec = std::fs::read(spec_path(&env, "uid-a")).expect("spec");
        assert_ne!(spec, b"old boot", "spec rewritten");
        assert_eq!(
            on_disk(&env).claims["uid-a"].boot_id.as_deref(),
            Some(BOOT_2)
        );
        // Now current: the next repeat is answered from the checkpoint.
        assert_eq!(rebooted.prepare(&c).await.expect("again"), first);
        assert_eq!(sharing.calls().len(), 3);
    }

    #[tokio::test]
    async fn claims_nvidia_prepared_are_reserved_and_answered_with_their_devices() {
        let (env, sharing, driver) = nvidia_node();
        assert_eq!(driver.imported_mps_daemons(), [format!("{NV_MPS}-4e1a9")]);
        // gpu-1 is held by NVIDIA's time-sliced claim.
        let other = add(&env, "other", "uid-other", &[("gpu", "gpu-1")]);
        let err = driver.prepare(&other).await.expect_err("held").to_string();
        assert!(
            err.contains(NV_TIME_SLICED) && err.contains("team-a/train"),
            "{err}"
        );

        let c = ClaimRef {
            namespace: "team-a".into(),
            name: "train".into(),
            uid: NV_TIME_SLICED.into(),
        };
        let devices = driver.prepare(&c).await.expect("answered");
        assert_eq!(
            devices[0].cdi_device_ids,
            [format!("k8s.gpu.nvidia.com/claim={NV_TIME_SLICED}-gpu-1")]
        );
        assert_eq!(devices[0].device, "gpu-1");
        assert!(sharing.calls().is_empty(), "answered without side effects");
        assert!(
            !spec_path(&env, NV_TIME_SLICED).exists(),
            "NVIDIA's spec serves it"
        );
    }

    #[tokio::test]
    async fn an_imported_claim_whose_spec_is_gone_is_prepared_again_by_us() {
        let (env, _sharing, driver) = nvidia_node();
        std::fs::remove_file(nvidia_spec(&env, NV_TIME_SLICED)).expect("wipe");
        let ts = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}});
        env.claims.insert(allocated_claim(
            "team-a",
            "train",
            NV_TIME_SLICED,
            DRIVER,
            NODE,
            &[("gpu", "gpu-1")],
            &[("FromClaim", &["gpu"], ts)],
        ));
        let c = ClaimRef {
            namespace: "team-a".into(),
            name: "train".into(),
            uid: NV_TIME_SLICED.into(),
        };
        let devices = driver.prepare(&c).await.expect("prepared again");
        assert_eq!(
            devices[0].cdi_device_ids,
            [format!("k8s.gpu.nvidia.com/claim={NV_TIME_SLICED}-gpu-1")]
        );
        assert!(spec_path(&env, NV_TIME_SLICED).exists());
        let entry = &driver.checkpoint().claims[NV_TIME_SLICED];
        assert!(entry.imported.is_none(), "ours from now on");
        assert_eq!(entry.boot_id.as_deref(), Some(NV_BOOT));
    }

    /// A claim source that holds every `get` until the test lets it through, and records how
    /// many run at once: a prepare calls `get` with its claim's lock held, so two at once for
    /// one claim mean two operations on it at once.
    struct GatedClaims {
        inner: Arc<MemoryClaims>,
        permits: tokio::sync::Semaphore,
        entered: tokio::sync::mpsc::UnboundedSender<()>,
        now: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
    }

    impl ClaimSource for GatedClaims {
        fn get<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> futures::future::BoxFuture<
            'a,
            Result<Option<k8s_openapi::api::resource::v1::ResourceClaim>, ClaimSourceError>,
        > {
            use std::sync::atomic::Ordering::SeqCst;
            Box::pin(async move {
                let now = self.now.fetch_add(1, SeqCst) + 1;
                self.most.fetch_max(now, SeqCst);
                let _ = self.entered.send(());
                let permit = self.permits.acquire().await;
                permit.map(|p| p.forget()).ok();
                self.now.fetch_sub(1, SeqCst);
                self.inner.get(namespace, name).await
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_prepare_the_kubelet_cancels_is_no_longer_counted_in_flight() {
        let dir = tempfile::tempdir().expect("tempdir");
        simulate_host(&dir.path().join("host"), &a100_inventory(4, 1)).expect("host");
        let memory = Arc::new(MemoryClaims::default());
        memory.insert(allocated_claim(
            "ns",
            "a",
            "uid-a",
            DRIVER,
            NODE,
            &[("gpu", "gpu-1")],
            &[],
        ));
        let (entered, mut entries) = tokio::sync::mpsc::unbounded_channel();
        let gated = Arc::new(GatedClaims {
            inner: memory,
            permits: tokio::sync::Semaphore::new(0),
            entered,
            now: Default::default(),
            most: Default::default(),
        });
        let driver = Arc::new(
            DriverBuilder::new(dir.path(), a100_inventory(4, 1))
                .node_name(NODE)
                .claims(gated)
                .checkpoint_path(dir.path().join(gpu_dra_core::checkpoint::FILE_NAME))
                .build()
                .expect("driver"),
        );
        let a = ClaimRef {
            namespace: "ns".into(),
            name: "a".into(),
            uid: "uid-a".into(),
        };
        // The kubelet's call ends (its deadline, a cancel) while the claim is being read: tonic
        // drops the call's future.
        let call = {
            let driver = driver.clone();
            tokio::spawn(async move { driver.prepare(&a).await.map(drop) })
        };
        entries.recv().await.expect("the prepare reads the claim");
        assert_eq!(driver.metrics().in_flight.get(), 1);
        call.abort();
        assert!(call.await.expect_err("aborted").is_cancelled());
        assert_eq!(driver.metrics().in_flight.get(), 0, "the gauge leaked");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_claim_never_has_two_operations_at_once_while_others_wait_for_its_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        simulate_host(&dir.path().join("host"), &a100_inventory(4, 1)).expect("host");
        let memory = Arc::new(MemoryClaims::default());
        memory.insert(allocated_claim(
            "ns",
            "a",
            "uid-a",
            DRIVER,
            NODE,
            &[("gpu", "gpu-1")],
            &[],
        ));
        let (entered, mut entries) = tokio::sync::mpsc::unbounded_channel();
        let gated = Arc::new(GatedClaims {
            inner: memory,
            permits: tokio::sync::Semaphore::new(0),
            entered,
            now: Default::default(),
            most: Default::default(),
        });
        let driver = Arc::new(
            DriverBuilder::new(dir.path(), a100_inventory(4, 1))
                .node_name(NODE)
                .claims(gated.clone())
                .checkpoint_path(dir.path().join(gpu_dra_core::checkpoint::FILE_NAME))
                .build()
                .expect("driver"),
        );
        let a = ClaimRef {
            namespace: "ns".into(),
            name: "a".into(),
            uid: "uid-a".into(),
        };
        let spawn = |op: &'static str| {
            let (driver, a) = (driver.clone(), a.clone());
            tokio::spawn(async move {
                match op {
                    "prepare" => driver.prepare(&a).await.map(drop),
                    _ => driver.unprepare(&a).await,
                }
            })
        };
        // An operation counts itself in flight and waits for the claim's lock in one step:
        // once the gauge shows it, it is queued.
        let queued = |n: i64| {
            let driver = driver.clone();
            async move {
                while driver.metrics().in_flight.get() < n {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            }
        };
        // A prepare holds the claim's lock inside `get`; an unprepare and then a second
        // prepare queue behind it, in that order.
        let first = spawn("prepare");
        entries.recv().await.expect("first prepare reads the claim");
        let unprepare = spawn("unprepare");
        queued(2).await;
        let second = spawn("prepare");
        queued(3).await;
        gated.permits.add_permits(1);
        first.await.expect("joins").expect("first prepare");
        // The unprepare runs and finishes; the second prepare now holds the lock in `get`.
        unprepare.await.expect("joins").expect("unprepare");
        entries
            .recv()
            .await
            .expect("second prepare reads the claim");
        // A third operation must wait for the second instead of running beside it.
        let third = spawn("prepare");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        gated.permits.add_permits(2);
        second.await.expect("joins").expect("second prepare");
        third.await.expect("joins").expect("third prepare");
        assert_eq!(
            gated.most.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "two operations ran on one claim at once"
        );
        assert!(
            driver.claim_locks.is_empty(),
            "no lock is kept once no one uses it"
        );
    }

    #[tokio::test]
    async fn a_failed_prepare_that_is_never_unprepared_leaves_no_lock_behind() {
        let env = env();
        let missing = ClaimRef {
            namespace: "ns".into(),
            name: "nope".into(),
            uid: "uid-nope".into(),
        };
        env.driver.prepare(&missing).await.expect_err("not found");
        let a = add(&env, "a", "uid-a", &[("gpu", "gpu-1")]);
        env.driver.prepare(&a).await.expect("prepares");
        env.driver.reconcile().await;
        assert!(
            env.driver.claim_locks.is_empty(),
            "locks of claims no operation uses are dropped"
        );
    }

    #[tokio::test]
    async fn sharing_on_an_admin_access_request_is_refused_naming_the_request() {
        let env = env();
        let ts = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "TimeSlicing"}});
        let c = add_admin(
            &env,
            "watch",
            "uid-watch",
            "gpu-1",
            &[("FromClaim", &["gpu"], ts)],
        );
        let err = env
            .driver
            .prepare(&c)
            .await
            .expect_err("refused")
            .to_string();
        assert_eq!(
            err,
            format!(
                "status.allocation.devices.config[0].opaque.parameters.{}",
                gpu_dra_api::admin_access_sharing("gpu")
            )
        );
        assert!(
            err.contains("\"gpu\"") && err.contains("adminAccess"),
            "{err}"
        );
        assert!(!spec_path(&env, "uid-watch").exists());
        assert!(env.driver.checkpoint().claims.is_empty());
    }
}
