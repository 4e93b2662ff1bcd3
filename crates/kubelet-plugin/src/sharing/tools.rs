//! Finding and running the driver's command-line tools (`nvidia-smi`, `nvidia-cuda-mps-control`).
//!
//! One resolution for real and simulated hosts alike: a tool is looked up under the driver root
//! in NVIDIA's order (`usr/bin`, `usr/sbin`, `bin`, `sbin`, `opt/bin`). When the driver root is
//! not `/` (driver installed by the GPU operator, or a simulated host), the tool runs with
//! `LD_PRELOAD` and `LD_LIBRARY_PATH` pointing at that root's `libnvidia-ml.so.1`, like the
//! NVIDIA driver does, so it talks to that driver and not to whatever the plugin image holds.
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
        let root = root.into();
        // The same search as the NVML inventory backend, so tools preload the library the
        // plugin itself loaded.
        let nvml_lib = nvml_lib.or_else(|| gpu_dra_nvml::find_library(&root));
        Self { root, nvml_lib }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether the driver is installed at `/` (no loader variables needed then).
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

    /// The environment every tool from this root runs with (before caller additions).
    pub fn base_env(&self) -> Vec<(String, String)> {
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
        if !self.is_host_root()
            && let Some(lib) = &self.nvml_lib
        {
            env.push(("LD_PRELOAD".to_string(), lib.display().to_string()));
            if let Some(dir) = lib.parent() {
                env.push(("LD_LIBRARY_PATH".to_string(), dir.display().to_string()));
            }
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
            .envs(self.base_env())
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

    #[test]
    fn loader_variables_only_for_a_non_host_root() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir
            .path()
            .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
        std::fs::create_dir_all(lib.parent().unwrap()).unwrap();
        std::fs::write(&lib, "").unwrap();
        let env = DriverRoot::new(dir.path(), None).base_env();
        assert!(env.contains(&("LD_PRELOAD".into(), lib.display().to_string())));
        assert!(env.contains(&(
            "LD_LIBRARY_PATH".into(),
            lib.parent().unwrap().display().to_string()
        )));
        let host = DriverRoot::new("/", None).base_env();
        assert!(host.iter().all(|(k, _)| k != "LD_PRELOAD"));
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
