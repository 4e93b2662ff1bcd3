//! A DRA gRPC client over a unix socket, as the kubelet uses it (tests, benchmarks).

use std::path::PathBuf;

use gpu_dra_proto::dra::v1::dra_plugin_client::DraPluginClient;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// Connects to the DRA service at `socket`.
pub async fn connect_dra(
    socket: PathBuf,
) -> Result<DraPluginClient<Channel>, tonic::transport::Error> {
    // The URI is required by the API but unused: the connector dials the socket.
    let channel = Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await?;
    Ok(DraPluginClient::new(channel))
}
