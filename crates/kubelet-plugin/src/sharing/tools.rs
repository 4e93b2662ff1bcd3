//! Finding and running the driver's command-line tools (`nvidia-smi`, `nvidia-cuda-mps-control`).
//!
//! One resolution for real and simulated hosts alike: a tool is looked up under the driver root
//! in NVIDIA's order (`usr/bin`, `usr/sbin`, `bin`, `sbin`, `opt/bin`).
//!
//! How a tool runs. The driver root is seldom a folder of NVIDIA's files only: with a driver
//! installed on the host (the chart's default `nvidiaDriverRoot: /`) or in the GPU Operator's
//! driver container, the folder holding `libnvidia-ml.so.1` (`/usr/lib/x86_64-linux-gnu`,
//! `/usr/lib64`) also holds that distribution's `libc.so.6`, `libpthread`, `libdl`, `libm` and
//! `librt`, of another glibc than our image's. A tool started from our container with
//! `LD_LIBRARY_PATH` naming that folder gets the host's libc under our image's loader and dies
//! at start (glibc version or relocation errors), and with it every time-slicing and MPS
//! prepare. So a tool runs from our container, under our image's loader and glibc, and gets
//! only the driver's own libraries, each preloaded by its full path (`LD_PRELOAD`): for every
//! tool `libnvidia-ml.so.1` (what `nvidia-smi` loads, as NVIDIA's plugin runs it), and for the
//! MPS control tool also `libcuda.so.1`, which the MPS server it starts loads (a preloaded
//! library satisfies a later load of its soname). The driver's libraries are built against an
//! old glibc baseline and are meant to run under any newer one: that is how every CUDA
//! container uses them. No environment names a library folder (tested), so nothing else of
//! the host can be picked up. A driver root of `/` seen as `/` (the plugin running on the host
//! itself) needs none of this: its loader and its libraries belong together.
//!
//! Rejected: running the MPS daemon with `chroot <driver root>`, as NVIDIA's MPS template
//! does, so that it uses the host's own loader and libc. It needs a loader in the root (and
//! NVIDIA's template a shell), which GKE's layout and a driver-only folder lack, hence
//! NVIDIA's `PATH`/`LD_LIBRARY_PATH` fallback there; inside the root, the daemon's pipe and log
//! directories (under the kubelet's plugin folder), `/dev` and `/proc` must be visible, which
//! a containerized driver root does not give; our image has no shell or `chroot` to run it in
//! the daemon pod; and a simulated host has no loader of its own, so it could never be tested.
//! Preloading works the same on every layout and is what our tests run.
//!
//! Invariant: a tool never inherits the plugin's environment; it gets exactly the variables
//! built here plus those the caller names, so behaviour does not depend on how the plugin was
//! started.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::error::SharingError;

/// Name of the NVIDIA system management tool.
pub const NVIDIA_SMI: &str = "nvidia-smi";
/// Name of the MPS control tool (daemon and client in one binary).
pub const MPS_CONTROL: &str = "nvidia-cuda-mps-control";

/// The CUDA driver library, which the MPS server loads.
pub const CUDA_LIB: &str = "libcuda.so.1";

/// Directories under the driver root searched for tools, in NVIDIA's order.
pub const TOOL_DIRS: [&str; 5] = ["usr/bin", "usr/sbin", "bin", "sbin", "opt/bin"];

/// The driver installation the tools come from.
#[derive(Debug, Clone)]
pub struct DriverRoot {
    root: PathBuf,
    nvml_lib: Option<PathBuf>,
}

impl DriverRoot {
    /// A driver root; `nvml_lib` overrides the library search (the `--nvml-lib` flag).
    pub fn new(root: impl Into<PathBuf>, nvml_lib: Option<PathBuf>) -> Self {
        Self {
            root: root.into(),
            nvml_lib,
        }
    }

    /// The NVML library now: `--nvml-lib`, else the same search as the NVML inventory
    /// backend, made at every call (a driver upgraded in place renames its files).
    fn nvml_lib(&self) -> Option<PathBuf> {
        self.nvml_lib
            .clone()
            .or_else(|| gpu_dra_nvml::find_library(&self.root))
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether the driver is installed at `/` of this process (no loader variables needed then).
    pub fn is_host_root(&self) -> bool {
        self.root == Path::new("/")
    }

    /// The full path of `tool`: the first executable file among [`TOOL_DIRS`] under the root.
    pub fn find_tool(&self, tool: &'static str) -> Result<PathBuf, SharingError> {
        let candidates: Vec<PathBuf> = TOOL_DIRS
            .iter()
            .map(|d| self.root.join(d).join(tool))
            .collect();
        candidates
            .iter()
            .find(|p| is_executable(p))
            .cloned()
            .ok_or_else(|| SharingError::ToolNotFound {
                tool,
                driver_root: self.root.clone(),
                searched: candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The driver's own libraries `tool` needs preloaded, by full path: the NVML library, and
    /// for the MPS control tool `libcuda.so.1` from the same folder when there is one (see the
    /// module documentation). Each is named by its soname link where the loader can follow
    /// it, so that a daemon restarted after a driver upgrade in place finds the new files.
    pub fn preloads(&self, tool: &str) -> Vec<PathBuf> {
        let Some(nvml) = &self.nvml_lib() else {
            return Vec::new();
        };
        let Some(dir) = nvml.parent() else {
            return vec![nvml.clone()];
        };
        // The soname link where the loader can follow it to the file meant; else the file.
        let link = dir.join(gpu_dra_nvml::LIBRARY_NAME);
        let same_file = std::fs::canonicalize(&link)
            .ok()
            .is_some_and(|l| std::fs::canonicalize(nvml).ok() == Some(l));
        let mut libs = vec![if same_file { link } else { nvml.clone() }];
        if tool == MPS_CONTROL {
            let link = dir.join(CUDA_LIB);
            let cuda = if std::fs::metadata(&link).is_ok_and(|m| m.is_file()) {
                Some(link)
            } else {
                // An absolute link target is a path in the driver's own root.
                gpu_dra_nvml::resolve_in_root(&self.root, &link)
            };
            libs.extend(cuda);
        }
        libs
    }

    /// The environment `tool` from this root runs with (before caller additions): `PATH` with
    /// the root's tool folders, and the driver libraries it needs preloaded. Never a library
    /// search path (see the module documentation).
    pub fn tool_env(&self, tool: &str) -> Vec<(String, String)> {
        let mut path: Vec<String> = Vec::new();
        if !self.is_host_root() {
            path.extend(
                TOOL_DIRS
                    .iter()
                    .map(|d| self.root.join(d).display().to_string()),
            );
        }
        path.extend(
            ["/usr/local/bin", "/usr/bin", "/usr/sbin", "/bin", "/sbin"]
                .iter()
                .map(|s| s.to_string()),
        );
        let mut env = vec![("PATH".to_string(), path.join(":"))];
        let preloads = self.preloads(tool);
        if !self.is_host_root() && !preloads.is_empty() {
            let list: Vec<String> = preloads.iter().map(|p| p.display().to_string()).collect();
            env.push(("LD_PRELOAD".to_string(), list.join(":")));
        }
        env
    }

    /// A command for `tool` with the base environment and `extra` variables, stdin closed,
    /// output captured. Not yet started.
    pub fn command(
        &self,
        tool: &'static str,
        args: &[&str],
        extra: &[(String, String)],
    ) -> Result<tokio::process::Command, SharingError> {
        let path = self.find_tool(tool)?;
        let mut cmd = tokio::process::Command::new(&path);
        cmd.args(args)
            .env_clear()
            .envs(self.tool_env(tool))
            .envs(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// Runs `tool args` to completion (killed after `timeout`), feeding `stdin` if given.
    pub async fn run(
        &self,
        tool: &'static str,
        args: &[&str],
        extra: &[(String, String)],
        stdin: Option<&str>,
        timeout: Duration,
    ) -> Result<ToolOutput, SharingError> {
        let mut cmd = self.command(tool, args, extra)?;
        if stdin.is_some() {
            cmd.stdin(Stdio::piped());
        }
        let command = display_command(tool, args);
        let mut child = cmd.spawn().map_err(|source| SharingError::Spawn {
            path: self.find_tool(tool).unwrap_or_else(|_| PathBuf::from(tool)),
            source,
        })?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A client that exits early closes its stdin; its exit status says what happened,
            // so a write error here is not the error to report.
            let _ = pipe.write_all(input.as_bytes()).await;
            drop(pipe);
        }
        match tokio::time::timeout(timeout, child.wait_with_output()).await {
            Ok(Ok(out)) => Ok(ToolOutput {
                command,
                code: out.status.code(),
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }),
            Ok(Err(source)) => Err(SharingError::Spawn {
                path: PathBuf::from(tool),
                source,
            }),
            // The future owning the child is dropped here, and kill_on_drop kills it.
            Err(_) => Err(SharingError::ToolTimeout { command, timeout }),
        }
    }
}

/// What a finished tool printed and how it exited.
#[derive(Debug, Clone)]
pub struct ToolOutput {
    /// The command line, for messages.
    pub command: String,
    /// Exit code (`None` when killed by a signal).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl ToolOutput {
    /// Whether the tool exited 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// Stdout and stderr together, trimmed, for messages.
    pub fn combined(&self) -> String {
        let mut s = self.stdout.trim().to_string();
        let err = self.stderr.trim();
        if !err.is_empty() {
            if !s.is_empty() {
                s.push('\n');
            }
            s.push_str(err);
        }
        s
    }

    /// The exit status in words.
    pub fn status(&self) -> String {
        match self.code {
            Some(c) => format!("exit status {c}"),
            None => "killed by a signal".to_string(),
        }
    }

    /// This output as a [`SharingError::ToolFailed`].
    pub fn into_error(self) -> SharingError {
        SharingError::ToolFailed {
            status: self.status(),
            output: self.combined(),
            command: self.command,
        }
    }
}

fn display_command(tool: &str, args: &[&str]) -> String {
    std::iter::once(tool)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ")
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Whether `path`'s file name is `name` (used to recognise our daemons in `/proc`).
pub(crate) fn file_name_is(path: &Path, name: &str) -> bool {
    path.file_name() == Some(OsStr::new(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn make_exec(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "#!/bin/sh\necho \"$0 $* LD_PRELOAD=$LD_PRELOAD\"\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn tool_search_follows_nvidia_order_and_skips_non_executables() {
        let dir = tempfile::tempdir().unwrap();
        let root = DriverRoot::new(dir.path(), None);
        make_exec(&dir.path().join("opt/bin/nvidia-smi"));
        assert_eq!(
            root.find_tool(NVIDIA_SMI).unwrap(),
            dir.path().join("opt/bin/nvidia-smi")
        );
        make_exec(&dir.path().join("sbin/nvidia-smi"));
        assert_eq!(
            root.find_tool(NVIDIA_SMI).unwrap(),
            dir.path().join("sbin/nvidia-smi")
        );
        // A non-executable file earlier in the order is not a tool.
        std::fs::create_dir_all(dir.path().join("usr/bin")).unwrap();
        std::fs::write(dir.path().join("usr/bin/nvidia-smi"), "x").unwrap();
        assert_eq!(
            root.find_tool(NVIDIA_SMI).unwrap(),
            dir.path().join("sbin/nvidia-smi")
        );
    }

    #[test]
    fn missing_tool_error_names_every_searched_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = DriverRoot::new(dir.path(), None)
            .find_tool(MPS_CONTROL)
            .unwrap_err()
            .to_string();
        for d in TOOL_DIRS {
            assert!(
                err.contains(&dir.path().join(d).join(MPS_CONTROL).display().to_string()),
                "{err}"
            );
        }
        assert!(err.contains("--nvidia-driver-root"), "{err}");
    }

    /// A driver root whose library folder holds the driver's libraries (soname links to
    /// versioned files) and the host's own glibc, as a distribution's does.
    fn distro_root(dir: &Path) -> PathBuf {
        let lib = dir.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        for (file, link) in [
            ("libnvidia-ml.so.580.95.05", "libnvidia-ml.so.1"),
            ("libcuda.so.580.95.05", "libcuda.so.1"),
        ] {
            std::fs::write(lib.join(file), "").unwrap();
            std::os::unix::fs::symlink(file, lib.join(link)).unwrap();
        }
        for so in [
            "libc.so.6",
            "libpthread.so.0",
            "libdl.so.2",
            "libm.so.6",
            "librt.so.1",
        ] {
            std::fs::write(lib.join(so), "").unwrap();
        }
        lib
    }

    /// Every folder an environment names (search paths and the folders of preloaded files).
    fn folders_named(env: &[(String, String)]) -> Vec<PathBuf> {
        env.iter()
            .flat_map(|(_, v)| v.split([':', ' ']).map(PathBuf::from))
            .filter(|p| p.is_absolute())
            .map(|p| if p.is_dir() { p } else { PathBuf::new() })
            .filter(|p| !p.as_os_str().is_empty())
            .collect()
    }

    #[test]
    fn no_tool_environment_names_a_folder_holding_a_libc() {
        let dir = tempfile::tempdir().unwrap();
        distro_root(dir.path());
        let root = DriverRoot::new(dir.path(), None);
        for tool in [NVIDIA_SMI, MPS_CONTROL] {
            let env = root.tool_env(tool);
            assert!(env.iter().all(|(k, _)| k != "LD_LIBRARY_PATH"), "{env:?}");
            for folder in folders_named(&env) {
                assert!(
                    !folder.join("libc.so.6").exists(),
                    "{tool}: {} holds a libc: {env:?}",
                    folder.display()
                );
            }
        }
    }

    #[test]
    fn tools_preload_only_the_driver_libraries_they_need_by_soname() {
        let dir = tempfile::tempdir().unwrap();
        let lib = distro_root(dir.path());
        let root = DriverRoot::new(dir.path(), None);
        let preload = |tool| {
            root.tool_env(tool)
                .into_iter()
                .find(|(k, _)| k == "LD_PRELOAD")
                .map(|(_, v)| v)
        };
        let nvml = lib.join("libnvidia-ml.so.1").display().to_string();
        let cuda = lib.join("libcuda.so.1").display().to_string();
        assert_eq!(preload(NVIDIA_SMI), Some(nvml.clone()));
        assert_eq!(preload(MPS_CONTROL), Some(format!("{nvml}:{cuda}")));
        // A driver at the process's own `/` needs no loader variable.
        let host = DriverRoot::new("/", None);
        for tool in [NVIDIA_SMI, MPS_CONTROL] {
            assert!(host.tool_env(tool).iter().all(|(k, _)| k == "PATH"));
        }
    }

    #[test]
    fn an_absolute_link_is_followed_inside_the_driver_root() {
        // A containerized driver's links name paths of its own root.
        let dir = tempfile::tempdir().unwrap();
        let lib = distro_root(dir.path());
        std::fs::remove_file(lib.join("libcuda.so.1")).unwrap();
        std::os::unix::fs::symlink(
            "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05",
            lib.join("libcuda.so.1"),
        )
        .unwrap();
        let preloads = DriverRoot::new(dir.path(), None).preloads(MPS_CONTROL);
        assert_eq!(preloads[1], lib.join("libcuda.so.580.95.05"));
        // No libcuda at all: the NVML library alone.
        std::fs::remove_file(lib.join("libcuda.so.1")).unwrap();
        assert_eq!(
            DriverRoot::new(dir.path(), None).preloads(MPS_CONTROL),
            [lib.join("libnvidia-ml.so.1")]
        );
    }

    /// The simulated host's library folder holds stand-ins for the host's glibc that no
    /// loader can use: the tools run all the same, on both layouts of the driver's files.
    #[tokio::test]
    async fn tools_run_on_a_simulated_host_whose_library_folder_holds_its_glibc() {
        // Driver roots: the host's `/`, or the folder the driver was installed under.
        for (profile, under) in [("t4", ""), ("h100-usr-local-nvidia", "usr/local/nvidia")] {
            let host = gpu_dra_sim::testing::SimHost::new(profile);
            let lib_dir = host.lib_path().parent().unwrap().to_path_buf();
            assert!(lib_dir.join("libc.so.6").is_file(), "{profile}");
            let root = DriverRoot::new(host.root().join(under), None);
            let out = root
                .run(NVIDIA_SMI, &["-L"], &[], None, Duration::from_secs(10))
                .await
                .unwrap();
            assert!(out.success(), "{profile}: {}", out.combined());
            assert!(
                out.stdout.starts_with("GPU 0: "),
                "{profile}: {}",
                out.stdout
            );
            assert!(out.stderr.is_empty(), "{profile}: {}", out.stderr);
            let pipe = tempfile::tempdir().unwrap();
            let out = root
                .run(
                    MPS_CONTROL,
                    &[],
                    &[(
                        "CUDA_MPS_PIPE_DIRECTORY".into(),
                        pipe.path().display().to_string(),
                    )],
                    Some("get_server_list\n"),
                    Duration::from_secs(10),
                )
                .await
                .unwrap();
            assert!(out.stderr.is_empty(), "{profile}: {}", out.stderr);
            assert!(
                out.stdout.contains("Cannot find MPS control daemon"),
                "{profile}: {}",
                out.combined()
            );
        }
    }

    #[tokio::test]
    async fn run_feeds_stdin_and_kills_on_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let tool = dir.path().join("usr/bin/nvidia-smi");
        std::fs::create_dir_all(tool.parent().unwrap()).unwrap();
        std::fs::write(
            &tool,
            "#!/bin/sh\nif [ \"$1\" = sleep ]; then sleep 5; fi\ncat\n",
        )
        .unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        let root = DriverRoot::new(dir.path(), None);
        let out = root
            .run(
                NVIDIA_SMI,
                &[],
                &[],
                Some("hello\n"),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        assert!(out.success());
        assert_eq!(out.stdout, "hello\n");
        let err = root
            .run(
                NVIDIA_SMI,
                &["sleep"],
                &[],
                None,
                Duration::from_millis(100),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, SharingError::ToolTimeout { .. }), "{err}");
    }
}
