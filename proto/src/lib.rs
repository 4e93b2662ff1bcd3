//! Kubelet gRPC protocols (DRA v1/v1beta1, plugin registration v1, DRA health v1alpha1).
