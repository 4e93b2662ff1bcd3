//! The `nvidia-cdi-hook` our image ships runs on any host that runs a kubelet.
//!
//! The container runtime executes CDI hooks on the host, under the host's dynamic loader and
//! libc: a hook linked against the image's glibc fails on a host with an older one (a dynamic
//! build of toolkit 1.20 needs `GLIBC_2.34`, so RHEL 8 and Ubuntu 20.04 hosts could start no
//! GPU container). `make toolkit` links it statically; this test takes the binary the image
//! gets (`NVIDIA_CDI_HOOK`, set by `make cdi-check`), installs it as the plugin does
//! ([`gpu_dra_kubelet_plugin::cdi_hook::install`]) into a host root that holds no libc and no
//! loader at all, and runs there, through `chroot`, the hooks our specs name as a runtime
//! runs them: the OCI state on standard input, the container's bundle on disk.
//!
//! Runs as root (chroot); skipped with a message when `NVIDIA_CDI_HOOK` is unset.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn hook_source() -> Option<String> {
    std::env::var("NVIDIA_CDI_HOOK")
        .ok()
        .filter(|s| !s.is_empty())
}

/// The ELF program header types of `bytes` (64-bit little-endian only, as the image is).
fn program_header_types(bytes: &[u8]) -> Vec<u32> {
    assert_eq!(&bytes[..4], b"\x7fELF", "not an ELF file");
    assert_eq!(bytes[4], 2, "not a 64-bit ELF file");
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
    let phoff = u64::from_le_bytes(bytes[0x20..0x28].try_into().expect("8 bytes")) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum).map(|i| u32_at(phoff + i * phentsize)).collect()
}

/// `PT_INTERP`: the program names a dynamic loader.
const PT_INTERP: u32 = 3;
/// `PT_DYNAMIC`: the program has dynamic linking information (needed libraries).
const PT_DYNAMIC: u32 = 2;

/// Runs `hook args...` chrooted in `root`, with `state` (the OCI state) on standard input.
fn run_hook(root: &Path, hook: &str, args: &[&str], state: &str) -> (bool, String) {
    let mut child = Command::new("chroot")
        .arg(root)
        .arg(hook)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("chroot starts");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(state.as_bytes())
        .expect("state written");
    let out = child.wait_with_output().expect("hook ran");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn the_installed_hook_runs_in_a_root_without_libc() {
    let Some(source) = hook_source() else {
        eprintln!("NVIDIA_CDI_HOOK not set: skipped (make cdi-check runs it)");
        return;
    };
    let bytes = std::fs::read(&source).expect("the hook binary is readable");
    let types = program_header_types(&bytes);
    assert!(
        !types.contains(&PT_INTERP) && !types.contains(&PT_DYNAMIC),
        "{source} is dynamically linked: on the host it would load the host's libc (`make toolkit` links it statically; remove an older dynamic copy from .tools/bin first)"
    );

    // The host: nothing but the plugin folder with the installed copy, and a container bundle.
    let host = tempfile::tempdir().expect("temp dir");
    let plugin_dir = host.path().join("var/lib/kubelet/plugins/gpu.nvidia.com");
    std::fs::create_dir_all(&plugin_dir).expect("plugin dir");
    let installed = gpu_dra_kubelet_plugin::cdi_hook::install(
        Path::new(&source),
        &gpu_dra_kubelet_plugin::node_layout::hook_dir_in(&plugin_dir),
    )
    .expect("the hook installs");
    let in_root = Path::new("/").join(
        installed
            .strip_prefix(host.path())
            .expect("installed under the host root"),
    );
    for dir in ["lib", "lib64", "usr/lib", "lib/x86_64-linux-gnu"] {
        assert!(
            !host.path().join(dir).exists(),
            "the test root must hold no library folder ({dir})"
        );
    }
    let bundle = host.path().join("bundle");
    std::fs::create_dir_all(bundle.join("rootfs/usr/lib/x86_64-linux-gnu")).expect("rootfs");
    std::fs::write(
        bundle.join("config.json"),
        r#"{"ociVersion":"1.2.0","root":{"path":"rootfs"}}"#,
    )
    .expect("config.json");
    let state = r#"{"ociVersion":"1.2.0","id":"c","status":"creating","pid":1,"bundle":"/bundle"}"#;

    let hook = in_root.to_str().expect("UTF-8 path");
    let (ok, out) = run_hook(host.path(), hook, &["--version"], "");
    assert!(ok, "{hook} --version failed in a root without libc: {out}");

    // The hooks our specs name: links into the container, and the one that stops the
    // container's driver libraries from creating device nodes.
    let (ok, out) = run_hook(
        host.path(),
        hook,
        &[
            "create-symlinks",
            "--link",
            "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
        ],
        state,
    );
    assert!(ok, "create-symlinks failed: {out}");
    let link = bundle.join("rootfs/usr/lib/x86_64-linux-gnu/libcuda.so");
    assert_eq!(
        std::fs::read_link(&link).expect("the link exists in the container"),
        Path::new("libcuda.so.1")
    );
    let (ok, out) = run_hook(
        host.path(),
        hook,
        &["disable-device-node-modification"],
        state,
    );
    assert!(ok, "disable-device-node-modification failed: {out}");
}
