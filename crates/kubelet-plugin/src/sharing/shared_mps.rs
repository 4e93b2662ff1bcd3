//! The MPS control daemon of a shared device: one per memory-share GPU, or per GPU or MIG
//! device under consumable shares, shared by every claim that holds a share of it with an MPS
//! config, reference counted by claim. (NVIDIA's driver refuses MPS under consumable shares;
//! here a share's MPS clients join the device's one daemon.)
//!
//! A MIG device's daemon serves that MIG device alone and changes no compute mode (MIG
//! devices have none), as a claim's own daemon on MIG devices does.
//!
//! Why one daemon and client-side limits: a GPU in MPS mode is in compute mode
//! `EXCLUSIVE_PROCESS`, owned by one MPS server, so claims sharing it must join the same
//! daemon, and their clients the same server. Per-server limits would then apply to every
//! claim alike, so the daemon sets no defaults of its own (MPS's defaults: 100% of the
//! threads, no pinned memory limit) and each claim's containers carry their limits in
//! their environment (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`,
//! see `gpu_dra_core::sharing::mps_share_env`), which MPS applies to that client; a client's
//! variables can only lower the daemon's defaults. Consequence: the limits hold for workloads
//! that keep the environment they are given; a container that unsets them is bounded only by
//! the daemon's defaults, i.e. the whole GPU (docs/STATUS.md).
//!
//! Users: claims' pods may run as different users, and an MPS daemon runs one user's server
//! at a time (a client of another user waits until that server's clients are gone), so a
//! second user's pod would hang until the first user's pods end. The daemon therefore runs
//! multi-user (`-M`, one server for all users) where the GPU supports it (compute capability
//! 7.0 and newer, [`gpu_dra_core::memory_shares::MemoryShare::multi_user_mps`]). On older GPUs
//! it cannot, and the plugin cannot refuse the second user's claim either: prepare does not
//! know which user the claim's pods will run as (docs/STATUS.md).
//!
//! Tenancy: one namespace per daemon at a time. Every client of the daemon reaches its
//! `control` socket (a CUDA client must: that is how it asks for its server), and that socket
//! also takes the control front end's commands; the real daemon runs `quit` and
//! `shutdown_server` for a root peer, and it cannot tell a tenant's root container from the
//! operator. So any client of a shared daemon can stop it, and with it every other client's
//! work. What the plugin can take away it does: clients get the pipe directory read-only (no
//! container can replace `control` with a listener of its own for other clients to connect
//! to, or delete it) and no `nvidia-cuda-mps-control` (see `gpu_dra_core::sharing`). What
//! remains, a root container speaking the control protocol itself, is kept inside one tenant:
//! a claim of another namespace than the one the daemon serves is refused at prepare with a
//! [`SharingError::Conflict`] naming both, which the kubelet retries, so its pod starts once
//! the first namespace's claims on the device are gone. Namespaces, because they are the
//! unit Kubernetes gives tenants (quotas, RBAC); pods of one namespace can already reach each
//! other's claims. Rejected: a daemon per namespace on one device (a GPU in MPS mode is in
//! `EXCLUSIVE_PROCESS`, owned by one MPS server, see above); a proxy in front of `control`
//! passing only client connections (the client protocol is NVIDIA's and undocumented, and
//! carries file descriptors); relying on pods not running as root (the plugin cannot see,
//! at prepare, which user the claim's pods will run as). The scheduler does not know the
//! rule: it may give a second namespace a share of a device whose daemon serves the first,
//! and that claim's pod then waits (docs/STATUS.md).
//!
//! Record and lifecycle: the daemon's [`MpsRecord`] has owner
//! [`MEMORY_SHARE_DAEMON_OWNER`] and the GPU's UUID as group, and lists its claims in
//! `share_claims`. The first claim records itself and starts the daemon (same steps,
//! supervision and restart-survival as a claim's own daemon, see [`super::supervise`]); later
//! claims only add themselves; an unprepare removes its claim and stops the daemon (compute
//! mode back to `DEFAULT`) once none is left. All of it under one lock, so a claim arriving
//! while the last one leaves never finds a daemon that is being stopped.

use gpu_dra_api::MpsConfig;
use gpu_dra_core::cdi::ContainerEdits;
use gpu_dra_core::sharing::{
    MEMORY_SHARE_DAEMON_OWNER, MpsLimits, SharedDevice, daemon_id, mps_share_env,
};
use tracing::info;

use super::error::SharingError;
use super::manager::{SharingManager, check_name, lock};
use super::mps;
use super::state::{MpsPhase, MpsRecord};
use super::supervise::client_edits;

impl SharingManager {
    /// Joins `claim_uid` to the MPS daemon of the shared device `device` (a memory-share GPU,
    /// or a GPU or MIG device under consumable shares), starting it when it is the first
    /// claim, and returns the edits of its clients: the pipe directory and the claim's own
    /// limits. Idempotent.
    pub(super) async fn prepare_mps_share(
        &self,
        namespace: &str,
        claim_uid: &str,
        device: &SharedDevice,
        config: &MpsConfig,
    ) -> Result<ContainerEdits, SharingError> {
        let Some(share) = device.share else {
            return Err(SharingError::InvalidRequest {
                field: "devices".into(),
                message: format!("{} is not a memory share", device.uuid),
            });
        };
        check_name("device UUID", &device.uuid)?;
        let inner = &self.inner;
        let id = daemon_id(MEMORY_SHARE_DAEMON_OWNER, &device.uuid);
        let edits = |record: &MpsRecord| {
            let mut edits = client_edits(record);
            edits.env.extend(mps_share_env(config, device, &share));
            edits
        };
        let _guard = inner.share_lock.lock().await;

        let existing = lock(&inner.state).mps.get(&id).cloned();
        if let Some(record) = existing {
            if record.phase == MpsPhase::Ready {
                check_tenant(&record, namespace, &device.uuid)?;
                inner.update(|s| {
                    if let Some(r) = s.mps.get_mut(&id) {
                        r.share_claims.insert(claim_uid.to_owned());
                    }
                })?;
                if !lock(&inner.supervised).contains_key(&id) {
                    // Recorded ready but not watched (its restart failed earlier): start it
                    // again for everyone on it.
                    let proc = inner.start_daemon(&id, &record, false).await?;
                    inner.supervise(&id, proc);
                }
                info!(claim.uid = %claim_uid, daemon = %id, "joined the memory-share MPS daemon");
                return Ok(edits(&record));
            }
            // Left half started or half stopped by a crash: finish that first.
            inner.teardown_mps(&id).await?;
        }

        let gpu = device.uuid.clone();
        // A whole GPU goes to EXCLUSIVE_PROCESS under its daemon; a MIG device has no compute
        // mode of its own.
        let whole_gpus = if device.mig {
            Vec::new()
        } else {
            vec![gpu.clone()]
        };
        let record = MpsRecord {
            claim_uid: MEMORY_SHARE_DAEMON_OWNER.to_owned(),
            group: gpu.clone(),
            phase: MpsPhase::Starting,
            pid: None,
            dir: inner.opts.daemon_dir(MEMORY_SHARE_DAEMON_OWNER, &gpu),
            // Multi-user where the GPU allows it, so pods of different users all get on;
            // below Volta one user's pods at a time (docs/STATUS.md).
            limits: MpsLimits {
                multi_user: share.multi_user_mps(),
                ..MpsLimits::default()
            },
            devices: vec![gpu.clone()],
            whole_gpus,
            share_claims: [claim_uid.to_owned()].into(),
            namespace: Some(namespace.to_owned()),
        };
        mps::check_socket_path(&record)?;
        inner.record_mps(&id, &record, claim_uid)?;
        inner
            .start_recorded(
                &id,
                &record,
                claim_uid,
                "memory-share MPS control daemon ready",
            )
            .await?;
        Ok(edits(&record))
    }

    /// Removes `claim_uid` from the memory-share daemons it joined; stops each daemon that it
    /// leaves without claims. Idempotent.
    pub(super) async fn unprepare_mps_shares(&self, claim_uid: &str) -> Result<(), SharingError> {
        let inner = &self.inner;
        let _guard = inner.share_lock.lock().await;
        let emptied = inner.update(|s| {
            let mut emptied = Vec::new();
            for (id, r) in s.mps.iter_mut().filter(|(_, r)| r.is_memory_share()) {
                if r.share_claims.remove(claim_uid) && r.share_claims.is_empty() {
                    emptied.push(id.clone());
                }
            }
            emptied
        })?;
        let mut first_error = None;
        for id in emptied {
            info!(claim.uid = %claim_uid, daemon = %id, "last claim of a memory-share GPU gone; stopping its MPS daemon");
            if let Err(e) = inner.teardown_mps(&id).await {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Refuses a claim of `namespace` on the shared daemon `record` of device `uuid` when the
/// daemon serves another namespace (see the module documentation). A daemon recorded without
/// a namespace (by a version without the rule) takes any.
fn check_tenant(record: &MpsRecord, namespace: &str, uuid: &str) -> Result<(), SharingError> {
    match record.namespace.as_deref() {
        Some(holder) if holder != namespace => Err(SharingError::Conflict {
            gpu: uuid.to_owned(),
            holder: format!("MPS clients of namespace {holder:?}"),
            wanted: format!(
                "MPS clients of namespace {namespace:?}: one MPS daemon serves one namespace at a \
                 time, since any of its clients can stop it; the claim is prepared once namespace \
                 {holder:?} holds no share of the device"
            ),
        }),
        _ => Ok(()),
    }
}
