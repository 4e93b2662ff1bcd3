//! Fault injection: the real plugin binary is SIGKILLed at every step of prepare and
//! unprepare, restarted, and the kubelet's call is repeated over the real socket; then CDI
//! specs and the checkpoint must agree with what the kubelet was told.
//!
//! Each failpoint is set to `pause`, so the process stops exactly at that step; the test then
//! kills it with SIGKILL (`Child::kill`). Prints steps x runs and the inconsistencies found.
//! Run once as the plugin runs by default and once with `--device-metadata`, whose files must
//! be exactly those the specs mount.
//!
//! The checkpoint's durable state is the file with its journal's records replayed over it
//! (the driver's `journal`): the checks read both. Two more cases aim at the journal: a kill
//! between a commit's journal record and its compaction into the file, and a kill that tore
//! the last record.

use std::collections::BTreeSet;
use std::path::Path;

use gpu_dra_core::checkpoint::{Checkpoint, PrepareState};
use gpu_dra_device::testing::a100_inventory;
use gpu_dra_kubelet_plugin::failpoint::{METADATA_STEPS, STEPS};
use gpu_dra_kubelet_plugin::testing::{PluginCommand, allocated_claim, connect_dra, simulate_host};
use gpu_dra_proto::dra::v1;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";
const RUNS: usize = 2;

/// The plugin on `root`: its inventory from `root/inventory.json`, claims from `claims.json`.
fn plugin_on(root: &Path) -> PluginCommand {
    PluginCommand::new(env!("CARGO_BIN_EXE_gpu-kubelet-plugin"), root)
        .node_name(NODE)
        .inventory_fixture(&root.join("inventory.json"))
        .log_level("info")
}

const UID_A: &str = "a0000000-0000-4000-8000-00000000000a";
const UID_B: &str = "b0000000-0000-4000-8000-00000000000b";

fn claims() -> Vec<v1::Claim> {
    vec![
        v1::Claim {
            namespace: "ns".into(),
            uid: UID_A.into(),
            name: "a".into(),
        },
        v1::Claim {
            namespace: "ns".into(),
            uid: UID_B.into(),
            name: "b".into(),
        },
    ]
}

async fn prepare(cmd: &PluginCommand) -> Result<v1::NodePrepareResourcesResponse, String> {
    let mut client = connect_dra(cmd.socket()).await.map_err(|e| e.to_string())?;
    client
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: claims() })
        .await
        .map(|r| r.into_inner())
        .map_err(|e| e.to_string())
}

async fn unprepare(cmd: &PluginCommand) -> Result<v1::NodeUnprepareResourcesResponse, String> {
    let mut client = connect_dra(cmd.socket()).await.map_err(|e| e.to_string())?;
    client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims: claims() })
        .await
        .map(|r| r.into_inner())
        .map_err(|e| e.to_string())
}

fn specs_on_disk(cmd: &PluginCommand) -> BTreeSet<String> {
    std::fs::read_dir(cmd.cdi_dir())
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The device metadata files in the plugin folder, by host path.
fn metadata_on_disk(cmd: &PluginCommand) -> BTreeSet<String> {
    let dir = gpu_dra_kubelet_plugin::node_layout::device_metadata_dir_in(&cmd.plugin_dir());
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The host paths the metadata devices of a spec mount.
fn metadata_mounted(spec: &serde_json::Value) -> BTreeSet<String> {
    spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|d| d["name"].as_str().is_some_and(|n| n.contains("_metadata_")))
        .flat_map(|d| {
            d["containerEdits"]["mounts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|m| m["hostPath"].as_str().map(str::to_owned))
        .collect()
}

fn checkpoint(cmd: &PluginCommand) -> Checkpoint {
    gpu_dra_kubelet_plugin::driver::durable_checkpoint(&checkpoint_path(cmd))
        .expect("checkpoint and journal parse")
}

fn checkpoint_path(cmd: &PluginCommand) -> std::path::PathBuf {
    cmd.plugin_dir().join(gpu_dra_core::checkpoint::FILE_NAME)
}

fn journal_path(cmd: &PluginCommand) -> std::path::PathBuf {
    cmd.plugin_dir()
        .join(gpu_dra_core::checkpoint::JOURNAL_FILE_NAME)
}

/// The checkpoint file alone, as an older version reads it.
fn file_alone(cmd: &PluginCommand) -> Checkpoint {
    std::fs::read(checkpoint_path(cmd))
        .map(|b| Checkpoint::from_json(&b).expect("checkpoint parses"))
        .unwrap_or_else(|_| Checkpoint::new())
}

fn journal_records(cmd: &PluginCommand) -> Vec<Vec<u8>> {
    gpu_dra_fsutil::record_log::read(&journal_path(cmd))
        .expect("journal reads")
        .records
}

/// After a successful prepare answer: both claims completed, a spec per claim whose devices
/// are exactly the answered CDI IDs, nothing else.
fn check_prepared(cmd: &PluginCommand, answer: &v1::NodePrepareResourcesResponse) -> Vec<String> {
    let mut problems = Vec::new();
    let cp = checkpoint(cmd);
    let mut mounted = BTreeSet::new();
    for c in claims() {
        let Some(r) = answer.claims.get(&c.uid) else {
            problems.push(format!("{}: missing from the answer", c.uid));
            continue;
        };
        if !r.error.is_empty() {
            problems.push(format!("{}: error {}", c.uid, r.error));
            continue;
        }
        match cp.claims.get(&c.uid) {
            Some(e) if e.state == PrepareState::PrepareCompleted => {}
            other => problems.push(format!("{}: checkpoint entry {other:?}", c.uid)),
        }
        let spec_path = cmd
            .cdi_dir()
            .join(format!("k8s.gpu.nvidia.com-claim_{}.json", c.uid));
        let Ok(bytes) = std::fs::read(&spec_path) else {
            problems.push(format!("{}: no CDI spec", c.uid));
            continue;
        };
        let spec: serde_json::Value = serde_json::from_slice(&bytes).expect("spec is JSON");
        mounted.extend(metadata_mounted(&spec));
        let in_spec: BTreeSet<String> = spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| {
                format!(
                    "k8s.gpu.nvidia.com/claim={}",
                    d["name"].as_str().unwrap_or_default()
                )
            })
            .collect();
        let answered: BTreeSet<String> = r
            .devices
            .iter()
            .flat_map(|d| d.cdi_device_ids.clone())
            .collect();
        if in_spec != answered {
            problems.push(format!(
                "{}: spec has {in_spec:?}, kubelet got {answered:?}",
                c.uid
            ));
        }
    }
    if cp.claims.len() != 2 {
        problems.push(format!("checkpoint has {} claims", cp.claims.len()));
    }
    if specs_on_disk(cmd).len() != 2 {
        problems.push(format!("CDI root holds {:?}", specs_on_disk(cmd)));
    }
    // Every file a spec mounts is there and reads as metadata; no other file is.
    for path in &mounted {
        let read = std::fs::read(path)
            .map_err(|e| e.to_string())
            .and_then(|b| gpu_dra_core::device_metadata::decode(&b).map_err(|e| e.to_string()));
        if let Err(e) = read {
            problems.push(format!("metadata file {path}: {e}"));
        }
    }
    if metadata_on_disk(cmd) != mounted {
        problems.push(format!(
            "metadata files {:?}, specs mount {mounted:?}",
            metadata_on_disk(cmd)
        ));
    }
    problems
}

fn check_unprepared(
    cmd: &PluginCommand,
    answer: &v1::NodeUnprepareResourcesResponse,
) -> Vec<String> {
    let mut problems = Vec::new();
    for c in claims() {
        match answer.claims.get(&c.uid) {
            Some(r) if r.error.is_empty() => {}
            other => problems.push(format!("{}: unprepare answer {other:?}", c.uid)),
        }
    }
    let cp = checkpoint(cmd);
    if !cp.claims.is_empty() {
        problems.push(format!(
            "checkpoint still has {:?}",
            cp.claims.keys().collect::<Vec<_>>()
        ));
    }
    if !specs_on_disk(cmd).is_empty() {
        problems.push(format!("CDI root still holds {:?}", specs_on_disk(cmd)));
    }
    if !metadata_on_disk(cmd).is_empty() {
        problems.push(format!(
            "metadata files still there: {:?}",
            metadata_on_disk(cmd)
        ));
    }
    problems
}

/// A node with the inventory and the two claims of [`claims`].
fn node(dir: &Path) -> PluginCommand {
    let cmd = plugin_on(dir);
    let inventory = a100_inventory(4, 1);
    simulate_host(&cmd.root().join("host"), &inventory).expect("host");
    std::fs::write(
        cmd.root().join("inventory.json"),
        serde_json::to_vec(&inventory).expect("json"),
    )
    .expect("inventory");
    let claim_objs = vec![
        allocated_claim("ns", "a", UID_A, DRIVER, NODE, &[("gpu", "gpu-1")], &[]),
        allocated_claim(
            "ns",
            "b",
            UID_B,
            DRIVER,
            NODE,
            &[
                ("mig", "gpu-0-mig-1g5gb-19-0"),
                ("mig", "gpu-0-mig-1g5gb-19-1"),
            ],
            &[],
        ),
    ];
    std::fs::write(
        cmd.claims_file(),
        serde_json::to_vec(&claim_objs).expect("json"),
    )
    .expect("claims");
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_every_step_leaves_cdi_and_checkpoint_consistent() {
    let dir = tempfile::tempdir().expect("tempdir");
    kill_at_every_step(&node(dir.path()), STEPS, RUNS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_every_step_with_device_metadata_leaves_files_that_the_specs_mount() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cmd = node(dir.path()).env("DEVICE_METADATA", "true");
    // Once each: the test without metadata runs the common steps more often.
    let steps: Vec<&str> = METADATA_STEPS.iter().chain(STEPS).copied().collect();
    kill_at_every_step(&cmd, &steps, 1).await;
    // The files are there while the claims are prepared.
    let mut plugin = cmd.respawn("").expect("plugin starts");
    cmd.wait_for(&cmd.socket(), "socket");
    let answer = prepare(&cmd).await.expect("prepare");
    assert!(check_prepared(&cmd, &answer).is_empty());
    assert_eq!(metadata_on_disk(&cmd).len(), 2, "one request per claim");
    unprepare(&cmd).await.expect("unprepare");
    plugin.kill().expect("kill");
    plugin.wait().expect("wait");
}

/// Kills the plugin of `cmd` at each of `steps`, `runs_wanted` times, and checks the node after the
/// kubelet's repeated call.
#[expect(
    clippy::print_stdout,
    reason = "a helper of two tests, printing their figures as the tests themselves may"
)]
async fn kill_at_every_step(cmd: &PluginCommand, steps: &[&str], runs_wanted: usize) {
    let mut inconsistencies = Vec::new();
    let mut runs = 0;
    for run in 0..runs_wanted {
        for step in steps {
            runs += 1;
            let is_prepare = step.starts_with("prepare.");
            if !is_prepare {
                // Start from a prepared state.
                let mut plugin = cmd.respawn("").expect("plugin starts");
                cmd.wait_for(&cmd.socket(), "socket");
                let answer = prepare(cmd).await.expect("setup prepare");
                inconsistencies.extend(
                    check_prepared(cmd, &answer)
                        .into_iter()
                        .map(|p| format!("{step} setup: {p}")),
                );
                plugin.kill().expect("kill");
                plugin.wait().expect("wait");
            }
            let mut plugin = cmd
                .respawn(&format!("{step}=pause"))
                .expect("plugin starts");
            cmd.wait_for(&cmd.socket(), "socket");
            let call = {
                let cmd = cmd.clone();
                tokio::spawn(async move {
                    if is_prepare {
                        prepare(&cmd).await.map(|_| ())
                    } else {
                        unprepare(&cmd).await.map(|_| ())
                    }
                })
            };
            cmd.wait_for(&cmd.failpoint_marker(), step);
            plugin.kill().expect("SIGKILL");
            plugin.wait().expect("reaped");
            let _ = call.await;

            // Restart and repeat the kubelet's call, as the kubelet does after an error.
            let mut plugin = cmd.respawn("").expect("plugin starts");
            cmd.wait_for(&cmd.socket(), "socket after restart");
            let problems = if is_prepare {
                match prepare(cmd).await {
                    Ok(answer) => check_prepared(cmd, &answer),
                    Err(e) => vec![format!("retry failed: {e}")],
                }
            } else {
                match unprepare(cmd).await {
                    Ok(answer) => check_unprepared(cmd, &answer),
                    Err(e) => vec![format!("retry failed: {e}")],
                }
            };
            inconsistencies.extend(
                problems
                    .into_iter()
                    .map(|p| format!("run {run} {step}: {p}")),
            );
            // Back to a clean node for the next step.
            if is_prepare {
                let answer = unprepare(cmd).await.expect("cleanup unprepare");
                inconsistencies.extend(
                    check_unprepared(cmd, &answer)
                        .into_iter()
                        .map(|p| format!("run {run} {step} cleanup: {p}")),
                );
            }
            plugin.kill().expect("kill");
            plugin.wait().expect("wait");
        }
    }
    println!(
        "crash consistency: {} steps x {runs_wanted} runs = {runs} kills, {} inconsistencies",
        steps.len(),
        inconsistencies.len()
    );
    for i in &inconsistencies {
        println!("  {i}");
    }
    assert!(inconsistencies.is_empty(), "{inconsistencies:#?}");
}

/// How many times a case retries to kill the plugin before its journal is compacted (it is
/// compacted after 0.2 s without commits; a kill right after the answer is far sooner,
/// unless the machine stalls).
const WINDOW_TRIES: usize = 5;

/// Prepares both claims and SIGKILLs the plugin at once, while the commits are journal
/// records only; false when the journal was compacted before the kill (a stalled machine).
async fn prepare_and_kill_before_compaction(cmd: &PluginCommand) -> bool {
    let mut plugin = cmd.respawn("").expect("plugin starts");
    cmd.wait_for(&cmd.socket(), "socket");
    let answer = prepare(cmd).await.expect("prepare");
    plugin.kill().expect("SIGKILL");
    plugin.wait().expect("reaped");
    let problems = check_prepared(cmd, &answer);
    assert!(problems.is_empty(), "{problems:#?}");
    !journal_records(cmd).is_empty()
}

/// Restarts the plugin after a kill and unprepares both claims, checking each step.
async fn restart_and_unprepare(cmd: &PluginCommand) {
    let mut plugin = cmd.respawn("").expect("plugin starts");
    cmd.wait_for(&cmd.socket(), "socket after restart");
    let answer = unprepare(cmd).await.expect("unprepare");
    let problems = check_unprepared(cmd, &answer);
    assert!(problems.is_empty(), "{problems:#?}");
    plugin.kill().expect("kill");
    plugin.wait().expect("wait");
}

/// Prepares both claims and SIGKILLs the plugin before its journal is compacted, trying
/// again (after undoing the try) up to [`WINDOW_TRIES`] times.
async fn kill_before_compaction(cmd: &PluginCommand) {
    for _ in 0..WINDOW_TRIES {
        if prepare_and_kill_before_compaction(cmd).await {
            return;
        }
        restart_and_unprepare(cmd).await;
    }
    panic!("the plugin was never killed before its journal was compacted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_a_journal_record_and_its_compaction_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cmd = node(dir.path());
    kill_before_compaction(&cmd).await;
    let durable = checkpoint(&cmd);
    assert_ne!(
        file_alone(&cmd),
        durable,
        "the completed claims are in the journal only"
    );

    // The restart folds the journal into the file and answers the repeated prepare from it.
    let mut plugin = cmd.respawn("").expect("plugin starts");
    cmd.wait_for(&cmd.socket(), "socket after restart");
    let answer = prepare(&cmd).await.expect("repeated prepare");
    let problems = check_prepared(&cmd, &answer);
    assert!(problems.is_empty(), "{problems:#?}");
    // Answered once the plugin took over the node, which loads the checkpoint.
    assert_eq!(
        file_alone(&cmd),
        durable,
        "the file alone is exact after the start"
    );
    assert!(journal_records(&cmd).is_empty());
    plugin.kill().expect("kill");
    plugin.wait().expect("wait");
    restart_and_unprepare(&cmd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_that_tore_the_last_journal_record_is_repaired_by_the_repeated_call() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cmd = node(dir.path());
    kill_before_compaction(&cmd).await;
    // The kill hit while the last record was written: its end never reached the disk, so
    // the kubelet was never told that commit succeeded and repeats its call.
    let records = journal_records(&cmd);
    let path = journal_path(&cmd);
    let mut bytes = std::fs::read(&path).expect("journal");
    let end = bytes.iter().rposition(|&b| b != 0).expect("records");
    bytes[end - 3..=end].fill(0);
    std::fs::write(&path, bytes).expect("tear");
    assert_eq!(
        journal_records(&cmd).len(),
        records.len() - 1,
        "the torn record does not read"
    );
    let before = checkpoint(&cmd);
    assert_ne!(
        before
            .claims
            .values()
            .filter(|e| e.state == PrepareState::PrepareCompleted)
            .count(),
        2,
        "a completion was in the torn record"
    );

    let mut plugin = cmd.respawn("").expect("plugin starts");
    cmd.wait_for(&cmd.socket(), "socket after restart");
    let answer = prepare(&cmd).await.expect("repeated prepare");
    let problems = check_prepared(&cmd, &answer);
    assert!(problems.is_empty(), "{problems:#?}");
    plugin.kill().expect("kill");
    plugin.wait().expect("wait");
    restart_and_unprepare(&cmd).await;
}
