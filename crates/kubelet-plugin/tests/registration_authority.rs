//! Regression test: the kubelet's grpc-go client sends the socket path as `:authority`.
//!
//! A hand-driven HTTP/2 client sends, over a unix socket, the exact header block grpc-go
//! 1.79 produced for `Registration/GetInfo` when dialing a socket path with a custom dialer
//! (the kubelet's plugin watcher does this). With the authority fix the server answers
//! `PluginInfo`; without it `h2` resets the stream with PROTOCOL_ERROR, which is the bug.

use std::path::Path;
use std::sync::Arc;

use gpu_dra_kubelet_plugin::grpc::{Registration, bind_socket, incoming};
use gpu_dra_proto::pluginregistration as reg;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_stream::wrappers::UnixListenerStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Captured from grpc-go 1.79.3: `:authority` = `%2Ftmp%2Fgrpcprobe%2Fgpu.nvidia.com-reg.sock`.
const GRPC_GO_GETINFO_BLOCK: &str = "8386459c62ba2d98d558598c84d83498f52fb4b31909b06931ea63115392a94f41a05458534d6a8b0cd6564aec3c65545866aed5eaee690c35c87a56b0b32e8393af5f8b1d75d0620d263d4c4d65647a8b9acac8b4c7602bbafaecff40027465864d833505b11f40899acac8b24d494f6a7f8613efbcf8416f";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

async fn read_frame(s: &mut UnixStream) -> (u8, u8, u32, Vec<u8>) {
    let mut h = [0u8; 9];
    s.read_exact(&mut h).await.expect("frame header");
    let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).await.expect("frame payload");
    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
    (h[3], h[4], stream, payload)
}

enum Outcome {
    Info(reg::PluginInfo),
    Reset(u32),
}

async fn get_info_like_grpc_go(sock: &Path) -> Outcome {
    let mut s = UnixStream::connect(sock).await.expect("connect");
    let mut out = PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    out.extend(frame(0x1, 0x4, 1, &hex(GRPC_GO_GETINFO_BLOCK))); // HEADERS, END_HEADERS
    out.extend(frame(0x0, 0x1, 1, &[0, 0, 0, 0, 0])); // DATA: empty InfoRequest, END_STREAM
    s.write_all(&out).await.expect("send");
    loop {
        let (kind, flags, stream, payload) = read_frame(&mut s).await;
        match kind {
            0x4 if flags & 0x1 == 0 => s.write_all(&frame(0x4, 0x1, 0, &[])).await.expect("ack"),
            0x3 if stream == 1 => {
                return Outcome::Reset(u32::from_be_bytes([
                    payload[0], payload[1], payload[2], payload[3],
                ]));
            }
            0x0 if stream == 1 && payload.len() >= 5 => {
                return Outcome::Info(reg::PluginInfo::decode(&payload[5..]).expect("PluginInfo"));
            }
            _ => {}
        }
    }
}

fn registration(endpoint: &Path) -> reg::registration_server::RegistrationServer<Registration> {
    let (tx, _rx) = tokio::sync::watch::channel(None);
    reg::registration_server::RegistrationServer::new(Registration::new(
        "gpu.nvidia.com".into(),
        endpoint.to_path_buf(),
        Arc::new(tx),
    ))
}

#[tokio::test]
async fn get_info_answers_a_grpc_go_socket_path_authority() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("registry/gpu.nvidia.com-reg.sock");
    let endpoint = dir.path().join("plugin/dra.sock");
    let listener = bind_socket(&sock).expect("bind");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&sock).expect("stat").permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    let server = tonic::transport::Server::builder()
        .add_service(registration(&endpoint))
        .serve_with_incoming(incoming(listener));
    let server = tokio::spawn(server);

    match get_info_like_grpc_go(&sock).await {
        Outcome::Info(info) => {
            assert_eq!(info.r#type, "DRAPlugin");
            assert_eq!(info.name, "gpu.nvidia.com");
            assert_eq!(info.endpoint, endpoint.to_string_lossy());
            assert_eq!(
                info.supported_versions,
                ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
            );
        }
        Outcome::Reset(code) => panic!("stream reset with error code {code}"),
    }
    // A stale socket file is replaced on the next bind.
    server.abort();
    bind_socket(&sock).expect("rebinding over a stale socket works");
}

#[tokio::test]
async fn without_the_fix_h2_resets_the_stream() {
    // Documents the bug the fix exists for; if h2 ever accepts such authorities this test
    // fails and the adapter can be reconsidered.
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("reg.sock");
    let listener = bind_socket(&sock).expect("bind");
    let server = tonic::transport::Server::builder()
        .add_service(registration(&dir.path().join("dra.sock")))
        .serve_with_incoming(UnixListenerStream::new(listener));
    let server = tokio::spawn(server);
    match get_info_like_grpc_go(&sock).await {
        Outcome::Reset(code) => assert_eq!(code, 1, "PROTOCOL_ERROR"),
        Outcome::Info(_) => panic!("h2 now accepts the authority"),
    }
    server.abort();
}
