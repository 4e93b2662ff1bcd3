//! The one way the plugin's subcommands reach the API server: `--kubeconfig` when given, the
//! pod's in-cluster configuration otherwise.
//!
//! Every request carries the user agent `gpu-kubelet-plugin/<version> (<subcommand>; <node>)`
//! (no node for cluster-wide subcommands), so the API server's audit log and request metrics attribute the load to this plugin and its
//! node (kube-rs sends none by default).
//!
//! Invariant: the process's TLS provider is chosen here, before the first client exists, so
//! that `run` and `uninstall` talk TLS the same way whatever features other crates turn on in
//! rustls.

use std::path::PathBuf;

/// Flags of the subcommands that talk to the API server.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct KubeArgs {
    /// Kubeconfig file; in-cluster config when unset.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

/// Why no client could be built. Each says which configuration failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    /// The kubeconfig file cannot be read or parsed.
    #[error("reading kubeconfig {path}: {source}")]
    ReadKubeconfig {
        /// The file (`--kubeconfig`, `KUBECONFIG`).
        path: PathBuf,
        /// Why.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The kubeconfig names no usable cluster, user or context.
    #[error("loading kubeconfig {path}: {source}")]
    LoadKubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No kubeconfig was given and this process does not run in a pod.
    #[error("in-cluster Kubernetes config: {source}; outside a pod set --kubeconfig (KUBECONFIG)")]
    InCluster {
        /// Why.
        #[source]
        source: kube::config::InClusterError,
    },
    /// The node name cannot be sent in an HTTP header.
    #[error("--node-name {node:?} cannot be sent in the User-Agent header: {source}")]
    UserAgent {
        /// The node name given.
        node: String,
        /// Why.
        #[source]
        source: http::header::InvalidHeaderValue,
    },
    /// The configuration does not make a client (TLS, proxy, authentication).
    #[error("building the Kubernetes client: {source}")]
    Client {
        /// Why.
        #[source]
        source: kube::Error,
    },
}

impl KubeArgs {
    /// A client for the configured cluster, sending [`user_agent`]`(subcommand, node)`.
    pub async fn client(
        &self,
        subcommand: &str,
        node: Option<&str>,
    ) -> Result<kube::Client, KubeClientError> {
        // One TLS provider for the process, whatever features other crates turn on in rustls.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let agent =
            http::HeaderValue::from_str(&user_agent(subcommand, node)).map_err(|source| {
                KubeClientError::UserAgent {
                    node: node.unwrap_or_default().to_owned(),
                    source,
                }
            })?;
        let mut config = match &self.kubeconfig {
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path).map_err(|source| {
                    KubeClientError::ReadKubeconfig {
                        path: path.clone(),
                        source,
                    }
                })?;
                kube::Config::from_custom_kubeconfig(
                    kc,
                    &kube::config::KubeConfigOptions::default(),
                )
                .await
                .map_err(|source| KubeClientError::LoadKubeconfig {
                    path: path.clone(),
                    source,
                })?
            }
            None => {
                kube::Config::incluster().map_err(|source| KubeClientError::InCluster { source })?
            }
        };
        config.headers.push((http::header::USER_AGENT, agent));
        kube::Client::try_from(config).map_err(|source| KubeClientError::Client { source })
    }
}

/// The user agent of this plugin's requests: binary, version, subcommand and node, e.g.
/// `gpu-kubelet-plugin/1.2.3 (run; node-a)`, or `gpu-kubelet-plugin/1.2.3 (uninstall)`.
pub fn user_agent(subcommand: &str, node: Option<&str>) -> String {
    let version = env!("CARGO_PKG_VERSION");
    match node {
        Some(node) => format!("gpu-kubelet-plugin/{version} ({subcommand}; {node})"),
        None => format!("gpu-kubelet-plugin/{version} ({subcommand})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_kubeconfig_is_named_in_the_error() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("absent.yaml");
        let args = KubeArgs {
            kubeconfig: Some(path.clone()),
        };
        let Err(err) = args.client("run", Some("node-a")).await else {
            panic!("a client from a missing file");
        };
        let err = err.to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
    }

    #[tokio::test]
    async fn a_kubeconfig_file_makes_a_client_for_its_server() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("config.yaml");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443', insecure-skip-tls-verify: true}}]\n\
             users: [{name: u, user: {token: t}}]\n\
             contexts: [{name: c, context: {cluster: k, user: u}}]\n",
        )
        .expect("write");
        let client = KubeArgs {
            kubeconfig: Some(path),
        }
        .client("run", Some("node-a"))
        .await
        .expect("client");
        assert_eq!(client.default_namespace(), "default");
    }

    #[tokio::test]
    async fn a_node_name_that_is_no_header_value_is_refused_by_name() {
        let args = KubeArgs { kubeconfig: None };
        let Err(err) = args.client("run", Some("node\na")).await else {
            panic!("a client with a newline in its user agent");
        };
        let err = err.to_string();
        assert!(err.contains("--node-name"), "{err}");
    }

    #[test]
    fn the_user_agent_names_the_plugin_its_version_and_node() {
        let version = env!("CARGO_PKG_VERSION");
        assert_eq!(
            user_agent("run", Some("node-a")),
            format!("gpu-kubelet-plugin/{version} (run; node-a)")
        );
        assert_eq!(
            user_agent("uninstall", None),
            format!("gpu-kubelet-plugin/{version} (uninstall)")
        );
    }
}
