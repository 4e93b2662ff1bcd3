//! The plugin binary as a child process, for process-level tests (restarts, SIGKILL), and the
//! kubelet's side of its DRA socket.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use gpu_dra_proto::dra::v1::dra_plugin_client::DraPluginClient;
use tonic::transport::{Channel, Endpoint};

use super::NODE_NAME;

/// A child process (a plugin under test) that is killed and reaped when dropped, so a
/// failed assertion leaves no process behind.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Sends SIGKILL.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.0.kill()
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> std::io::Result<ExitStatus> {
        self.0.wait()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Command line of the real plugin binary (`run`) for process-level tests, every path under
/// one root: `plugin/` (socket, checkpoint), `registry/`, `cdi/`, claims from
/// `claims.json`, stderr appended to `plugin.log`, the host in `host/` unless told otherwise.
///
/// The binary's path is an argument because only the test or example target knows it
/// (`env!("CARGO_BIN_EXE_gpu-kubelet-plugin")`).
#[derive(Debug, Clone)]
#[must_use]
pub struct PluginCommand {
    bin: PathBuf,
    root: PathBuf,
    node_name: String,
    host: PathBuf,
    sysfs_root: Option<PathBuf>,
    inventory_fixture: Option<PathBuf>,
    failpoints: String,
    log_level: String,
    boot_id_file: Option<PathBuf>,
    http_address: String,
    env: Vec<(String, String)>,
}

impl PluginCommand {
    /// The plugin `bin` with everything under `root`, on node [`NODE_NAME`], no failpoints,
    /// log level `info`.
    pub fn new(bin: impl AsRef<Path>, root: &Path) -> Self {
        PluginCommand {
            bin: bin.as_ref().to_path_buf(),
            root: root.to_path_buf(),
            node_name: NODE_NAME.into(),
            host: root.join("host"),
            sysfs_root: None,
            inventory_fixture: None,
            failpoints: String::new(),
            log_level: "info".into(),
            boot_id_file: None,
            http_address: String::new(),
            env: Vec::new(),
        }
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` on `address` (default: off).
    pub fn http_address(mut self, address: &str) -> Self {
        self.http_address = address.into();
        self
    }

    /// Sets an environment variable of the plugin (a flag's env twin).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets the node name.
    pub fn node_name(mut self, name: &str) -> Self {
        self.node_name = name.into();
        self
    }

    /// Uses `host` as driver root and dev root (e.g. a simulator's root).
    pub fn host_root(mut self, host: &Path) -> Self {
        self.host = host.to_path_buf();
        self
    }

    /// Reads PCI topology from `sysfs` instead of `/sys`.
    pub fn sysfs_root(mut self, sysfs: &Path) -> Self {
        self.sysfs_root = Some(sysfs.to_path_buf());
        self
    }

    /// Reads the inventory from a JSON file instead of NVML.
    pub fn inventory_fixture(mut self, file: &Path) -> Self {
        self.inventory_fixture = Some(file.to_path_buf());
        self
    }

    /// Sets `GPU_DRA_FAILPOINTS` (empty: none, whatever the test's own environment says).
    pub fn failpoints(mut self, failpoints: &str) -> Self {
        self.failpoints = failpoints.into();
        self
    }

    /// Reads the boot ID from `file` instead of the kernel's (to simulate a reboot).
    pub fn boot_id_file(mut self, file: &Path) -> Self {
        self.boot_id_file = Some(file.to_path_buf());
        self
    }

    /// Sets `LOG_LEVEL`.
    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = level.into();
        self
    }

    /// The root folder everything is under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The plugin folder (`<root>/plugin`).
    pub fn plugin_dir(&self) -> PathBuf {
        self.root.join("plugin")
    }

    /// The DRA socket the kubelet calls (`<root>/plugin/dra.sock`).
    pub fn socket(&self) -> PathBuf {
        crate::node_layout::dra_socket_in(&self.plugin_dir())
    }

    /// Where a `pause` failpoint records the step it stopped at
    /// (`<root>/plugin/failpoint.reached`).
    pub fn failpoint_marker(&self) -> PathBuf {
        crate::node_layout::failpoint_marker_in(&self.plugin_dir())
    }

    /// The CDI folder (`<root>/cdi`).
    pub fn cdi_dir(&self) -> PathBuf {
        self.root.join("cdi")
    }

    /// The file the plugin reads claims from, a JSON array of ResourceClaims
    /// (`<root>/claims.json`).
    pub fn claims_file(&self) -> PathBuf {
        self.root.join("claims.json")
    }

    /// The file the plugin's log goes to (`<root>/plugin.log`).
    pub fn log_file(&self) -> PathBuf {
        self.root.join("plugin.log")
    }

    /// What the plugin has logged so far (every run on this root; empty when nothing).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    /// The command, ready to spawn; opens the log file.
    pub fn command(&self) -> std::io::Result<Command> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_file())?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("run")
            .args(["--node-name", &self.node_name])
            .args(["--http-address", &self.http_address])
            .args(["--cleanup-interval", "3600"])
            .arg("--plugin-dir")
            .arg(self.plugin_dir())
            .arg("--registrar-dir")
            .arg(self.root.join("registry"))
            .arg("--cdi-root")
            .arg(self.root.join("cdi"))
            .arg("--driver-root")
            .arg(&self.host)
            .arg("--dev-root")
            .arg(&self.host)
            .arg("--claim-source-file")
            .arg(self.claims_file());
        if let Some(sysfs) = &self.sysfs_root {
            cmd.arg("--sysfs-root").arg(sysfs);
        }
        if let Some(file) = &self.inventory_fixture {
            cmd.arg("--inventory-fixture").arg(file);
        }
        if let Some(file) = &self.boot_id_file {
            cmd.arg("--boot-id-file").arg(file);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.env("GPU_DRA_FAILPOINTS", &self.failpoints)
            .env("LOG_LEVEL", &self.log_level)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        Ok(cmd)
    }

    /// Starts the plugin; it is killed when the guard is dropped.
    pub fn spawn(&self) -> std::io::Result<ChildGuard> {
        self.command()?.spawn().map(ChildGuard)
    }

    /// Starts the plugin (again) with `failpoints`, after removing the socket and failpoint
    /// marker a previous run on this root left, so that waiting for either of them
    /// ([`wait_for`](Self::wait_for)) waits for this run.
    pub fn respawn(&self, failpoints: &str) -> std::io::Result<ChildGuard> {
        for stale in [self.failpoint_marker(), self.socket()] {
            match std::fs::remove_file(&stale) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        self.clone().failpoints(failpoints).spawn()
    }

    /// Waits until `path` exists (the socket, the failpoint marker); on timeout, panics naming
    /// `what` with the end of the plugin's log. Generous (60 s): CI machines can be slow to
    /// start a debug binary under load.
    #[track_caller]
    pub fn wait_for(&self, path: &Path, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !path.exists() {
            if Instant::now() > deadline {
                let log = self.log();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(LOG_TAIL)..].join("\n");
                panic!(
                    "timed out waiting for {what} ({}); plugin log tail:\n{tail}",
                    path.display()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// How many lines of the plugin's log a timeout shows.
const LOG_TAIL: usize = 40;

/// A gRPC channel to the unix socket `socket`, for a client of any service or version.
pub async fn unix_channel(socket: PathBuf) -> Result<Channel, tonic::transport::Error> {
    crate::grpc::unix_channel(Endpoint::from_static("http://localhost"), socket).await
}

/// Connects to the DRA service (v1) at `socket`, as the kubelet does.
pub async fn connect_dra(
    socket: PathBuf,
) -> Result<DraPluginClient<Channel>, tonic::transport::Error> {
    Ok(DraPluginClient::new(unix_channel(socket).await?))
}
