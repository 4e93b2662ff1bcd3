//! `gpu-kubelet-plugin`: the node binary. Parses arguments and hands over to the library
//! ([`gpu_dra_kubelet_plugin::cmd`]).

fn main() -> anyhow::Result<()> {
    gpu_dra_kubelet_plugin::cmd::execute(gpu_dra_kubelet_plugin::cmd::parse())
}
