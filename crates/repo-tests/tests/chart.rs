//! Renders the Helm chart (deploy/helm/gpu-dra-driver) with helm and checks what matters:
//! DeviceClass selectors, the node-restriction policy's user name and node claim, RBAC, the
//! webhook registration and the node plugin's environment (against the plugin's own flag
//! definitions); and evaluates the node-restriction policy's CEL (with the `cel` crate) on
//! plugin requests for its own and other nodes.
//!
//! Renders the chart folder, or the packaged chart env `CHART` names (`make chart-check` renders
//! `helm package`'s archive, what a release publishes).
//!
//! Needs a helm binary: env `HELM`, else `.tools/bin/helm` (`make chart-check` installs it).
//! Without one the test says so and passes, unless env `CHART_CHECK=1` demands helm
//! (`make chart-check` sets it, so there it cannot pass vacuously).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const NAMESPACE: &str = "gpu-system";
/// The release the chart is tested against: every value renders there. The oldest supported
/// release (1.34) is where values needing newer features are refused
/// (`values_needing_a_feature_the_release_lacks_are_refused`; `make chart-check` lints the
/// default values there).
const KUBE_VERSION: &str = "1.37.0";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The chart to render: env `CHART` (a packaged chart or a chart folder), else the folder.
fn chart() -> PathBuf {
    std::env::var_os("CHART")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("deploy/helm/gpu-dra-driver"))
}

fn helm() -> Option<PathBuf> {
    let helm = std::env::var_os("HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".tools/bin/helm"));
    if helm.is_file() {
        return Some(helm);
    }
    assert!(
        std::env::var_os("CHART_CHECK").is_none(),
        "CHART_CHECK is set but there is no helm at {}",
        helm.display()
    );
    eprintln!(
        "skipping the chart check: no helm at {} (run `make chart-check`)",
        helm.display()
    );
    None
}

/// Renders the chart with `--set` values; returns every object.
fn render(helm: &Path, sets: &[&str]) -> Vec<Value> {
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
    render_args(helm, &args)
}

/// Renders the chart with extra `helm template` arguments; returns every object.
fn render_args(helm: &Path, args: &[&str]) -> Vec<Value> {
    let mut cmd = Command::new(helm);
    cmd.args(["template", "rel"])
        .arg(chart())
        .args(["--namespace", NAMESPACE, "--kube-version", KUBE_VERSION])
        .args(args);
    let out = cmd.output().expect("helm runs");
    assert!(
        out.status.success(),
        "helm template {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("rendered chart has the expected shape");
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text).expect("rendered chart has the expected shape");
    docs.into_iter().filter(|d| d.is_object()).collect()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn kinds(objects: &[Value]) -> Vec<String> {
    objects
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"]
                    .as_str()
                    .expect("rendered chart has the expected shape"),
                o["metadata"]["name"]
                    .as_str()
                    .expect("rendered chart has the expected shape")
            )
        })
        .collect()
}

fn strs(v: &Value) -> Vec<&str> {
    v.as_array()
        .expect("rendered chart has the expected shape")
        .iter()
        .map(|s| s.as_str().expect("rendered chart has the expected shape"))
        .collect()
}

fn plugin_env<'a>(ds: &'a Value, name: &str) -> Option<&'a str> {
    ds["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)?["value"]
        .as_str()
}

fn mount_paths(ds: &Value) -> Vec<&str> {
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        .as_array()
        .map(|m| m.iter().filter_map(|m| m["mountPath"].as_str()).collect())
        .unwrap_or_default()
}

#[test]
fn default_values() {
    let Some(helm) = helm() else { return };
    let lint = Command::new(&helm)
        .args(["lint", "--strict", "--kube-version", KUBE_VERSION])
        .arg(chart())
        .output()
        .unwrap();
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );

    let objects = render(&helm, &[]);

    // DeviceClasses: exactly the selectors users write for the NVIDIA driver.
    for (name, ty) in [("gpu.nvidia.com", "gpu"), ("mig.nvidia.com", "mig")] {
        let class = find(&objects, "DeviceClass", name);
        assert_eq!(class["apiVersion"], "resource.k8s.io/v1");
        assert_eq!(
            class["spec"]["selectors"][0]["cel"]["expression"],
            format!(
                "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == '{ty}'"
            )
        );
        assert!(
            class["spec"].get("extendedResourceName").is_none(),
            "off by default"
        );
        assert!(class["spec"].get("config").is_none());
    }

    // The node plugin: service account, host paths, probes (its env against its flags:
    // `the_chart_configures_the_plugin_by_the_env_twins_of_its_flags`).
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let pod = &ds["spec"]["template"]["spec"];
    let sa = pod["serviceAccountName"].as_str().unwrap();
    let container = &pod["containers"][0];
    let host_paths: Vec<&str> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    for p in [
        "/var/lib/kubelet/plugins/gpu.nvidia.com",
        "/var/lib/kubelet/plugins_registry",
        "/var/run/cdi",
        "/",
    ] {
        assert!(host_paths.contains(&p), "{p} not mounted: {host_paths:?}");
    }
    // The host's /dev is the device root, seen at /dev; a host-installed driver ("/") is
    // mounted at /driver-root, and the plugin is told both paths: specs name host paths.
    assert_eq!(plugin_env(ds, "NVIDIA_DEV_ROOT"), Some("/"));
    assert_eq!(plugin_env(ds, "NVIDIA_DRIVER_ROOT"), Some("/"));
    assert_eq!(
        plugin_env(ds, "CONTAINER_DRIVER_ROOT"),
        Some("/driver-root")
    );
    // Rolling updates with surge: the pod's UID names its sockets.
    assert_eq!(
        ds["spec"]["updateStrategy"],
        serde_json::json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}})
    );
    let pod_uid = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "POD_UID")
        .expect("POD_UID");
    assert_eq!(
        pod_uid["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.uid"
    );
    // No hook path by default: the plugin installs the image's nvidia-cdi-hook itself.
    assert_eq!(plugin_env(ds, "NVIDIA_CDI_HOOK_PATH"), None);
    let mounts = mount_paths(ds);
    assert!(
        mounts.contains(&"/dev") && mounts.contains(&"/driver-root"),
        "{mounts:?}"
    );
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    // The plugin binds loopback by default; the probes go to the pod's address on the named
    // port, so the chart must bind every address of the pod on that port.
    assert_eq!(plugin_env(ds, "HTTP_ADDRESS"), Some("0.0.0.0:8080"));
    assert_eq!(container["ports"][0]["name"], "http");
    assert_eq!(container["ports"][0]["containerPort"], 8080);
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(container[probe]["httpGet"]["port"], "http", "{probe}");
    }
    assert!(container["resources"]["requests"].is_object());

    // RBAC: least privilege for the plugin, none for the webhook.
    let role = find(&objects, "ClusterRole", "rel-gpu-dra-driver-kubelet-plugin");
    let rules: Vec<(String, String, Vec<&str>)> = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            let verbs = strs(&r["verbs"]);
            let group = r["apiGroups"][0].as_str().unwrap().to_owned();
            strs(&r["resources"])
                .into_iter()
                .map(move |res| (group.clone(), res.to_owned(), verbs.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        rules,
        vec![
            // Only GET: the plugin reads each claim it prepares by name and never lists or
            // watches claims (`claims.rs`), so it cannot enumerate the cluster's claims.
            (
                "resource.k8s.io".into(),
                "resourceclaims".into(),
                vec!["get"]
            ),
            (
                "resource.k8s.io".into(),
                "resourceslices".into(),
                vec!["create", "update", "delete", "list", "watch"]
            ),
            // Its Node, watched for the partitioning annotations (`publish::node_watch`).
            ("".into(), "nodes".into(), vec!["get", "list", "watch"]),
            // The pods of claims it prepared, by name only (`usage::pods`): the names of
            // their containers.
            ("".into(), "pods".into(), vec!["get"]),
            // Device data in the status of the claims it prepares (`claim_status`): the
            // status subresource, and this driver's entries of claims on its node (the API
            // server's check on the synthetic `driver` subresource).
            (
                "resource.k8s.io".into(),
                "resourceclaims/status".into(),
                vec!["patch", "update"]
            ),
            (
                "resource.k8s.io".into(),
                "resourceclaims/driver".into(),
                vec!["associated-node:patch", "associated-node:update"]
            ),
        ]
    );
    assert_eq!(
        role["rules"][5]["resourceNames"],
        serde_json::json!(["gpu.nvidia.com"]),
        "the driver subresource only for this driver"
    );
    // Pods only in its own namespace, for the MPS daemon pods, watched by one watch per node
    // (`sharing::pod_watch`); no update.
    let role = find(&objects, "Role", "rel-gpu-dra-driver-kubelet-plugin");
    assert_eq!(role["metadata"]["namespace"], NAMESPACE);
    assert_eq!(
        role["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["pods"],
            "verbs": ["get", "list", "watch", "create", "delete"]}])
    );
    let bindings: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
        // The uninstall hook's exists only while `helm uninstall` runs it (checked in
        // `uninstall_hook_restores_the_nodes`).
        .filter(|o| o["metadata"]["annotations"]["helm.sh/hook"].is_null())
        .collect();
    // The plugin only: cluster, its namespace's pods, events in `default` (the webhook gets a
    // role only with the bound on pods per node, below).
    assert_eq!(bindings.len(), 3, "only the plugin is bound to roles");
    for b in bindings {
        assert_eq!(b["subjects"][0]["name"], sa);
        assert_eq!(b["subjects"][0]["namespace"], NAMESPACE);
    }
    // Events about its Node: create and patch in `default` only (where the API server keeps
    // events of cluster-scoped objects).
    let events = find(&objects, "Role", "rel-gpu-dra-driver-kubelet-plugin-events");
    assert_eq!(events["metadata"]["namespace"], "default");
    assert_eq!(
        events["rules"],
        serde_json::json!([{"apiGroups": ["events.k8s.io"], "resources": ["events"],
            "verbs": ["create", "patch"]}])
    );
    // Daemon pods get the chart's image and the plugin's namespace.
    let image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .expect("plugin image");
    assert_eq!(plugin_env(ds, "MPS_DAEMON_IMAGE"), Some(image));

    // Node restriction: the real user name of the plugin's service account, and the node
    // claim of its pod-bound token.
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-gpu-dra-driver-node-restriction",
    );
    assert_eq!(
        vap["spec"]["matchConditions"][0]["expression"],
        format!("request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:{sa}'")
    );
    let rule = &vap["spec"]["matchConstraints"]["resourceRules"][0];
    assert_eq!(strs(&rule["resources"]), ["resourceslices"]);
    assert_eq!(strs(&rule["operations"]), ["CREATE", "UPDATE", "DELETE"]);
    let user_node = vap["spec"]["variables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "userNodeName")
        .unwrap()["expression"]
        .as_str()
        .unwrap();
    assert!(
        user_node.contains("request.userInfo.extra['authentication.kubernetes.io/node-name'][0]"),
        "{user_node}"
    );
    let binding = find(
        &objects,
        "ValidatingAdmissionPolicyBinding",
        "rel-gpu-dra-driver-node-restriction",
    );
    assert_eq!(binding["spec"]["policyName"], vap["metadata"]["name"]);
    assert_eq!(strs(&binding["spec"]["validationActions"]), ["Deny"]);

    // The webhook: one entry per kind, in v1 only, with a CA bundle; claims and templates
    // on CREATE only (their spec is immutable), DeviceClasses also on UPDATE; failing open.
    let vwc = find(
        &objects,
        "ValidatingWebhookConfiguration",
        "rel-gpu-dra-driver-webhook",
    );
    let (hooks, pods_hooks): (Vec<&Value>, Vec<&Value>) = vwc["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .partition(|h| h["name"].as_str().unwrap().contains(".opaque-config."));
    let scope: Vec<(&str, Vec<&str>, Vec<&str>)> = hooks
        .iter()
        .map(|h| {
            let rule = &h["rules"][0];
            assert_eq!(h["rules"].as_array().unwrap().len(), 1);
            assert_eq!(strs(&rule["apiVersions"]), ["v1"]);
            assert_eq!(strs(&rule["apiGroups"]), ["resource.k8s.io"]);
            (
                h["name"].as_str().unwrap(),
                strs(&rule["resources"]),
                strs(&rule["operations"]),
            )
        })
        .collect();
    assert_eq!(
        scope,
        [
            (
                "resourceclaims.opaque-config.gpu.nvidia.com",
                vec!["resourceclaims"],
                vec!["CREATE"]
            ),
            (
                "resourceclaimtemplates.opaque-config.gpu.nvidia.com",
                vec!["resourceclaimtemplates"],
                vec!["CREATE"]
            ),
            (
                "deviceclasses.opaque-config.gpu.nvidia.com",
                vec!["deviceclasses"],
                vec!["CREATE", "UPDATE"]
            ),
        ]
    );
    for hook in &hooks {
        assert_eq!(hook["failurePolicy"], "Ignore");
        assert_eq!(strs(&hook["admissionReviewVersions"]), ["v1"]);
        assert_eq!(hook["sideEffects"], "None");
        assert_eq!(hook["clientConfig"]["service"]["path"], "/validate");
        assert!(
            !hook["clientConfig"]["caBundle"]
                .as_str()
                .unwrap()
                .is_empty()
        );
    }
    let hook = &hooks[0];
    let deploy = find(&objects, "Deployment", "rel-gpu-dra-driver-webhook");
    let webhook_pod = &deploy["spec"]["template"]["spec"];
    // By default no bound on pods per node: the webhook calls no API (no token, no role) and
    // gets no pods.
    assert!(pods_hooks.is_empty(), "{pods_hooks:?}");
    assert_eq!(webhook_pod["automountServiceAccountToken"], false);
    assert!(
        !objects
            .iter()
            .any(|o| o["kind"] == "Role"
                && o["metadata"]["name"] == "rel-gpu-dra-driver-webhook-pods")
    );

    // The bound on pods per node: the plugin's pod creations in the release namespace only,
    // failing closed, counted by the webhook with list and watch on the namespace's pods.
    let bounded = render(&helm, &["kubeletPlugin.nodeRestriction.maxPodsPerNode=128"]);
    let bounded_vwc = find(
        &bounded,
        "ValidatingWebhookConfiguration",
        "rel-gpu-dra-driver-webhook",
    );
    let pods_hooks: Vec<&Value> = bounded_vwc["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| !h["name"].as_str().unwrap().contains(".opaque-config."))
        .collect();
    assert_eq!(
        bounded_vwc["webhooks"].as_array().unwrap().len(),
        hooks.len() + 1
    );
    let bounded_pod =
        &find(&bounded, "Deployment", "rel-gpu-dra-driver-webhook")["spec"]["template"]["spec"];
    let [pods_hook] = pods_hooks[..] else {
        panic!("one pods-per-node webhook: {pods_hooks:?}")
    };
    assert_eq!(pods_hook["name"], "pods-per-node.gpu.nvidia.com");
    assert_eq!(pods_hook["failurePolicy"], "Fail");
    assert_eq!(pods_hook["clientConfig"]["service"]["path"], "/daemon-pods");
    let rule = &pods_hook["rules"][0];
    assert_eq!(
        (
            strs(&rule["apiGroups"]),
            strs(&rule["resources"]),
            strs(&rule["operations"])
        ),
        (vec![""], vec!["pods"], vec!["CREATE"])
    );
    assert_eq!(
        pods_hook["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        NAMESPACE
    );
    let user = |name: &str| serde_json::json!({"request": {"userInfo": {"username": name}}});
    let condition = pods_hook["matchConditions"][0]["expression"]
        .as_str()
        .unwrap();
    assert_eq!(
        eval(
            condition,
            &user(&format!(
                "system:serviceaccount:{NAMESPACE}:rel-gpu-dra-driver-kubelet-plugin"
            ))
        ),
        cel::Value::Bool(true)
    );
    assert_eq!(
        eval(
            condition,
            &user("system:serviceaccount:kube-system:daemon-set-controller")
        ),
        cel::Value::Bool(false)
    );
    let env = |name: &str| {
        bounded_pod["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
    };
    assert_eq!(env("MAX_DAEMON_PODS_PER_NODE"), Some("128".into()));
    assert_eq!(env("DAEMON_PODS_NAMESPACE"), Some(NAMESPACE.into()));
    assert_eq!(bounded_pod["automountServiceAccountToken"], true);
    let role = find(&bounded, "Role", "rel-gpu-dra-driver-webhook-pods");
    assert_eq!(
        role["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}])
    );
    let binding = find(&bounded, "RoleBinding", "rel-gpu-dra-driver-webhook-pods");
    assert_eq!(binding["subjects"][0]["name"], "rel-gpu-dra-driver-webhook");
    let probe = &webhook_pod["containers"][0]["readinessProbe"]["httpGet"];
    assert_eq!(
        (&probe["path"], &probe["scheme"]),
        (&"/readyz".into(), &"HTTPS".into())
    );

    // Availability: two replicas spread over nodes, never fewer during a rollout, and at most
    // one taken by a voluntary disruption.
    assert_eq!(deploy["spec"]["replicas"], 2);
    assert_eq!(
        deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"],
        0
    );
    let pod_labels = &deploy["spec"]["template"]["metadata"]["labels"];
    let spread = &webhook_pod["topologySpreadConstraints"][0];
    assert_eq!(spread["topologyKey"], "kubernetes.io/hostname");
    assert_eq!(spread["whenUnsatisfiable"], "ScheduleAnyway");
    let selects_pods = |selector: &Value| {
        let labels = selector["matchLabels"].as_object().unwrap();
        !labels.is_empty() && labels.iter().all(|(k, v)| &pod_labels[k] == v)
    };
    assert!(selects_pods(&spread["labelSelector"]), "{spread}");
    let pdb = find(
        &objects,
        "PodDisruptionBudget",
        "rel-gpu-dra-driver-webhook",
    );
    assert_eq!(pdb["apiVersion"], "policy/v1");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert!(pdb["spec"].get("minAvailable").is_none());
    assert!(selects_pods(&pdb["spec"]["selector"]), "{pdb}");
    assert!(
        kinds(&objects)
            .iter()
            .all(|k| !k.starts_with("NetworkPolicy/")),
        "the NetworkPolicy is off by default"
    );
    let secret = find(&objects, "Secret", "rel-gpu-dra-driver-webhook-tls");
    assert_eq!(
        secret["data"]["ca.crt"], hook["clientConfig"]["caBundle"],
        "the registered CA is the one that signed the served certificate"
    );
}

/// The image defaults to an unprivileged user (the webhook's), so the chart must say who each
/// workload runs as: the node plugin as root (it creates its sockets in the kubelet's root-owned
/// folders and manages device state), the webhook as a numeric non-root user that the kubelet
/// can verify without reading the image's /etc/passwd.
#[test]
fn workloads_run_as_the_users_they_need() {
    let Some(helm) = helm() else { return };
    let objects = render(&helm, &[]);

    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let pod = &ds["spec"]["template"]["spec"];
    let plugin = &pod["containers"][0]["securityContext"];
    assert_eq!(plugin["runAsUser"], 0, "{plugin}");
    assert_eq!(plugin["runAsGroup"], 0, "{plugin}");
    assert_eq!(plugin["runAsNonRoot"], false, "{plugin}");
    assert_eq!(plugin["privileged"], true, "{plugin}");
    assert!(
        pod["securityContext"]["runAsUser"].is_null() || pod["securityContext"]["runAsUser"] == 0,
        "a pod-level user must not contradict the container's: {}",
        pod["securityContext"]
    );

    let deploy = find(&objects, "Deployment", "rel-gpu-dra-driver-webhook");
    let pod = &deploy["spec"]["template"]["spec"];
    let user = pod["securityContext"]["runAsUser"].as_u64();
    assert!(
        matches!(user, Some(u) if u > 0),
        "{}",
        pod["securityContext"]
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let webhook = &pod["containers"][0]["securityContext"];
    assert!(
        webhook["runAsUser"].is_null() && webhook["privileged"].is_null(),
        "{webhook}"
    );
    assert_eq!(webhook["allowPrivilegeEscalation"], false);
}

/// The plugin asks the kubelet's PodResources API through the folder of its socket (the
/// folder, since the kubelet replaces the socket when it restarts), next to the kubelet's
/// plugins folder or where `directoryPath` says; switched off, it is told no socket and nothing is mounted.
#[test]
fn the_plugin_reaches_the_kubelets_pod_resources_socket_unless_switched_off() {
    let Some(helm) = helm() else { return };
    let ds_of =
        |objects: &[Value]| find(objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin").clone();
    let host_paths = |ds: &Value| -> Vec<String> {
        ds["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["hostPath"]["path"].as_str().map(str::to_owned))
            .collect()
    };
    for (sets, folder) in [
        (&[][..], "/var/lib/kubelet/pod-resources"),
        (
            &["kubeletPlugin.kubeletRoot=/var/lib/k0s/kubelet/"][..],
            "/var/lib/k0s/kubelet/pod-resources",
        ),
        (
            &[
                "kubeletPlugin.kubeletPluginsDirectoryPath=/var/snap/microk8s/common/var/lib/kubelet/plugins",
            ][..],
            "/var/snap/microk8s/common/var/lib/kubelet/pod-resources",
        ),
        (
            &["kubeletPlugin.podResources.directoryPath=/run/kubelet/pod-resources/"][..],
            "/run/kubelet/pod-resources",
        ),
    ] {
        let ds = ds_of(&render(&helm, sets));
        assert_eq!(
            plugin_env(&ds, "KUBELET_POD_RESOURCES_SOCKET"),
            Some(format!("{folder}/kubelet.sock").as_str()),
            "{sets:?}"
        );
        assert!(host_paths(&ds).iter().any(|p| p == folder), "{sets:?}");
        assert!(mount_paths(&ds).contains(&folder), "{sets:?}");
    }
    let ds = ds_of(&render(
        &helm,
        &["kubeletPlugin.podResources.enabled=false"],
    ));
    assert_eq!(plugin_env(&ds, "KUBELET_POD_RESOURCES_SOCKET"), Some(""));
    assert!(
        !host_paths(&ds).iter().any(|p| p.contains("pod-resources")),
        "{:?}",
        host_paths(&ds)
    );
}

#[test]
fn value_combinations() {
    let Some(helm) = helm() else { return };

    let objects = render(
        &helm,
        &[
            "deviceClasses.gpu.extendedResourceName.enabled=true",
            "deviceClasses.gpu.config.apiVersion=resource.nvidia.com/v1beta1",
            "deviceClasses.gpu.config.kind=GpuConfig",
            "deviceClasses.gpu.config.sharing.strategy=TimeSlicing",
            "deviceClasses.gpu.config.sharing.timeSlicingConfig.interval=Long",
            "webhook.failurePolicy=Fail",
            "webhook.v1beta1=true",
            "webhook.v1beta2=true",
            "webhook.tls.mode=certManager",
            "webhook.replicas=3",
            "webhook.podDisruptionBudget.enabled=false",
            "webhook.topologySpread.whenUnsatisfiable=DoNotSchedule",
            "webhook.networkPolicy.enabled=true",
            "webhook.networkPolicy.apiServerCIDRs={10.0.0.0/24,fd00::/64}",
            "webhook.networkPolicy.extraFrom[0].namespaceSelector.matchLabels.team=monitoring",
            "nvidiaDriverRoot=/run/nvidia/driver",
            "nvidiaCDIHookPath=/usr/local/nvidia/toolkit/nvidia-cdi-hook",
            "kubeletPlugin.updateStrategy.rollingUpdate.maxSurge=0",
            "kubeletPlugin.updateStrategy.rollingUpdate.maxUnavailable=1",
            "kubeletPlugin.serviceAccount.name=plugin",
        ],
    );
    let gpu = find(&objects, "DeviceClass", "gpu.nvidia.com");
    assert_eq!(gpu["spec"]["extendedResourceName"], "nvidia.com/gpu");
    let opaque = &gpu["spec"]["config"][0]["opaque"];
    assert_eq!(opaque["driver"], "gpu.nvidia.com");
    assert_eq!(
        opaque["parameters"]["sharing"]["timeSlicingConfig"]["interval"],
        "Long"
    );
    let hook = &find(
        &objects,
        "ValidatingWebhookConfiguration",
        "rel-gpu-dra-driver-webhook",
    );
    assert_eq!(
        hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        format!("{NAMESPACE}/rel-gpu-dra-driver-webhook")
    );
    for h in hook["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h["name"].as_str().unwrap().contains(".opaque-config."))
    {
        assert_eq!(h["failurePolicy"], "Fail");
        assert_eq!(
            strs(&h["rules"][0]["apiVersions"]),
            ["v1", "v1beta2", "v1beta1"]
        );
    }
    let deploy = find(&objects, "Deployment", "rel-gpu-dra-driver-webhook");
    assert_eq!(deploy["spec"]["replicas"], 3);
    assert_eq!(
        deploy["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["whenUnsatisfiable"],
        "DoNotSchedule"
    );
    assert!(
        kinds(&objects)
            .iter()
            .all(|k| !k.starts_with("PodDisruptionBudget/"))
    );
    // Only the API server's addresses (and the extra peers) reach the webhook port.
    let np = find(&objects, "NetworkPolicy", "rel-gpu-dra-driver-webhook");
    assert_eq!(strs(&np["spec"]["policyTypes"]), ["Ingress"]);
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"],
        serde_json::json!({"app.kubernetes.io/instance": "rel", "app.kubernetes.io/component": "webhook"})
    );
    let ingress = np["spec"]["ingress"].as_array().unwrap();
    assert_eq!(ingress.len(), 1);
    assert_eq!(
        ingress[0]["from"],
        serde_json::json!([
            {"ipBlock": {"cidr": "10.0.0.0/24"}},
            {"ipBlock": {"cidr": "fd00::/64"}},
            {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}},
        ])
    );
    assert_eq!(
        ingress[0]["ports"],
        serde_json::json!([{"protocol": "TCP", "port": 8443}])
    );
    find(&objects, "Certificate", "rel-gpu-dra-driver-webhook");
    find(&objects, "Issuer", "rel-gpu-dra-driver-webhook-selfsigned");
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-gpu-dra-driver-node-restriction",
    );
    assert_eq!(
        vap["spec"]["matchConditions"][0]["expression"],
        format!("request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:plugin'")
    );
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    assert_eq!(
        ds["spec"]["template"]["spec"]["serviceAccountName"],
        "plugin"
    );
    // CDI specs name host paths: a driver root other than "/" is mounted at its host path.
    assert_eq!(
        plugin_env(ds, "NVIDIA_DRIVER_ROOT"),
        Some("/run/nvidia/driver")
    );
    assert_eq!(
        plugin_env(ds, "CONTAINER_DRIVER_ROOT"),
        Some("/run/nvidia/driver")
    );
    assert_eq!(
        plugin_env(ds, "NVIDIA_CDI_HOOK_PATH"),
        Some("/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    );
    assert_eq!(ds["spec"]["updateStrategy"]["type"], "RollingUpdate");
    assert_eq!(ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"], 0);
    assert!(mount_paths(ds).contains(&"/run/nvidia/driver"));
    assert!(
        ds["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["hostPath"]["path"] == "/run/nvidia/driver")
    );

    // Only the node side; only the webhook with a provided Secret.
    let objects = render(
        &helm,
        &["webhook.enabled=false", "deviceClasses.enabled=false"],
    );
    let k = kinds(&objects);
    assert!(
        k.iter()
            .all(|k| !k.starts_with("ValidatingWebhookConfiguration/")
                && !k.starts_with("DeviceClass/")),
        "{k:?}"
    );
    let objects = render(
        &helm,
        &[
            "kubeletPlugin.enabled=false",
            "webhook.tls.mode=secret",
            "webhook.tls.secret.name=my-tls",
            "webhook.tls.secret.caBundle=Q0E=",
        ],
    );
    let k = kinds(&objects);
    assert!(
        k.iter().all(|k| !k.starts_with("DaemonSet/")
            && !k.starts_with("ValidatingAdmissionPolicy")
            && !k.starts_with("Secret/")),
        "{k:?}"
    );
    let hook = find(
        &objects,
        "ValidatingWebhookConfiguration",
        "rel-gpu-dra-driver-webhook",
    );
    assert_eq!(hook["webhooks"][0]["clientConfig"]["caBundle"], "Q0E=");
}

#[test]
fn bad_values_are_refused_by_the_schema() {
    let Some(helm) = helm() else { return };
    for (set, want) in [
        ("webhook.failurePolicy=Sometimes", "failurePolicy"),
        ("webhook.tls.mode=none", "mode"),
        ("nvidiaDriverRoot=relative", "nvidiaDriverRoot"),
        ("nvidiaCDIHookPath=relative", "nvidiaCDIHookPath"),
        // Renamed values are refused with the new name (NVIDIA's), not silently ignored.
        (
            "kubeletPlugin.driverRoot=/run/nvidia/driver",
            "renamed to the top-level value nvidiaDriverRoot",
        ),
        (
            "kubeletPlugin.cdiHookPath=/usr/bin/nvidia-cdi-hook",
            "renamed to the top-level value nvidiaCDIHookPath",
        ),
        (
            "kubeletPlugin.updateStrategy.type=Recreate",
            "updateStrategy",
        ),
        ("logFormat=xml", "logFormat"),
        ("webhook.tls.mode=secret", "webhook.tls.secret.name"),
        (
            "webhook.networkPolicy.enabled=true",
            "webhook.networkPolicy.apiServerCIDRs",
        ),
        (
            "webhook.networkPolicy.apiServerCIDRs={10.0.0.1}",
            "apiServerCIDRs",
        ),
        (
            "webhook.topologySpread.whenUnsatisfiable=Sometimes",
            "whenUnsatisfiable",
        ),
        (
            "kubeletPlugin.cleanupOnUninstall=maybe",
            "cleanupOnUninstall",
        ),
        ("priorityClassQuota.pods=0", "pods"),
        ("openshift.enabled=maybe", "openshift"),
        ("checkRole.subjects[0].kind=Robot", "subjects"),
        ("checkRole.workload=maybe", "workload"),
        ("image.digest=0123abcd", "digest"),
        ("image.digest=sha256:0123", "digest"),
        ("openshift.scc=privileged", "openshift"),
        // Typos in our own keys next to NVIDIA's, which are accepted.
        (
            "kubeletPlugin.kubeletRot=/var/lib/k0s/kubelet",
            "kubeletRot",
        ),
        ("kubeletPlugin.metrics.enable=false", "enable"),
        ("webhook.containerport=443", "containerport"),
        ("kubeletPlugin.metrics.metricsPath=/healthz", "metricsPath"),
        (
            "kubeletPlugin.metrics.gpuHttpEndpoint=9400",
            "gpuHttpEndpoint",
        ),
        (
            "kubeletPlugin.kubeletPluginsDirectoryPath=plugins",
            "kubeletPluginsDirectoryPath",
        ),
        (
            "resourceApiVersion=resource.k8s.io/v2",
            "resourceApiVersion",
        ),
        ("resources.gpus.enable=true", "enable"),
        (
            "webhook.tls.mode=cert-manager,webhook.tls.certManager.issuerType=clusterissuer",
            "needs webhook.tls.certManager.issuerName",
        ),
    ] {
        let out = Command::new(&helm)
            .args(["template", "rel"])
            .arg(chart())
            .args(["--kube-version", KUBE_VERSION, "--set", set])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set} accepted");
        assert!(err.contains(want), "{set}: {err}");
    }
}

/// `image.digest` pins every pod of the chart, and the ones the plugin makes, to one image:
/// `repository@digest`, the tag unused; also where NVIDIA's image is replaced by ours.
#[test]
fn a_digest_pins_every_pod_to_one_image() {
    let Some(helm) = helm() else { return };
    let digest = format!("sha256:{}", "0123456789abcdef".repeat(4));
    let images = |objects: &[Value]| -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for o in objects {
            let spec = if o["kind"] == "CronJob" {
                &o["spec"]["jobTemplate"]["spec"]["template"]["spec"]
            } else {
                &o["spec"]["template"]["spec"]
            };
            for c in spec["containers"].as_array().into_iter().flatten() {
                out.insert(c["image"].as_str().expect("image").to_owned());
            }
        }
        let ds = find(objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
        out.insert(
            plugin_env(ds, "MPS_DAEMON_IMAGE")
                .expect("daemon image")
                .to_owned(),
        );
        out
    };
    let tagged = images(&render(&helm, &[]));
    assert_eq!(
        tagged,
        BTreeSet::from([format!(
            "ghcr.io/gpu-dra/gpu-dra-driver:{}",
            chart_app_version()
        )])
    );
    let set = format!("image.digest={digest}");
    let pinned = images(&render(&helm, &[&set, "image.tag=2.0"]));
    assert_eq!(
        pinned,
        BTreeSet::from([format!("ghcr.io/gpu-dra/gpu-dra-driver@{digest}")])
    );
    let own = images(&render(
        &helm,
        &[
            &set,
            "image.repository=registry.example:5000/gpu-dra-driver",
        ],
    ));
    assert_eq!(
        own,
        BTreeSet::from([format!("registry.example:5000/gpu-dra-driver@{digest}")])
    );
    let nvidias = images(&render(
        &helm,
        &[
            &set,
            "image.repository=nvcr.io/nvidia/k8s-dra-driver-gpu",
            "image.tag=v25.3.0",
        ],
    ));
    assert_eq!(
        nvidias,
        BTreeSet::from([format!("ghcr.io/gpu-dra/gpu-dra-driver@{digest}")])
    );
}

/// Env vars of a rendered container.
fn env_names(container: &Value) -> BTreeSet<String> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            e["name"]
                .as_str()
                .expect("rendered chart has the expected shape")
                .to_owned()
        })
        .collect()
}

/// The env twins of the non-hidden flags of the plugin's subcommand `sub`, read from the
/// plugin's own command line (hidden flags are for tests: the chart sets none of them).
fn env_twins(sub: &str) -> BTreeSet<String> {
    let cmd = gpu_dra_kubelet_plugin::cmd::command();
    let sub = cmd
        .find_subcommand(sub)
        .unwrap_or_else(|| panic!("no subcommand {sub}"));
    sub.get_arguments()
        .filter(|a| !a.is_hide_set())
        .map(|a| {
            a.get_env()
                .unwrap_or_else(|| panic!("--{} has no env twin", a.get_id()))
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// `run` flags the chart leaves to their defaults: `KUBECONFIG` (in a pod the in-cluster
/// config is right), `CDI_HOOK_SOURCE` (the image's `nvidia-cdi-hook` is where the default
/// says), `HEALTH_PROBE_INTERVAL_SECONDS` (no chart value: the default suits every node),
/// `DRIVER_CHECK_INTERVAL_SECONDS` and `NVML_UNREACHABLE_GRACE_SECONDS` (a driver upgraded
/// in place: the defaults go with the chart's liveness probe), `WORKER_THREADS` (the default
/// suits every node: the plugin's work waits on I/O).
const RUN_FLAGS_NOT_SET: [&str; 6] = [
    "KUBECONFIG",
    "CDI_HOOK_SOURCE",
    "HEALTH_PROBE_INTERVAL_SECONDS",
    "DRIVER_CHECK_INTERVAL_SECONDS",
    "NVML_UNREACHABLE_GRACE_SECONDS",
    "WORKER_THREADS",
];

/// The chart configures the plugin through the env twins of its flags, as the plugin defines
/// them (`gpu_dra_kubelet_plugin::cmd::command`), so a typo or a renamed flag fails here:
/// (a) every env var of a container that runs one of our subcommands is the twin of a flag of
/// that subcommand; (b) the plugin's container sets every `run` flag but
/// [`RUN_FLAGS_NOT_SET`] (with every optional value given), and every `cleanup` flag, since
/// the uninstall hook's cleanup pods are that container running `cleanup`; (c) the hook Job's
/// command line parses as the plugin parses it.
#[test]
fn the_chart_configures_the_plugin_by_the_env_twins_of_its_flags() {
    let Some(helm) = helm() else { return };
    let run = env_twins("run");
    let cleanup = env_twins("cleanup");
    let uninstall = env_twins("uninstall");
    let all_optional = [
        "kubeletPlugin.nvmlLib=/usr/lib64/libnvidia-ml.so.1",
        "nvidiaCDIHookPath=/usr/local/nvidia/toolkit/nvidia-cdi-hook",
        "kubeletPlugin.mpsDaemonPods=true",
        "imagePullSecrets[0].name=registry-credentials",
    ];
    for sets in [&[][..], &all_optional[..]] {
        let objects = render(&helm, sets);
        let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
        let plugin = &ds["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            strs(&plugin["command"]),
            ["/usr/local/bin/gpu-kubelet-plugin", "run"]
        );
        let env = env_names(plugin);
        let unknown: Vec<&String> = env.difference(&run).collect();
        assert!(
            unknown.is_empty(),
            "{sets:?}: not flags of run: {unknown:?}"
        );

        let job = find(&objects, "Job", "rel-gpu-dra-driver-uninstall");
        let hook = &job["spec"]["template"]["spec"]["containers"][0];
        let hook_env = env_names(hook);
        let unknown: Vec<&String> = hook_env.difference(&uninstall).collect();
        assert!(unknown.is_empty(), "not flags of uninstall: {unknown:?}");
        let line = strs(&hook["command"]);
        assert_eq!(line[1], "uninstall");
        if let Err(e) = gpu_dra_kubelet_plugin::cmd::command().try_get_matches_from(&line) {
            panic!("the hook's command line {line:?} does not parse: {e}");
        }
    }

    let objects = render(&helm, &all_optional);
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let env = env_names(&ds["spec"]["template"]["spec"]["containers"][0]);
    let missing: Vec<&String> = run
        .iter()
        .filter(|name| !RUN_FLAGS_NOT_SET.contains(&name.as_str()))
        .filter(|name| !env.contains(*name))
        .collect();
    assert!(
        missing.is_empty(),
        "run flags the chart does not set: {missing:?}"
    );
    for name in RUN_FLAGS_NOT_SET {
        assert!(
            run.contains(name),
            "{name} is no run flag's env twin any more"
        );
    }
    let missing: Vec<&String> = cleanup.difference(&env).collect();
    assert!(
        missing.is_empty(),
        "cleanup flags the plugin's container (the cleanup pods') does not set: {missing:?}"
    );
}

/// `helm uninstall` runs a pre-delete hook Job that stops the node plugins and cleans every
/// node: its ServiceAccount and RBAC are hook-scoped and created before it, it names the
/// chart's DaemonSet and runs the chart's image, unprivileged; the value switches it off.
#[test]
fn uninstall_hook_restores_the_nodes() {
    let Some(helm) = helm() else { return };
    let objects = render(&helm, &[]);
    let name = "rel-gpu-dra-driver-uninstall";
    let job = find(&objects, "Job", name);
    let hook_of = |o: &Value| {
        let a = &o["metadata"]["annotations"];
        assert_eq!(a["helm.sh/hook"], "pre-delete", "{o}");
        let policy = a["helm.sh/hook-delete-policy"].as_str().unwrap_or_default();
        assert!(
            policy.split(',').any(|p| p == "before-hook-creation")
                && policy.split(',').any(|p| p == "hook-succeeded"),
            "{policy}"
        );
        a["helm.sh/hook-weight"]
            .as_str()
            .and_then(|w| w.parse::<i32>().ok())
            .expect("a numeric hook weight")
    };
    let job_weight = hook_of(job);
    for kind in ["ServiceAccount", "Role", "RoleBinding"] {
        let o = find(&objects, kind, name);
        assert!(hook_of(o) < job_weight, "{kind} must exist before the Job");
        assert_eq!(o["metadata"]["namespace"], NAMESPACE);
    }
    let role = find(&objects, "Role", name);
    let rules = role["rules"].as_array().unwrap();
    let ds_name = "rel-gpu-dra-driver-kubelet-plugin";
    let ds = find(&objects, "DaemonSet", ds_name);
    assert!(
        rules
            .iter()
            .any(|r| r["resources"] == serde_json::json!(["daemonsets"])
                && strs(&r["resourceNames"]) == [ds_name]
                && strs(&r["verbs"]) == ["get", "patch"]),
        "{role}"
    );
    assert!(
        rules
            .iter()
            .any(|r| r["resources"] == serde_json::json!(["pods"])
                && ["get", "list", "create", "delete"]
                    .iter()
                    .all(|v| strs(&r["verbs"]).contains(v))),
        "{role}"
    );
    let binding = find(&objects, "RoleBinding", name);
    assert_eq!(binding["subjects"][0]["name"], name);
    assert_eq!(binding["roleRef"]["name"], name);

    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], name);
    assert_eq!(pod["restartPolicy"], "Never");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let ctr = &pod["containers"][0];
    assert_eq!(
        ctr["image"], ds["spec"]["template"]["spec"]["containers"][0]["image"],
        "the chart's image"
    );
    assert_eq!(
        strs(&ctr["command"]),
        [
            "/usr/local/bin/gpu-kubelet-plugin",
            "uninstall",
            &format!("--namespace={NAMESPACE}"),
            &format!("--daemonset={ds_name}"),
        ]
    );
    assert_eq!(ctr["securityContext"]["allowPrivilegeEscalation"], false);
    assert!(ctr["securityContext"]["privileged"].is_null());

    for off in [
        "kubeletPlugin.cleanupOnUninstall=false",
        "kubeletPlugin.enabled=false",
    ] {
        let k = kinds(&render(&helm, &[off]));
        assert!(k.iter().all(|k| !k.ends_with("-uninstall")), "{off}: {k:?}");
    }
}

/// Evaluates one CEL expression of the policy against `vars` (request, object, oldObject,
/// variables).
fn eval(expr: &str, vars: &Value) -> cel::Value {
    let program =
        cel::Program::compile(expr).unwrap_or_else(|e| panic!("policy CEL {expr:?}: {e}"));
    let mut ctx = cel::Context::default();
    for (name, value) in vars.as_object().expect("variables are an object") {
        ctx.add_variable_from_value(
            name.as_str(),
            cel::to_value(value).expect("JSON converts to CEL"),
        );
    }
    program
        .execute(&ctx)
        .unwrap_or_else(|e| panic!("policy CEL {expr:?} on {vars}: {e}"))
}

/// A CEL value as JSON (the policy's variables are strings, lists and maps of them).
fn cel_json(value: &cel::Value) -> Option<Value> {
    Some(match value {
        cel::Value::String(s) => Value::String(s.to_string()),
        cel::Value::Bool(b) => Value::Bool(*b),
        cel::Value::Int(i) => Value::from(*i),
        cel::Value::UInt(u) => Value::from(*u),
        cel::Value::Null => Value::Null,
        cel::Value::List(items) => Value::Array(items.iter().map(cel_json).collect::<Option<_>>()?),
        cel::Value::Map(map) => Value::Object(
            map.map
                .iter()
                .map(|(k, v)| match k {
                    cel::objects::Key::String(k) => Some((k.to_string(), cel_json(v)?)),
                    _ => None,
                })
                .collect::<Option<_>>()?,
        ),
        _ => return None,
    })
}

/// What the node-restriction policy decides: `None` when it does not apply to the request,
/// else the messages of the failed validations (empty: allowed).
fn node_policy(
    vap: &Value,
    user: &str,
    extra: Value,
    op: &str,
    object: Value,
    old: Value,
) -> Option<Vec<String>> {
    // Pods are told apart by their shape here (a slice has spec.driver, a claim a status).
    let of = if op == "DELETE" { &old } else { &object };
    let (resource, sub) = if of["spec"]["containers"].is_array() {
        ("pods", "")
    } else if of.get("status").is_some() {
        ("resourceclaims", "status")
    } else {
        ("resourceslices", "")
    };
    let spec = &vap["spec"];
    let mut vars = serde_json::json!({
        "request": {"operation": op, "resource": {"resource": resource}, "subResource": sub,
            "userInfo": {"username": user, "extra": extra}},
        "object": object,
        "oldObject": old,
    });
    for cond in spec["matchConditions"].as_array().expect("matchConditions") {
        let expr = cond["expression"].as_str().expect("expression");
        if eval(expr, &vars) != cel::Value::Bool(true) {
            return None;
        }
    }
    let mut variables = serde_json::Map::new();
    for var in spec["variables"].as_array().expect("variables") {
        let expr = var["expression"].as_str().expect("expression");
        let value = cel_json(&eval(expr, &vars))
            .unwrap_or_else(|| panic!("variable {} is not plain data", var["name"]));
        variables.insert(var["name"].as_str().expect("name").to_owned(), value);
        vars["variables"] = Value::Object(variables.clone());
    }
    let mut failed = Vec::new();
    for v in spec["validations"].as_array().expect("validations") {
        if eval(v["expression"].as_str().expect("expression"), &vars) == cel::Value::Bool(true) {
            continue;
        }
        let message = match v["messageExpression"].as_str() {
            Some(m) => match eval(m, &vars) {
                cel::Value::String(s) => s.to_string(),
                other => panic!("messageExpression gave {other:?}"),
            },
            None => v["message"].as_str().expect("message").to_owned(),
        };
        failed.push(message);
    }
    Some(failed)
}

#[test]
fn node_restriction_policy_keeps_each_plugin_to_its_node() {
    let Some(helm) = helm() else { return };
    let objects = render(&helm, &[]);
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-gpu-dra-driver-node-restriction",
    );
    let plugin = format!("system:serviceaccount:{NAMESPACE}:rel-gpu-dra-driver-kubelet-plugin");
    let on_a = serde_json::json!({"authentication.kubernetes.io/node-name": ["node-a"],
        "authentication.kubernetes.io/pod-name": ["plugin-xyz"]});
    let slice = |node: Option<&str>| match node {
        Some(n) => serde_json::json!({"spec": {"driver": "gpu.nvidia.com", "nodeName": n,
            "pool": {"name": n}}}),
        None => serde_json::json!({"spec": {"driver": "gpu.nvidia.com", "allNodes": true,
            "pool": {"name": "node-a"}}}),
    };
    let null = Value::Null;

    // Its own node: allowed, for every operation.
    let ok = Some(vec![]);
    assert_eq!(
        node_policy(
            vap,
            &plugin,
            on_a.clone(),
            "CREATE",
            slice(Some("node-a")),
            null.clone()
        ),
        ok
    );
    assert_eq!(
        node_policy(
            vap,
            &plugin,
            on_a.clone(),
            "UPDATE",
            slice(Some("node-a")),
            slice(Some("node-a"))
        ),
        ok
    );
    assert_eq!(
        node_policy(
            vap,
            &plugin,
            on_a.clone(),
            "DELETE",
            null.clone(),
            slice(Some("node-a"))
        ),
        ok
    );

    // Another node's slices, or a slice for no single node: denied with a clear message.
    let denied = node_policy(
        vap,
        &plugin,
        on_a.clone(),
        "CREATE",
        slice(Some("node-b")),
        null.clone(),
    )
    .expect("applies");
    assert_eq!(
        denied,
        [
            "the kubelet plugin on node node-a may only write ResourceSlices with spec.nodeName node-a, not \"node-b\"",
            "the kubelet plugin on node node-a may only write ResourceSlices of pool node-a (its node), not \"node-b\"",
        ]
    );
    for (op, object, old) in [
        ("CREATE", slice(None), null.clone()),
        ("DELETE", null.clone(), slice(Some("node-b"))),
        ("UPDATE", slice(Some("node-a")), slice(Some("node-b"))),
    ] {
        let failed = node_policy(vap, &plugin, on_a.clone(), op, object, old).expect("applies");
        assert!(!failed.is_empty(), "{op} allowed");
    }

    // A token without the node claim (not bound to a pod on a node): denied.
    let failed = node_policy(
        vap,
        &plugin,
        serde_json::json!({}),
        "CREATE",
        slice(Some("node-a")),
        null.clone(),
    )
    .expect("applies");
    assert!(failed[0].contains("carries no node name"), "{failed:?}");

    // Other users (the kubelet cleaning up, an admin, a wrongly named account) are not matched.
    for user in [
        "system:node:node-a",
        "kubernetes-admin",
        "system:serviceaccount:other:rel-gpu-dra-driver-kubelet-plugin",
    ] {
        assert_eq!(
            node_policy(
                vap,
                user,
                on_a.clone(),
                "CREATE",
                slice(Some("node-b")),
                null.clone()
            ),
            None,
            "{user}"
        );
    }

    // MPS daemon pods: only on its own node, only daemon pods.
    let pod = |node: &str, component: Option<&str>| {
        let mut pod = plugin_daemon_pod(&objects, node);
        let labels = pod["metadata"]["labels"].as_object_mut().expect("labels");
        match component {
            Some(c) => labels.insert("app.kubernetes.io/component".into(), c.into()),
            None => labels.remove("app.kubernetes.io/component"),
        };
        pod
    };
    let daemon = Some("mps-control-daemon");
    assert_eq!(
        node_policy(
            vap,
            &plugin,
            on_a.clone(),
            "CREATE",
            pod("node-a", daemon),
            null.clone()
        ),
        Some(vec![])
    );
    assert_eq!(
        node_policy(
            vap,
            &plugin,
            on_a.clone(),
            "DELETE",
            null.clone(),
            pod("node-a", daemon)
        ),
        Some(vec![])
    );
    let refused = node_policy(
        vap,
        &plugin,
        on_a.clone(),
        "CREATE",
        pod("node-b", daemon),
        null.clone(),
    )
    .unwrap();
    assert!(
        refused.len() == 1 && refused[0].contains("may only write pods with spec.nodeName node-a"),
        "{refused:?}"
    );
    for component in [None, Some("webhook")] {
        let refused = node_policy(
            vap,
            &plugin,
            on_a.clone(),
            "CREATE",
            pod("node-a", component),
            null.clone(),
        )
        .unwrap();
        assert!(
            refused.len() == 1
                && refused[0].contains("only create and delete MPS control daemon pods"),
            "{component:?}: {refused:?}"
        );
    }
}

#[test]
fn webhook_is_sent_only_objects_with_configs_or_selectors_for_our_driver() {
    let Some(helm) = helm() else { return };
    let objects = render(&helm, &[]);
    let vwc = find(
        &objects,
        "ValidatingWebhookConfiguration",
        "rel-gpu-dra-driver-webhook",
    );
    let hook = |resource: &str| {
        vwc["webhooks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|h| h["rules"][0]["resources"][0] == resource)
            .unwrap_or_else(|| panic!("no webhook for {resource}"))
            .clone()
    };
    // True when every matchCondition holds, as the API server decides whether to call.
    let sent = |hook: &Value, op: &str, object: Value, old: Value| {
        let vars =
            serde_json::json!({"request": {"operation": op}, "object": object, "oldObject": old});
        hook["matchConditions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| eval(c["expression"].as_str().unwrap(), &vars) == cel::Value::Bool(true))
    };
    let cfg = |driver: &str| serde_json::json!({"requests": ["gpu"], "opaque": {"driver": driver, "parameters": {}}});
    let ours = cfg("gpu.nvidia.com");
    let other = cfg("example.com");
    let requests =
        serde_json::json!([{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]);
    let devices = |config: Option<Value>| match config {
        Some(c) => serde_json::json!({"requests": requests, "config": c}),
        None => serde_json::json!({"requests": requests}),
    };
    let null = Value::Null;

    let claims = hook("resourceclaims");
    let claim = |d: Value| serde_json::json!({"spec": {"devices": d}});
    let mixed = serde_json::json!([other, ours]);
    assert!(sent(
        &claims,
        "CREATE",
        claim(devices(Some(mixed.clone()))),
        null.clone()
    ));
    for not_ours in [
        claim(devices(Some(serde_json::json!([other])))),
        claim(devices(Some(serde_json::json!([{"requests": ["gpu"]}])))),
        claim(devices(Some(serde_json::json!([])))),
        claim(devices(None)),
        serde_json::json!({"spec": {}}),
    ] {
        assert!(
            !sent(&claims, "CREATE", not_ours.clone(), null.clone()),
            "{not_ours}"
        );
    }

    // Selectors on our DeviceClasses are linted (warnings only); other classes' are not sent.
    let selecting = |class: &str| {
        serde_json::json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": class,
            "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].index == 0"}}]}}]}}})
    };
    assert!(sent(
        &claims,
        "CREATE",
        selecting("gpu.nvidia.com"),
        null.clone()
    ));
    assert!(sent(
        &claims,
        "CREATE",
        selecting("mig.nvidia.com"),
        null.clone()
    ));
    assert!(!sent(
        &claims,
        "CREATE",
        selecting("example.com"),
        null.clone()
    ));
    let first_available = serde_json::json!({"spec": {"devices": {"requests": [{"name": "gpu",
        "firstAvailable": [{"name": "a", "deviceClassName": "mig.nvidia.com",
            "selectors": [{"cel": {"expression": "true"}}]}]}]}}});
    assert!(sent(&claims, "CREATE", first_available, null.clone()));

    let templates = hook("resourceclaimtemplates");
    let template = |d: Value| serde_json::json!({"spec": {"spec": {"devices": d}}});
    assert!(sent(
        &templates,
        "CREATE",
        template(devices(Some(mixed.clone()))),
        null.clone()
    ));
    assert!(!sent(
        &templates,
        "CREATE",
        template(devices(Some(serde_json::json!([other])))),
        null.clone()
    ));
    assert!(!sent(
        &templates,
        "CREATE",
        template(devices(None)),
        null.clone()
    ));
    assert!(!sent(
        &templates,
        "CREATE",
        serde_json::json!({"spec": {"spec": {}}}),
        null.clone()
    ));

    let classes = hook("deviceclasses");
    let class = |config: Value, label: &str| serde_json::json!({"metadata": {"labels": {"l": label}}, "spec": {"selectors": [], "config": config}});
    let with_ours = class(serde_json::json!([ours]), "a");
    assert!(sent(&classes, "CREATE", with_ours.clone(), null.clone()));
    assert!(!sent(
        &classes,
        "CREATE",
        class(serde_json::json!([other]), "a"),
        null.clone()
    ));
    assert!(!sent(
        &classes,
        "CREATE",
        serde_json::json!({"spec": {"selectors": []}}),
        null.clone()
    ));
    let naming = |driver: &str| {
        serde_json::json!({"spec": {"selectors": [{"cel": {"expression":
        format!("device.driver == '{driver}' && device.attributes['{driver}'].index == 0")}}]}})
    };
    assert!(sent(
        &classes,
        "CREATE",
        naming("gpu.nvidia.com"),
        null.clone()
    ));
    assert!(!sent(
        &classes,
        "CREATE",
        naming("example.com"),
        null.clone()
    ));
    // UPDATE: only when the spec changed; a label edit is not reviewed.
    assert!(!sent(
        &classes,
        "UPDATE",
        class(serde_json::json!([ours]), "b"),
        with_ours.clone()
    ));
    let changed = class(serde_json::json!([ours, ours]), "a");
    assert!(sent(&classes, "UPDATE", changed, with_ours.clone()));
}

/// The values file of a user of NVIDIA's chart (v0.5), every key of its values.yaml.
fn nvidia_values() -> PathBuf {
    repo().join("crates/repo-tests/tests/testdata/nvidia-v0.5-values.yaml")
}

/// The install notes (NOTES.txt) as `helm install` prints them, rendered offline: `helm
/// template` leaves NOTES.txt out and `helm install --dry-run` needs a cluster, so a copy of
/// the chart renders the real file through `tpl` into a ConfigMap.
fn render_notes(helm: &Path, args: &[&str]) -> String {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).expect("copy of the chart");
        for entry in std::fs::read_dir(from).expect("chart folder") {
            let entry = entry.expect("chart file");
            let path = entry.path();
            if path.is_dir() {
                copy(&path, &to.join(entry.file_name()));
            } else {
                std::fs::copy(&path, to.join(entry.file_name())).expect("copy of a chart file");
            }
        }
    }
    let chart = repo().join("deploy/helm/gpu-dra-driver");
    let copied = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("notes-chart-{}-{}", std::process::id(), {
            // Tests run in parallel threads of one process: each call its own copy.
            static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        }))
        .join("gpu-dra-driver");
    let _ = std::fs::remove_dir_all(&copied);
    copy(&chart, &copied);
    std::fs::copy(chart.join("templates/NOTES.txt"), copied.join("notes.tpl")).expect("notes");
    std::fs::write(
        copied.join("templates/rendered-notes.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: rendered-notes\ndata:\n  notes: {{ tpl (.Files.Get \"notes.tpl\") . | quote }}\n",
    )
    .expect("notes template");
    let out = Command::new(helm)
        .args(["template", "rel"])
        .arg(&copied)
        .args(["--namespace", NAMESPACE, "--kube-version", KUBE_VERSION])
        .args(["--show-only", "templates/rendered-notes.yaml"])
        .args(args)
        .output()
        .expect("helm runs");
    let _ = std::fs::remove_dir_all(copied.parent().expect("temp folder"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value =
        serde_saphyr::from_str(&String::from_utf8_lossy(&out.stdout)).expect("the notes ConfigMap");
    doc["data"]["notes"]
        .as_str()
        .expect("rendered notes")
        .to_owned()
}

/// A values file written for NVIDIA's chart (v0.5), with every key of its values.yaml, installs
/// unchanged: the values with an equivalent here show their effect in the rendered objects
/// (host paths, ports, network policy, labels, webhook and TLS settings), the rest are named by
/// the install notes.
#[test]
fn a_values_file_written_for_nvidias_chart_installs() {
    let Some(helm) = helm() else { return };
    let values = nvidia_values();
    let values = values.to_str().unwrap();
    let objects = render_args(&helm, &["--values", values]);

    // The node plugin, at a k0s kubelet's folders.
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let plugin_dir = "/var/lib/k0s/kubelet/plugins/gpu.nvidia.com";
    let registrar_dir = "/var/lib/k0s/kubelet/plugins_registry";
    assert_eq!(plugin_env(ds, "PLUGIN_DIR"), Some(plugin_dir));
    assert_eq!(plugin_env(ds, "REGISTRAR_DIR"), Some(registrar_dir));
    assert_eq!(plugin_env(ds, "CONSUMABLE_SHARES"), Some("memory"));
    let pod = &ds["spec"]["template"]["spec"];
    let host_paths: Vec<&str> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    let mounts = mount_paths(ds);
    // The kubelet's PodResources folder next to its plugins folder.
    let pod_resources = "/var/lib/k0s/kubelet/pod-resources";
    assert_eq!(
        plugin_env(ds, "KUBELET_POD_RESOURCES_SOCKET"),
        Some("/var/lib/k0s/kubelet/pod-resources/kubelet.sock")
    );
    for p in [plugin_dir, registrar_dir, pod_resources] {
        assert!(host_paths.contains(&p), "{p}: {host_paths:?}");
        assert!(mounts.contains(&p), "{p}: {mounts:?}");
    }
    assert!(
        !host_paths.iter().any(|p| p.starts_with("/var/lib/kubelet")),
        "{host_paths:?}"
    );
    // Metrics on NVIDIA's endpoint port, every address (the probes use the same server).
    assert_eq!(plugin_env(ds, "HTTP_ADDRESS"), Some("0.0.0.0:9400"));
    assert_eq!(plugin_env(ds, "METRICS_PATH"), Some("/metrics"));
    let container = &pod["containers"][0];
    assert_eq!(container["ports"][0]["containerPort"], 9400);
    assert_eq!(container["livenessProbe"]["httpGet"]["port"], "http");
    // NVIDIA's GPU container values apply to ours.
    assert_eq!(
        container["resources"],
        serde_json::json!({"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}})
    );
    assert_eq!(
        plugin_env(ds, "HTTPS_PROXY"),
        Some("http://proxy.example.internal:3128")
    );
    assert_eq!(container["securityContext"]["privileged"], true);
    assert_eq!(container["securityContext"]["runAsUser"], 0);
    // The values of the same meaning carry over.
    assert_eq!(
        plugin_env(ds, "NVIDIA_DRIVER_ROOT"),
        Some("/run/nvidia/driver")
    );
    assert_eq!(
        plugin_env(ds, "NVIDIA_CDI_HOOK_PATH"),
        Some("/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    );
    assert_eq!(pod["nodeSelector"]["nvidia.com/gpu.present"], "true");
    assert_eq!(
        pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["key"],
        "nvidia.com/gpu.present"
    );
    assert_eq!(pod["imagePullSecrets"][0]["name"], "registry-credentials");
    assert_eq!(
        ds["spec"]["template"]["metadata"]["annotations"]["team"],
        "gpu"
    );
    assert_eq!(
        ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"],
        "100%"
    );
    // NVIDIA's image has none of our binaries: ours runs, with NVIDIA's pull policy.
    // (the chart's default image: values.yaml and the helper that replaces NVIDIA's agree).
    let defaults = render(&helm, &[]);
    let default_ds = find(&defaults, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let image = default_ds["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .expect("image")
        .to_owned();
    assert_eq!(
        image,
        format!("ghcr.io/gpu-dra/gpu-dra-driver:{}", chart_app_version())
    );
    assert_eq!(container["image"], image.as_str());
    assert_eq!(container["imagePullPolicy"], "Always");
    assert_eq!(
        plugin_env(ds, "MPS_DAEMON_IMAGE"),
        Some(image.as_str()),
        "the daemon pods run it too"
    );

    // kubeletPlugin.networkPolicy: egress to the API server's ports only, from plugin pods.
    let np = find(
        &objects,
        "NetworkPolicy",
        "rel-gpu-dra-driver-kubelet-plugin",
    );
    assert_eq!(strs(&np["spec"]["policyTypes"]), ["Egress"]);
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"],
        serde_json::json!({"app.kubernetes.io/instance": "rel", "app.kubernetes.io/component": "kubelet-plugin"})
    );
    assert_eq!(
        np["spec"]["egress"],
        serde_json::json!([{"ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}])
    );
    assert!(
        np["spec"].get("ingress").is_none(),
        "no ingress rule unless asked"
    );

    // The webhook, with NVIDIA's port 443 (bindable without privileges), priority class,
    // strategy, pod security context (merged over ours), resources, and cert-manager issuer.
    let deploy = find(&objects, "Deployment", "rel-gpu-dra-driver-webhook");
    let wpod = &deploy["spec"]["template"]["spec"];
    let wc = &wpod["containers"][0];
    assert_eq!(deploy["spec"]["replicas"], 2);
    assert_eq!(wc["ports"][0]["containerPort"], 443);
    assert_eq!(
        wc["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "BIND_ADDRESS")
            .unwrap()["value"],
        "0.0.0.0:443"
    );
    assert_eq!(
        wpod["securityContext"]["sysctls"],
        serde_json::json!([{"name": "net.ipv4.ip_unprivileged_port_start", "value": "443"}])
    );
    assert_eq!(wpod["securityContext"]["fsGroup"], 65532);
    assert_eq!(wpod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(wpod["priorityClassName"], "system-cluster-critical");
    assert_eq!(
        deploy["spec"]["strategy"],
        serde_json::json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}})
    );
    assert_eq!(
        wc["resources"],
        serde_json::json!({"requests": {"cpu": "50m", "memory": "48Mi"}})
    );
    assert_eq!(wc["securityContext"]["privileged"], false);
    assert_eq!(wc["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        wpod["nodeSelector"]["node-role.kubernetes.io/control-plane"],
        ""
    );
    let service = find(&objects, "Service", "rel-gpu-dra-driver-webhook");
    assert_eq!(service["spec"]["ports"][0]["port"], 443);
    let cert = find(&objects, "Certificate", "rel-gpu-dra-driver-webhook");
    assert_eq!(
        cert["spec"]["issuerRef"],
        serde_json::json!({"kind": "ClusterIssuer", "name": "cluster-ca"})
    );
    assert!(strs(&cert["spec"]["dnsNames"]).contains(&"gpu-webhook.example.internal"));
    assert!(
        !kinds(&objects).iter().any(|k| k.starts_with("Issuer/")),
        "their cluster issuer, not a self-signed one"
    );
    let hook = find(
        &objects,
        "ValidatingWebhookConfiguration",
        "rel-gpu-dra-driver-webhook",
    );
    assert_eq!(hook["webhooks"][0]["failurePolicy"], "Fail");
    assert_eq!(
        hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        format!("{NAMESPACE}/rel-gpu-dra-driver-webhook")
    );
    // The quota admits both critical classes (GKE).
    let quota = find(
        &objects,
        "ResourceQuota",
        "rel-gpu-dra-driver-critical-pods",
    );
    assert_eq!(
        strs(&quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"]),
        ["system-node-critical", "system-cluster-critical"]
    );

    // The plugin's MPS daemon pods, built with these folders, pass the node policy.
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-gpu-dra-driver-node-restriction",
    );
    let daemon = plugin_daemon_pod(&objects, "node-a");
    assert_eq!(
        node_policy(
            vap,
            &format!("system:serviceaccount:{NAMESPACE}:rel-gpu-dra-driver-kubelet-plugin"),
            serde_json::json!({"authentication.kubernetes.io/node-name": ["node-a"]}),
            "CREATE",
            daemon.clone(),
            Value::Null,
        ),
        Some(Vec::new()),
        "{daemon}"
    );

    // What has no equivalent is named, and only that.
    let notes = render_notes(&helm, &["--values", values]);
    let ignored = notes
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "Ignored values of NVIDIA's chart, which have no equivalent in this one: ",
            )
        })
        .unwrap_or_else(|| panic!("no ignored values named:\n{notes}"));
    assert_eq!(
        ignored
            .trim_end_matches('.')
            .split(", ")
            .collect::<Vec<_>>(),
        [
            "altProcDevices",
            "gpuResourcesEnabledOverride",
            "serviceAccount",
            "resources.computeDomains.enabled",
            "featureGates",
            "logVerbosity",
            "controller",
            "kubeletPlugin.metrics.computeDomainHttpEndpoint",
            "kubeletPlugin.containers.computeDomains",
            "kubeletPlugin.containers.gpus.healthcheckPort",
        ],
        "{notes}"
    );
    assert!(
        notes.contains(
            "registry.k8s.io/dra-driver-nvidia/dra-driver-nvidia-gpu is NVIDIA's driver image"
        ),
        "{notes}"
    );
    // Our own defaults name nothing.
    let notes = render_notes(&helm, &[]);
    assert!(!notes.contains("NVIDIA's"), "{notes}");
}

fn chart_app_version() -> String {
    let chart = std::fs::read_to_string(repo().join("deploy/helm/gpu-dra-driver/Chart.yaml"))
        .expect("Chart.yaml");
    chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .expect("appVersion")
        .trim()
        .trim_matches('"')
        .to_owned()
}

/// NVIDIA's values that change what is rendered, one at a time: the metrics switched off or on
/// another port and path, the host part of the endpoint (ignored, and said so), the GPU plugin
/// turned off, the DeviceClasses' API version, names and namespace overrides, their TLS mode
/// with a named issuer, and our `kubeletRoot` still in force where their folders are unset.
#[test]
fn nvidias_values_take_effect_one_by_one() {
    let Some(helm) = helm() else { return };
    let ds_of = |objects: &[Value]| -> Value {
        find(objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin").clone()
    };

    let objects = render(&helm, &["kubeletPlugin.metrics.enabled=false"]);
    let ds = ds_of(&objects);
    assert_eq!(plugin_env(&ds, "METRICS_PATH"), Some(""));
    assert_eq!(plugin_env(&ds, "HTTP_ADDRESS"), Some("0.0.0.0:8080"));

    let sets = [
        "kubeletPlugin.metrics.gpuHttpEndpoint=127.0.0.1:9100",
        "kubeletPlugin.metrics.metricsPath=/gpu/metrics",
    ];
    let ds = ds_of(&render(&helm, &sets));
    assert_eq!(plugin_env(&ds, "HTTP_ADDRESS"), Some("0.0.0.0:9100"));
    assert_eq!(plugin_env(&ds, "METRICS_PATH"), Some("/gpu/metrics"));
    let args: Vec<&str> = sets.iter().flat_map(|s| ["--set", *s]).collect();
    let notes = render_notes(&helm, &args);
    assert!(
        notes.contains(
            "kubeletPlugin.metrics.gpuHttpEndpoint 127.0.0.1:9100: its host part is ignored"
        ),
        "{notes}"
    );
    let ds = ds_of(&render(
        &helm,
        &["kubeletPlugin.metrics.gpuHttpEndpoint=[::]:9100"],
    ));
    assert_eq!(plugin_env(&ds, "HTTP_ADDRESS"), Some("[::]:9100"));

    // kubeletRoot still places both folders; each NVIDIA folder value wins on its own.
    let ds = ds_of(&render(
        &helm,
        &[
            "kubeletPlugin.kubeletRoot=/var/data/kubelet",
            "kubeletPlugin.kubeletRegistrarDirectoryPath=/var/snap/microk8s/common/var/lib/kubelet/plugins_registry/",
        ],
    ));
    assert_eq!(
        plugin_env(&ds, "PLUGIN_DIR"),
        Some("/var/data/kubelet/plugins/gpu.nvidia.com")
    );
    assert_eq!(
        plugin_env(&ds, "REGISTRAR_DIR"),
        Some("/var/snap/microk8s/common/var/lib/kubelet/plugins_registry")
    );

    // resources.gpus.enabled false: neither the node side nor the DeviceClasses.
    let k = kinds(&render(&helm, &["resources.gpus.enabled=false"]));
    assert!(
        k.iter().all(|k| !k.starts_with("DaemonSet/")
            && !k.starts_with("DeviceClass/")
            && !k.starts_with("ValidatingAdmissionPolicy")
            && !k.starts_with("ClusterRole/")),
        "{k:?}"
    );
    assert!(k.iter().any(|k| k.starts_with("Deployment/")), "{k:?}");

    let objects = render(&helm, &["resourceApiVersion=resource.k8s.io/v1beta1"]);
    assert_eq!(
        find(&objects, "DeviceClass", "gpu.nvidia.com")["apiVersion"],
        "resource.k8s.io/v1beta1"
    );

    // Names and namespace, as NVIDIA's chart overrides them; NVIDIA's label key follows
    // nameOverride there, so it does here.
    let objects = render(
        &helm,
        &[
            "nameOverride=nvidia-dra-driver-gpu",
            "namespaceOverride=gpu-operator",
        ],
    );
    let ds = find(
        &objects,
        "DaemonSet",
        "rel-nvidia-dra-driver-gpu-kubelet-plugin",
    );
    assert_eq!(ds["metadata"]["namespace"], "gpu-operator");
    assert_eq!(
        ds["spec"]["template"]["metadata"]["labels"]["nvidia-dra-driver-gpu-component"],
        "kubelet-plugin"
    );
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-nvidia-dra-driver-gpu-node-restriction",
    );
    assert_eq!(
        vap["spec"]["matchConditions"][0]["expression"],
        "request.userInfo.username == 'system:serviceaccount:gpu-operator:rel-nvidia-dra-driver-gpu-kubelet-plugin'"
    );
    for o in &objects {
        if let Some(ns) = o["metadata"]["namespace"].as_str() {
            let name = o["metadata"]["name"].as_str().unwrap();
            // Events about Nodes go to `default`, where the API server keeps them.
            let want = if name.ends_with("-kubelet-plugin-events") {
                "default"
            } else {
                "gpu-operator"
            };
            assert_eq!(ns, want, "{name}");
        }
    }
    let objects = render(&helm, &["fullnameOverride=gpu"]);
    find(&objects, "DaemonSet", "gpu-kubelet-plugin");
    find(&objects, "Deployment", "gpu-webhook");

    // NVIDIA's TLS mode name with a namespaced issuer; a self-signed one is the chart's.
    let objects = render(
        &helm,
        &[
            "webhook.tls.mode=cert-manager",
            "webhook.tls.certManager.issuerType=issuer",
            "webhook.tls.certManager.issuerName=ca",
        ],
    );
    assert_eq!(
        find(&objects, "Certificate", "rel-gpu-dra-driver-webhook")["spec"]["issuerRef"],
        serde_json::json!({"kind": "Issuer", "name": "ca"})
    );
    let objects = render(&helm, &["webhook.tls.mode=cert-manager"]);
    find(&objects, "Issuer", "rel-gpu-dra-driver-webhook-selfsigned");

    // NVIDIA's webhook service account: named, or not created.
    let objects = render(
        &helm,
        &[
            "webhook.serviceAccount.create=false",
            "webhook.serviceAccount.name=shared",
        ],
    );
    let deploy = find(&objects, "Deployment", "rel-gpu-dra-driver-webhook");
    assert_eq!(
        deploy["spec"]["template"]["spec"]["serviceAccountName"],
        "shared"
    );
    assert!(
        !kinds(&objects).contains(&"ServiceAccount/rel-gpu-dra-driver-webhook".to_owned()),
        "not created"
    );
    // Ports of 1024 and up need no sysctl.
    let objects = render(&helm, &[]);
    let deploy = find(&objects, "Deployment", "rel-gpu-dra-driver-webhook");
    assert!(
        deploy["spec"]["template"]["spec"]["securityContext"]
            .get("sysctls")
            .is_none()
    );
}

/// The pods carry the component label NVIDIA's chart selects by (its runbooks' `kubectl get
/// pods -l dra-driver-nvidia-gpu-component=kubelet-plugin`), on the pod template only: the
/// selectors stay as every earlier release of this chart had them, since a selector cannot
/// change on `helm upgrade`.
#[test]
fn pods_carry_nvidias_component_labels_and_selectors_stay() {
    let Some(helm) = helm() else { return };
    let objects = render(&helm, &[]);
    for (kind, name, component) in [
        (
            "DaemonSet",
            "rel-gpu-dra-driver-kubelet-plugin",
            "kubelet-plugin",
        ),
        ("Deployment", "rel-gpu-dra-driver-webhook", "webhook"),
    ] {
        let o = find(&objects, kind, name);
        assert_eq!(
            o["spec"]["template"]["metadata"]["labels"]["dra-driver-nvidia-gpu-component"],
            component,
            "{kind}"
        );
        assert_eq!(
            o["spec"]["selector"],
            serde_json::json!({"matchLabels": {"app.kubernetes.io/instance": "rel", "app.kubernetes.io/component": component}}),
            "{kind}: the selector of earlier releases"
        );
    }
}

/// The MPS control daemon pod the node plugin builds on `node` (its own code,
/// `sharing::pods::daemon_pod`), with the settings the rendered DaemonSet gives it (image,
/// priority class, service account, pull settings, driver root, plugin folder), as the JSON it
/// sends to the API server.
fn plugin_daemon_pod(objects: &[Value], node: &str) -> Value {
    use gpu_dra_kubelet_plugin::sharing::pods::{DaemonPodArgs, PodSettings, daemon_pod};
    use gpu_dra_kubelet_plugin::sharing::state::MpsRecord;
    use gpu_dra_kubelet_plugin::sharing::tools::{DriverRoot, MPS_CONTROL};
    use std::os::unix::fs::PermissionsExt;

    let ds = find(objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let env = |name: &str| plugin_env(ds, name).unwrap_or_default().to_owned();
    let settings = DaemonPodArgs {
        mps_daemon_service_account: env("MPS_DAEMON_SERVICE_ACCOUNT"),
        mps_daemon_image_pull_policy: env("MPS_DAEMON_IMAGE_PULL_POLICY"),
        mps_daemon_image_pull_secrets: env("MPS_DAEMON_IMAGE_PULL_SECRETS")
            .split(',')
            .map(str::to_owned)
            .collect(),
    }
    .apply(PodSettings {
        namespace: NAMESPACE.into(),
        node: node.into(),
        image: env("MPS_DAEMON_IMAGE"),
        host_driver_root: env("NVIDIA_DRIVER_ROOT").into(),
        priority_class: env("MPS_DAEMON_PRIORITY_CLASS"),
        ..PodSettings::default()
    });
    // The driver root as the plugin's container sees it: only the MPS tool is looked up.
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chart-driver-root");
    let tool = root.join("usr/bin").join(MPS_CONTROL);
    std::fs::create_dir_all(tool.parent().expect("folder")).expect("driver root");
    std::fs::write(&tool, "#!/bin/sh\n").expect("tool");
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).expect("mode");
    let record: MpsRecord = serde_json::from_value(serde_json::json!({
        "claimUid": "0b6e2c46-6e0e-4c1c-9a55-3f6f5e9d1a7b",
        "group": "c_0",
        "phase": "starting",
        "pid": null,
        // The daemon's folder, as `SharingOptions::daemon_dir` names it.
        "dir": format!("{}/mps/5d1c0d63b2a4e2f1", env("PLUGIN_DIR")),
        "devices": ["GPU-a"],
        "wholeGpus": ["GPU-a"],
        "limits": {"activeThreadPercentage": 40, "pinnedMemoryMib": {"GPU-a": 2048}},
    }))
    .expect("an MPS record");
    let pod = daemon_pod(&settings, &DriverRoot::new(root, None), "id", &record)
        .expect("the plugin builds its daemon pod");
    serde_json::to_value(pod).expect("a pod is JSON")
}

/// A plugin's credentials create only MPS daemon pods as the plugin makes them: the real pod
/// passes; each way to reach beyond the node (another account, a token, a Secret or other
/// volume, another host path, another image, an environment read from Secrets) is refused,
/// each with the message that says so. Pinned to the chart's values: another driver root or
/// image in the values moves what is admitted.
#[test]
fn node_restriction_policy_admits_only_daemon_pods_as_the_plugin_makes_them() {
    let Some(helm) = helm() else { return };
    let objects = render(&helm, &[]);
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-gpu-dra-driver-node-restriction",
    );
    let plugin = format!("system:serviceaccount:{NAMESPACE}:rel-gpu-dra-driver-kubelet-plugin");
    let on_a = serde_json::json!({"authentication.kubernetes.io/node-name": ["node-a"]});
    let decide = |vap: &Value, pod: Value| {
        node_policy(vap, &plugin, on_a.clone(), "CREATE", pod, Value::Null).expect("applies")
    };
    let daemon = plugin_daemon_pod(&objects, "node-a");
    assert_eq!(
        decide(vap, daemon.clone()),
        Vec::<String>::new(),
        "{daemon}"
    );
    let spec = &daemon["spec"];
    assert_eq!(spec["serviceAccountName"], "rel-gpu-dra-driver-mps-daemon");
    assert_eq!(spec["automountServiceAccountToken"], false);

    let plugin_dir = "/var/lib/kubelet/plugins/gpu.nvidia.com";
    let host_path = |path: &str| serde_json::json!({"name": "x", "hostPath": {"path": path}});
    let add_volume = |v: Value| {
        move |pod: &mut Value| {
            pod["spec"]["volumes"]
                .as_array_mut()
                .expect("volumes")
                .push(v.clone())
        }
    };
    type Edit = Box<dyn Fn(&mut Value)>;
    let refused: Vec<(&str, Edit, &str)> = vec![
        (
            "the plugin's own account",
            Box::new(|p| {
                p["spec"]["serviceAccountName"] = "rel-gpu-dra-driver-kubelet-plugin".into()
            }),
            "only create pods with service account rel-gpu-dra-driver-mps-daemon",
        ),
        (
            "the namespace's default account",
            Box::new(|p| p["spec"]["serviceAccountName"] = "default".into()),
            "with service account rel-gpu-dra-driver-mps-daemon",
        ),
        (
            "a mounted token",
            Box::new(|p| p["spec"]["automountServiceAccountToken"] = true.into()),
            "automountServiceAccountToken: false",
        ),
        (
            "no word on the token (the account's default mounts it)",
            Box::new(|p| {
                p["spec"]
                    .as_object_mut()
                    .expect("spec")
                    .remove("automountServiceAccountToken");
            }),
            "automountServiceAccountToken: false",
        ),
        (
            "a Secret volume (the webhook's TLS key)",
            Box::new(add_volume(serde_json::json!({"name": "tls",
                "secret": {"secretName": "rel-gpu-dra-driver-webhook-tls"}}))),
            "only create pods whose volumes are hostPath volumes",
        ),
        (
            "a projected service account token",
            Box::new(add_volume(
                serde_json::json!({"name": "token", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token"}}]}}),
            )),
            "hostPath volumes",
        ),
        (
            "a ConfigMap volume",
            Box::new(add_volume(serde_json::json!({"name": "cm",
                "configMap": {"name": "kube-root-ca.crt"}}))),
            "hostPath volumes",
        ),
        (
            "another host path",
            Box::new(add_volume(host_path("/etc/kubernetes"))),
            "hostPath volumes of the driver root / or of a folder in /var/lib/kubelet/plugins/gpu.nvidia.com/mps/",
        ),
        (
            "the whole plugin folder (its checkpoint, its CDI hook binary)",
            Box::new(add_volume(host_path(plugin_dir))),
            "hostPath volumes",
        ),
        (
            "a folder below a daemon folder",
            Box::new(add_volume(host_path(&format!("{plugin_dir}/mps/a/b")))),
            "hostPath volumes",
        ),
        (
            "another image",
            Box::new(|p| p["spec"]["containers"][0]["image"] = "busybox:latest".into()),
            "only create pods whose containers run ghcr.io/gpu-dra/gpu-dra-driver:0.1.0",
        ),
        (
            "a second container of another image",
            Box::new(|p| {
                let mut c = p["spec"]["containers"][0].clone();
                c["name"] = "x".into();
                c["image"] = "registry.example/tool:1".into();
                p["spec"]["containers"]
                    .as_array_mut()
                    .expect("containers")
                    .push(c);
            }),
            "containers run ghcr.io/gpu-dra/gpu-dra-driver:0.1.0",
        ),
        (
            "an init container, even of the chart's image",
            Box::new(|p| {
                p["spec"]["initContainers"] = serde_json::json!([
                {"name": "init", "image": "ghcr.io/gpu-dra/gpu-dra-driver:0.1.0"}])
            }),
            "no init or ephemeral containers",
        ),
        (
            "the environment of a Secret",
            Box::new(|p| {
                p["spec"]["containers"][0]["envFrom"] = serde_json::json!([
                {"secretRef": {"name": "rel-gpu-dra-driver-webhook-tls"}}])
            }),
            "environment is plain values",
        ),
        (
            "one variable from a Secret",
            Box::new(|p| {
                p["spec"]["containers"][0]["env"]
                    .as_array_mut()
                    .expect("env")
                    .push(
                        serde_json::json!({"name": "KEY", "valueFrom": {"secretKeyRef":
                        {"name": "rel-gpu-dra-driver-webhook-tls", "key": "tls.key"}}}),
                    )
            }),
            "environment is plain values",
        ),
        (
            "a pull secret the chart does not name (the node could then read it)",
            Box::new(|p| {
                p["spec"]["imagePullSecrets"] =
                    serde_json::json!([{"name": "rel-gpu-dra-driver-webhook-tls"}])
            }),
            "image pull secrets are the chart's imagePullSecrets []",
        ),
        (
            "the host's network",
            Box::new(|p| p["spec"]["hostNetwork"] = true.into()),
            "without hostNetwork, hostPID or hostIPC",
        ),
        (
            "the host's PIDs",
            Box::new(|p| p["spec"]["hostPID"] = true.into()),
            "without hostNetwork, hostPID or hostIPC",
        ),
        (
            "the host's IPC",
            Box::new(|p| p["spec"]["hostIPC"] = true.into()),
            "without hostNetwork, hostPID or hostIPC",
        ),
        (
            "another priority class",
            Box::new(|p| p["spec"]["priorityClassName"] = "system-cluster-critical".into()),
            "of priority class \"system-node-critical\"",
        ),
        (
            "a shell of the driver root",
            Box::new(|p| {
                p["spec"]["containers"][0]["command"] =
                    serde_json::json!(["/driver-root/bin/sh", "-c", "id"])
            }),
            "runs nvidia-cuda-mps-control -f [-M]",
        ),
        (
            "arguments",
            Box::new(|p| p["spec"]["containers"][0]["args"] = serde_json::json!(["-d"])),
            "nvidia-cuda-mps-control -f [-M]",
        ),
        (
            "another daemon argument",
            Box::new(|p| {
                p["spec"]["containers"][0]["command"]
                    .as_array_mut()
                    .expect("command")
                    .push("-x".into())
            }),
            "nvidia-cuda-mps-control -f [-M]",
        ),
        (
            "a port",
            Box::new(|p| {
                p["spec"]["containers"][0]["ports"] = serde_json::json!([{"containerPort": 22}])
            }),
            "no ports",
        ),
        (
            "a second container of the chart's image",
            Box::new(|p| {
                let c = p["spec"]["containers"][0].clone();
                p["spec"]["containers"]
                    .as_array_mut()
                    .expect("containers")
                    .push(c);
            }),
            "pods of one container",
        ),
        (
            "the driver root (the host's /) read-write",
            Box::new(|p| {
                for m in p["spec"]["containers"][0]["volumeMounts"]
                    .as_array_mut()
                    .expect("mounts")
                {
                    if m["name"] == "driver-root" {
                        m["readOnly"] = false.into();
                    }
                }
            }),
            "mount the driver root read-only",
        ),
        (
            "the driver root as the MPS folder",
            Box::new(|p| {
                for v in p["spec"]["volumes"].as_array_mut().expect("volumes") {
                    if v["name"] == "mps" {
                        v["hostPath"]["path"] = "/".into();
                    }
                }
            }),
            "their MPS folder at its own path",
        ),
        (
            "a subPath",
            Box::new(|p| {
                for m in p["spec"]["containers"][0]["volumeMounts"]
                    .as_array_mut()
                    .expect("mounts")
                {
                    m["subPath"] = "etc".into();
                }
            }),
            "no subPath",
        ),
        (
            "LD_PRELOAD of another library",
            Box::new(|p| {
                p["spec"]["containers"][0]["env"]
                    .as_array_mut()
                    .expect("env")
                    .push(serde_json::json!({"name": "LD_PRELOAD", "value": "/var/lib/kubelet/plugins/gpu.nvidia.com/mps/x/evil.so"}))
            }),
            "LD_PRELOAD of the driver's libcuda and libnvidia-ml",
        ),
        (
            "another variable name",
            Box::new(|p| {
                p["spec"]["containers"][0]["env"]
                    .as_array_mut()
                    .expect("env")
                    .push(serde_json::json!({"name": "LD_LIBRARY_PATH", "value": "/tmp"}))
            }),
            "of the MPS daemon's names",
        ),
        (
            "a value of 5000 bytes (etcd filled by one node)",
            Box::new(|p| {
                p["spec"]["containers"][0]["env"]
                    .as_array_mut()
                    .expect("env")
                    .push(serde_json::json!({"name": "PATH", "value": "x".repeat(5000)}))
            }),
            "each value at most 4096 bytes",
        ),
        (
            "17 variables",
            Box::new(|p| {
                let env = p["spec"]["containers"][0]["env"]
                    .as_array_mut()
                    .expect("env");
                while env.len() < 17 {
                    env.push(serde_json::json!({"name": "PATH", "value": "/bin"}));
                }
            }),
            "at most 16 variables",
        ),
    ];
    for (what, edit, want) in refused {
        let mut pod = daemon.clone();
        edit(&mut pod);
        let failed = decide(vap, pod);
        // A change may break more than one rule (a Secret volume is also a mount the daemon
        // does not have); the one named must be among them.
        assert!(
            failed.iter().any(|f| f.contains(want)),
            "{what}: want a refusal with {want:?}, got {failed:?}"
        );
    }
    // The driver's libraries preloaded by soname link or by versioned file are the daemon's.
    for preload in [
        "/driver-root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1:/driver-root/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/driver-root/usr/lib64/libnvidia-ml.so.580.95.05:/driver-root/usr/lib64/libcuda.so.580.95.05",
    ] {
        let mut pod = daemon.clone();
        pod["spec"]["containers"][0]["env"]
            .as_array_mut()
            .expect("env")
            .push(serde_json::json!({"name": "LD_PRELOAD", "value": preload}));
        assert_eq!(decide(vap, pod), Vec::<String>::new(), "{preload}");
    }
    // A second daemon folder is fine: a group's daemon mounts its own folder only, but the
    // rule is "a folder in <plugin dir>/mps/".
    let mut pod = daemon.clone();
    add_volume(host_path(&format!("{plugin_dir}/mps/0123456789abcdef")))(&mut pod);
    assert_eq!(decide(vap, pod), Vec::<String>::new());

    // The rules follow the values: a containerized driver, another kubelet root, another
    // image; the plugin's pod under those values passes, the default one does not.
    let objects = render(
        &helm,
        &[
            "nvidiaDriverRoot=/run/nvidia/driver",
            "kubeletPlugin.kubeletRoot=/var/data/kubelet",
            "image.tag=2.0",
        ],
    );
    let moved = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-gpu-dra-driver-node-restriction",
    );
    assert_eq!(
        decide(moved, plugin_daemon_pod(&objects, "node-a")),
        Vec::<String>::new()
    );
    let failed = decide(moved, daemon.clone());
    assert!(
        failed
            .iter()
            .any(|m| m.contains("driver root /run/nvidia/driver"))
            && failed.iter().any(|m| m.contains("gpu-dra-driver:2.0")),
        "{failed:?}"
    );

    // Deleting stays as it was: daemon pods of its own node only.
    let delete = |pod: Value| {
        node_policy(vap, &plugin, on_a.clone(), "DELETE", Value::Null, pod).expect("applies")
    };
    assert_eq!(delete(daemon.clone()), Vec::<String>::new());
    assert_eq!(
        delete(plugin_daemon_pod(&render(&helm, &[]), "node-b")).len(),
        1
    );
}

/// A plugin writes only its driver's slices, in the pool named after its node: another pool
/// name (with a high generation it would hide that node's devices for good) or another driver
/// is refused, on create and update; a delete may remove any pool's slice of its node, so that
/// it can clean up after a bad write, but never another driver's.
#[test]
fn node_restriction_policy_keeps_slices_to_the_driver_and_the_nodes_pool() {
    let Some(helm) = helm() else { return };
    let objects = render(&helm, &[]);
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-gpu-dra-driver-node-restriction",
    );
    let plugin = format!("system:serviceaccount:{NAMESPACE}:rel-gpu-dra-driver-kubelet-plugin");
    let on_a = serde_json::json!({"authentication.kubernetes.io/node-name": ["node-a"]});
    let slice = |driver: &str, pool: &str| {
        serde_json::json!({"spec": {"driver": driver, "nodeName": "node-a",
            "pool": {"name": pool, "generation": 1_000_000, "resourceSliceCount": 1}}})
    };
    let ours = "gpu.nvidia.com";
    let decide = |op: &str, object: Value, old: Value| {
        node_policy(vap, &plugin, on_a.clone(), op, object, old).expect("applies")
    };
    let null = Value::Null;
    let ok: Vec<String> = vec![];

    assert_eq!(decide("CREATE", slice(ours, "node-a"), null.clone()), ok);
    assert_eq!(
        decide("UPDATE", slice(ours, "node-a"), slice(ours, "node-a")),
        ok
    );
    assert_eq!(decide("DELETE", null.clone(), slice(ours, "node-a")), ok);
    assert_eq!(decide("DELETE", null.clone(), slice(ours, "node-b")), ok);

    let pool = "may only write ResourceSlices of pool node-a (its node), not \"node-b\"";
    let driver =
        "may only write ResourceSlices of driver gpu.nvidia.com, not \"other.example.com\"";
    for (op, object, old, want) in [
        ("CREATE", slice(ours, "node-b"), null.clone(), pool),
        ("UPDATE", slice(ours, "node-b"), slice(ours, "node-a"), pool),
        (
            "CREATE",
            slice("other.example.com", "node-a"),
            null.clone(),
            driver,
        ),
        (
            "UPDATE",
            slice("other.example.com", "node-a"),
            slice(ours, "node-a"),
            driver,
        ),
        (
            "UPDATE",
            slice(ours, "node-a"),
            slice("other.example.com", "node-a"),
            driver,
        ),
        (
            "DELETE",
            null.clone(),
            slice("other.example.com", "node-a"),
            driver,
        ),
    ] {
        let failed = decide(op, object, old);
        assert!(
            failed.len() == 1 && failed[0].contains(want),
            "{op}: want one refusal with {want:?}, got {failed:?}"
        );
    }
}

/// Daemon pods run as an account of their own, with no role bound and no token, and pull
/// their image as the plugin pod does; the DaemonSet tells the plugin all of it, and the
/// policy admits exactly that account.
#[test]
fn daemon_pods_run_as_their_own_account_and_pull_as_the_plugin() {
    let Some(helm) = helm() else { return };
    let objects = render(
        &helm,
        &[
            "imagePullSecrets[0].name=registry-a",
            "imagePullSecrets[1].name=registry-b",
            "image.pullPolicy=Always",
        ],
    );
    let sa = find(&objects, "ServiceAccount", "rel-gpu-dra-driver-mps-daemon");
    assert_eq!(sa["metadata"]["namespace"], NAMESPACE);
    assert_eq!(sa["automountServiceAccountToken"], false);
    assert!(
        objects
            .iter()
            .filter(|o| o["kind"] == "RoleBinding" || o["kind"] == "ClusterRoleBinding")
            .all(|b| b["subjects"]
                .as_array()
                .into_iter()
                .flatten()
                .all(|s| s["name"] != "rel-gpu-dra-driver-mps-daemon")),
        "no rights for the daemon account"
    );
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    assert_eq!(
        plugin_env(ds, "MPS_DAEMON_SERVICE_ACCOUNT"),
        Some("rel-gpu-dra-driver-mps-daemon")
    );
    assert_eq!(
        plugin_env(ds, "MPS_DAEMON_IMAGE_PULL_POLICY"),
        Some("Always")
    );
    assert_eq!(
        plugin_env(ds, "MPS_DAEMON_IMAGE_PULL_SECRETS"),
        Some("registry-a,registry-b")
    );
    // The plugin's pod and the daemon pods it makes pull alike.
    let plugin_pod = &ds["spec"]["template"]["spec"];
    let daemon = plugin_daemon_pod(&objects, "node-a");
    assert_eq!(
        daemon["spec"]["imagePullSecrets"],
        plugin_pod["imagePullSecrets"]
    );
    assert_eq!(
        daemon["spec"]["containers"][0]["imagePullPolicy"],
        plugin_pod["containers"][0]["imagePullPolicy"]
    );
    assert_eq!(
        daemon["spec"]["containers"][0]["image"],
        plugin_pod["containers"][0]["image"]
    );

    // Without daemon pods, no account and nothing for the plugin to set.
    let objects = render(&helm, &["kubeletPlugin.mpsDaemonPods=false"]);
    assert!(!kinds(&objects).contains(&"ServiceAccount/rel-gpu-dra-driver-mps-daemon".to_string()));
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    assert_eq!(plugin_env(ds, "MPS_DAEMON_SERVICE_ACCOUNT"), None);
    // No secrets configured: the variable is left out.
    let ds = find(
        &render(&helm, &[]),
        "DaemonSet",
        "rel-gpu-dra-driver-kubelet-plugin",
    )
    .clone();
    assert_eq!(plugin_env(&ds, "MPS_DAEMON_IMAGE_PULL_SECRETS"), None);
    assert_eq!(
        plugin_env(&ds, "MPS_DAEMON_IMAGE_PULL_POLICY"),
        Some("IfNotPresent")
    );
}

/// GKE admits `system-node-critical` pods outside kube-system only with a ResourceQuota that
/// covers the class: the chart ships one for the class its pods use, in its namespace.
#[test]
fn a_quota_admits_the_critical_pods_where_the_class_is_limited() {
    let Some(helm) = helm() else { return };
    let quota_of = |objects: &[Value]| {
        objects
            .iter()
            .find(|o| o["kind"] == "ResourceQuota")
            .cloned()
    };
    let objects = render(&helm, &[]);
    let quota = quota_of(&objects).expect("a ResourceQuota by default");
    assert_eq!(quota["metadata"]["namespace"], NAMESPACE);
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let class = &ds["spec"]["template"]["spec"]["priorityClassName"];
    assert_eq!(class, "system-node-critical");
    assert_eq!(
        quota["spec"]["scopeSelector"],
        serde_json::json!({"matchExpressions": [
            {"scopeName": "PriorityClass", "operator": "In", "values": ["system-node-critical"]}]})
    );
    assert_eq!(plugin_env(ds, "MPS_DAEMON_PRIORITY_CLASS"), class.as_str());
    assert_eq!(
        quota["spec"]["hard"],
        serde_json::json!({"pods": "1000000"})
    );

    let objects = render(
        &helm,
        &[
            "kubeletPlugin.priorityClassName=system-cluster-critical",
            "priorityClassQuota.pods=500",
        ],
    );
    let quota = quota_of(&objects).expect("quota");
    assert_eq!(
        quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"],
        serde_json::json!(["system-cluster-critical"])
    );
    assert_eq!(quota["spec"]["hard"]["pods"], "500");
    for off in [
        "priorityClassQuota.enabled=false",
        "kubeletPlugin.priorityClassName=",
        "kubeletPlugin.enabled=false",
    ] {
        assert!(quota_of(&render(&helm, &[off])).is_none(), "{off}");
    }
}

/// OpenShift: the switch lets the plugin's account (its pods and the uninstall cleanup pods)
/// and the daemon pods' account use the privileged SCC, in the release namespace only; off by
/// default.
#[test]
fn openshift_lets_the_plugin_and_daemons_use_the_privileged_scc() {
    let Some(helm) = helm() else { return };
    let scc_roles = |objects: &[Value]| {
        objects
            .iter()
            .filter(|o| {
                o["kind"] == "Role"
                    && o["rules"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|r| strs(&r["apiGroups"]).contains(&"security.openshift.io"))
            })
            .count()
    };
    assert_eq!(scc_roles(&render(&helm, &[])), 0, "off by default");

    let objects = render(&helm, &["openshift.enabled=true"]);
    let role = find(&objects, "Role", "rel-gpu-dra-driver-privileged-scc");
    assert_eq!(role["metadata"]["namespace"], NAMESPACE);
    assert_eq!(
        role["rules"],
        serde_json::json!([{"apiGroups": ["security.openshift.io"],
            "resources": ["securitycontextconstraints"], "resourceNames": ["privileged"],
            "verbs": ["use"]}])
    );
    let binding = find(&objects, "RoleBinding", "rel-gpu-dra-driver-privileged-scc");
    assert_eq!(binding["metadata"]["namespace"], NAMESPACE);
    assert_eq!(binding["roleRef"]["kind"], "Role");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let subjects = |b: &Value| -> Vec<(String, String)> {
        b["subjects"]
            .as_array()
            .expect("subjects")
            .iter()
            .map(|s| {
                assert_eq!(s["kind"], "ServiceAccount");
                (
                    s["namespace"].as_str().expect("namespace").to_owned(),
                    s["name"].as_str().expect("name").to_owned(),
                )
            })
            .collect()
    };
    assert_eq!(
        subjects(binding),
        [
            (
                NAMESPACE.to_owned(),
                ds["spec"]["template"]["spec"]["serviceAccountName"]
                    .as_str()
                    .expect("plugin account")
                    .to_owned()
            ),
            (
                NAMESPACE.to_owned(),
                plugin_env(ds, "MPS_DAEMON_SERVICE_ACCOUNT")
                    .expect("daemon account")
                    .to_owned()
            ),
        ]
    );
    let objects = render(
        &helm,
        &[
            "openshift.enabled=true",
            "kubeletPlugin.mpsDaemonPods=false",
        ],
    );
    let binding = find(&objects, "RoleBinding", "rel-gpu-dra-driver-privileged-scc");
    assert_eq!(subjects(binding).len(), 1, "only the plugin's account");
}

#[test]
fn node_restriction_policy_keeps_claim_status_to_the_drivers_entries_of_the_nodes_pool() {
    let Some(helm) = helm() else { return };
    let objects = render(&helm, &[]);
    let vap = find(
        &objects,
        "ValidatingAdmissionPolicy",
        "rel-gpu-dra-driver-node-restriction",
    );
    let plugin = format!("system:serviceaccount:{NAMESPACE}:rel-gpu-dra-driver-kubelet-plugin");
    let on_a = serde_json::json!({"authentication.kubernetes.io/node-name": ["node-a"]});
    let entry = |driver: &str, pool: &str, device: &str| {
        serde_json::json!({"driver": driver, "pool": pool, "device": device,
            "data": {"uuid": "GPU-1"}, "conditions": [{"type": "Ready", "status": "True"}]})
    };
    let allocation = serde_json::json!({"devices": {"results": [
        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-1"},
        {"request": "nic", "driver": "net.example.com", "pool": "node-a", "device": "nic-0"}]}});
    let claim = |devices: Vec<Value>| {
        serde_json::json!({"spec": {"devices": {"requests": []}},
            "status": {"allocation": allocation, "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}],
                       "devices": devices}})
    };
    let theirs = entry("net.example.com", "node-a", "nic-0");
    let before = claim(vec![theirs.clone()]);
    let decide = |after: Value| {
        node_policy(vap, &plugin, on_a.clone(), "UPDATE", after, before.clone())
            .expect("the policy applies to the plugin")
    };

    // Ours, of its node's pool: added, changed and removed.
    let ours = entry("gpu.nvidia.com", "node-a", "gpu-1");
    assert_eq!(
        decide(claim(vec![theirs.clone(), ours.clone()])),
        Vec::<String>::new()
    );
    let mut changed = ours.clone();
    changed["data"]["uuid"] = "GPU-2".into();
    let with_ours = claim(vec![theirs.clone(), ours.clone()]);
    assert_eq!(
        node_policy(
            vap,
            &plugin,
            on_a.clone(),
            "UPDATE",
            claim(vec![theirs.clone(), changed]),
            with_ours.clone()
        ),
        Some(vec![])
    );
    assert_eq!(
        node_policy(
            vap,
            &plugin,
            on_a.clone(),
            "UPDATE",
            before.clone(),
            with_ours
        ),
        Some(vec![])
    );

    // Another driver's entry: neither changed nor removed.
    let mut other = theirs.clone();
    other["data"]["uuid"] = "forged".into();
    let refused = decide(claim(vec![other]));
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].contains("only write status.devices entries of driver gpu.nvidia.com, not net.example.com/node-a/nic-0"),
        "{refused:?}"
    );
    assert_eq!(
        decide(claim(vec![])).len(),
        1,
        "removing another driver's entry"
    );

    // An entry of another node's pool.
    let refused = decide(claim(vec![
        theirs.clone(),
        entry("gpu.nvidia.com", "node-b", "gpu-1"),
    ]));
    assert_eq!(
        refused,
        [
            "the kubelet plugin on node node-a may only write status.devices entries of pool node-a (the devices of its node), not gpu.nvidia.com/node-b/gpu-1"
        ]
    );

    // The rest of the status stays as it was.
    let mut unreserved = before.clone();
    unreserved["status"]["reservedFor"] = serde_json::json!([]);
    let mut deallocated = before.clone();
    deallocated["status"]
        .as_object_mut()
        .expect("status")
        .remove("allocation");
    for after in [unreserved, deallocated] {
        let refused = decide(after);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(
            refused[0].contains("not status.allocation or status.reservedFor"),
            "{refused:?}"
        );
    }
}

/// `consumableShares` takes NVIDIA's values (a YAML integer too, as NVIDIA's chart users write
/// it) and reaches the plugin as its `CONSUMABLE_SHARES`, which the plugin's own flag parser
/// accepts; anything else is refused by the schema.
#[test]
fn consumable_shares_take_nvidias_values() {
    let Some(helm) = helm() else { return };
    for (args, want) in [
        (&[][..], "disabled"),
        (&["--set", "consumableShares="][..], "disabled"),
        (&["--set", "consumableShares=memory"][..], "memory"),
        (&["--set", "consumableShares=unlimited"][..], "unlimited"),
        (&["--set", "consumableShares=4"][..], "4"),
        (&["--set-string", "consumableShares=16"][..], "16"),
    ] {
        let objects = render_args(&helm, args);
        let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
        let env = plugin_env(ds, "CONSUMABLE_SHARES");
        assert_eq!(env, Some(want), "{args:?}");
        let line = [
            "gpu-kubelet-plugin",
            "run",
            "--node-name=n",
            &format!("--consumable-shares={want}"),
        ];
        if let Err(e) = gpu_dra_kubelet_plugin::cmd::command().try_get_matches_from(line) {
            panic!("{args:?}: the plugin refuses {want:?}: {e}");
        }
    }
    for bad in [
        "consumableShares=0",
        "consumableShares=all",
        "consumableShares=-2",
    ] {
        let out = Command::new(&helm)
            .args(["template", "rel"])
            .arg(chart())
            .args(["--kube-version", KUBE_VERSION, "--set", bad])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad} accepted");
        assert!(err.contains("consumableShares"), "{bad}: {err}");
    }
}

/// A boolean plugin value, off by default, reaches the plugin as env `env` ("false" without
/// `on`, "true" with it), which the plugin's flag parser accepts as `--flag`.
fn plugin_switch_off_unless_asked_for(helm: &Path, on: &[&str], env: &str, flag: &str) {
    for (sets, want) in [(&[][..], "false"), (on, "true")] {
        let objects = render(helm, sets);
        let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
        assert_eq!(plugin_env(ds, env), Some(want), "{sets:?}");
        let line = [
            "gpu-kubelet-plugin",
            "run",
            "--node-name=n",
            &format!("--{flag}={want}"),
        ];
        if let Err(e) = gpu_dra_kubelet_plugin::cmd::command().try_get_matches_from(line) {
            panic!("{sets:?}: the plugin refuses {want:?}: {e}");
        }
    }
}

/// `kubeletPlugin.listTypeAttributes` is off by default and reaches the plugin as its
/// `LIST_TYPE_ATTRIBUTES`, which the plugin's flag parser accepts.
#[test]
fn list_type_attributes_are_off_unless_asked_for() {
    let Some(helm) = helm() else { return };
    plugin_switch_off_unless_asked_for(
        &helm,
        &[
            "kubeletPlugin.listTypeAttributes=true",
            "clusterFeatureGates={DRAListTypeAttributes}",
        ],
        "LIST_TYPE_ATTRIBUTES",
        "list-type-attributes",
    );
}

/// `kubeletPlugin.deviceMetadata` is off by default (as in Kubernetes' Go helper library) and
/// reaches the plugin as its `DEVICE_METADATA`, which the plugin's flag parser accepts.
#[test]
fn device_metadata_is_off_unless_asked_for() {
    let Some(helm) = helm() else { return };
    plugin_switch_off_unless_asked_for(
        &helm,
        &["kubeletPlugin.deviceMetadata=true"],
        "DEVICE_METADATA",
        "device-metadata",
    );
}

#[test]
fn the_plugins_network_policy_can_restrict_who_reads_its_metrics() {
    let Some(helm) = helm() else { return };
    let policy = |sets: &[&str]| -> Value {
        let objects = render(&helm, sets);
        find(
            &objects,
            "NetworkPolicy",
            "rel-gpu-dra-driver-kubelet-plugin",
        )
        .clone()
    };
    let np = policy(&[
        "kubeletPlugin.networkPolicy.enabled=true",
        "kubeletPlugin.networkPolicy.restrictMetrics=true",
    ]);
    assert_eq!(strs(&np["spec"]["policyTypes"]), ["Egress", "Ingress"]);
    assert_eq!(
        np["spec"]["ingress"],
        serde_json::json!([]),
        "no peer but the node (always admitted)"
    );
    let np = policy(&[
        "kubeletPlugin.networkPolicy.enabled=true",
        "kubeletPlugin.networkPolicy.restrictMetrics=true",
        "kubeletPlugin.networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
    ]);
    assert_eq!(
        np["spec"]["ingress"],
        serde_json::json!([{
            "ports": [{"protocol": "TCP", "port": "http"}],
            "from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]
        }])
    );
}

#[test]
fn the_plugin_sees_the_hosts_processes_only_while_per_claim_usage_is_on() {
    let Some(helm) = helm() else { return };
    let host_pid = |sets: &[&str]| -> Value {
        let objects = render(&helm, sets);
        find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin")["spec"]["template"]["spec"]
            ["hostPID"]
            .clone()
    };
    assert_eq!(host_pid(&[]), Value::Bool(true), "usage is on by default");
    assert_eq!(
        host_pid(&["kubeletPlugin.usage.intervalSeconds=0"]),
        Value::Null,
        "usage off: no hostPID"
    );
}

/// `helm template` at a Kubernetes release, with `--set` values: the rendered text, or helm's
/// error.
fn template_at(helm: &Path, kube: &str, sets: &[&str]) -> Result<String, String> {
    let out = Command::new(helm)
        .args(["template", "rel"])
        .arg(chart())
        .args(["--namespace", NAMESPACE, "--kube-version", kube])
        .args(sets.iter().flat_map(|s| ["--set", s]))
        .output()
        .expect("helm runs");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Values that need a DRA feature the cluster's release has off by default fail the install
/// with a message naming the value, the gate, the release that has it on and the way out
/// (`clusterFeatureGates`); the same values install from 1.36, and on an older release whose
/// admin turned the gate on and says so. Releases before 1.34 are refused by `kubeVersion`.
#[test]
fn values_needing_a_feature_the_release_lacks_are_refused() {
    let Some(helm) = helm() else { return };
    let memory = "kubeletPlugin.partitioning.memoryShareGpus=all";
    let mig = "kubeletPlugin.partitioning.dynamicMigGpus=all";
    for kube in ["1.34.0", "1.35.2"] {
        let err = template_at(&helm, kube, &[memory]).expect_err(kube);
        let minor = &kube[..4];
        assert!(
            err.contains(&format!(
                "kubeletPlugin.partitioning.memoryShareGpus=\"all\" (memory shares) needs the \
                 Kubernetes feature gate DRAConsumableCapacity, which is off by default in \
                 Kubernetes {minor} (on by default from 1.36)"
            )),
            "{kube}: {err}"
        );
        assert!(
            err.contains("add DRAConsumableCapacity to clusterFeatureGates"),
            "{err}"
        );
        let err = template_at(&helm, kube, &["consumableShares=4"]).expect_err(kube);
        assert!(
            err.contains("consumableShares=4 (consumable shares)"),
            "{err}"
        );
        let err = template_at(&helm, kube, &[mig]).expect_err(kube);
        assert!(err.contains("gate DRAPartitionableDevices"), "{err}");
        // The admin turned the gates on.
        template_at(
            &helm,
            kube,
            &[
                memory,
                mig,
                "clusterFeatureGates={DRAConsumableCapacity,DRAPartitionableDevices}",
            ],
        )
        .unwrap_or_else(|e| panic!("{kube} with the gates declared: {e}"));
        // Default values (device health on: the plugin falls back, not refused).
        template_at(&helm, kube, &[]).unwrap_or_else(|e| panic!("{kube} defaults: {e}"));
    }
    for kube in ["1.36.0", "1.37.1", "1.36.3-gke.100"] {
        template_at(&helm, kube, &[memory, mig, "consumableShares=memory"])
            .unwrap_or_else(|e| panic!("{kube}: {e}"));
    }
    // List-type attributes: alpha from 1.36, so never on by default; absent before 1.36.
    let lists = "kubeletPlugin.listTypeAttributes=true";
    let err = template_at(&helm, "1.37.0", &[lists]).unwrap_err();
    assert!(
        err.contains("alpha, off by default in every release"),
        "{err}"
    );
    let err = template_at(
        &helm,
        "1.35.0",
        &[lists, "clusterFeatureGates={DRAListTypeAttributes}"],
    )
    .unwrap_err();
    assert!(
        err.contains(
            "DRAListTypeAttributes, which Kubernetes 1.35 does not have (it exists from 1.36)"
        ),
        "{err}"
    );
    let err = template_at(&helm, "1.33.0", &[]).unwrap_err();
    assert!(
        err.contains("chart requires kubeVersion: >=1.34.0-0"),
        "{err}"
    );
    let err = template_at(&helm, "1.35.0", &["clusterFeatureGates={DRAConsumable}"]).unwrap_err();
    assert!(err.contains("/clusterFeatureGates/0"), "{err}");
}

/// The chart's table of feature gates (`gpu-dra.clusterGates`) is `gpu-dra check`'s.
#[test]
fn the_charts_feature_gate_table_is_the_clis() {
    let helpers =
        std::fs::read_to_string(repo().join("deploy/helm/gpu-dra-driver/templates/_helpers.tpl"))
            .expect("helpers");
    let start = helpers
        .find("{{- define \"gpu-dra.clusterGates\" -}}")
        .expect("the chart defines gpu-dra.clusterGates");
    let body = &helpers[start..];
    let body = &body[body.find('\n').unwrap() + 1..body.find("{{- end -}}").unwrap()];
    let chart: Vec<(String, u32, u32)> = body
        .lines()
        .map(|l| {
            let (name, rest) = l
                .split_once(": ")
                .expect("NAME: {alpha: N, onByDefault: M}");
            let nums: Vec<u32> = rest
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap())
                .collect();
            (name.to_owned(), nums[0], nums[1])
        })
        .collect();
    let cli: Vec<(String, u32, u32)> = gpu_dra_core::feature_gates::GATES
        .iter()
        .map(|g| {
            (
                g.name.to_owned(),
                g.alpha_from,
                g.default_on_from.unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(chart, cli);
}

/// Device health is not refused before 1.36 (the plugin falls back), but the notes say what
/// the cluster lacks; from 1.36, or with the gates declared, they say nothing of it.
#[test]
fn notes_say_when_device_health_lacks_its_features() {
    let Some(helm) = helm() else { return };
    let notes = render_notes(&helm, &["--kube-version", "1.35.0"]);
    assert!(
        notes.contains(
            "Device health (kubeletPlugin.deviceHealth): Kubernetes 1.35 has DRADeviceTaints and \
             ResourceHealthStatus off by default"
        ),
        "{notes}"
    );
    for args in [
        &["--kube-version", "1.36.0"][..],
        &[
            "--kube-version",
            "1.35.0",
            "--set",
            "clusterFeatureGates={DRADeviceTaints,ResourceHealthStatus}",
        ][..],
        &[
            "--kube-version",
            "1.35.0",
            "--set",
            "kubeletPlugin.deviceHealth.enabled=false",
        ][..],
    ] {
        let notes = render_notes(&helm, args);
        assert!(!notes.contains("Device health"), "{args:?}: {notes}");
    }
}

/// Whether the rules of the ClusterRoles and (in `namespace`) the Roles rendered allow `verb`
/// on `resource` of `group`, for the object `name` (`""`: a list or create).
fn rbac_allows(
    objects: &[Value],
    (group, resource, verb): (&str, &str, &str),
    namespace: Option<&str>,
    name: &str,
) -> bool {
    let has = |list: &Value, want: &str| {
        list.as_array()
            .is_some_and(|l| l.iter().any(|v| v == want || v == "*"))
    };
    objects
        .iter()
        .filter(|o| {
            o["kind"] == "ClusterRole"
                || (o["kind"] == "Role"
                    && namespace.is_some_and(|ns| o["metadata"]["namespace"] == ns))
        })
        .flat_map(|o| o["rules"].as_array().into_iter().flatten())
        .any(|r| {
            has(&r["apiGroups"], group)
                && has(&r["resources"], resource)
                && has(&r["verbs"], verb)
                && (r["resourceNames"].is_null() || has(&r["resourceNames"], name))
        })
}

/// The check's role: off by default; on, it grants every request `gpu-dra check` makes (the
/// table follows `crates/cli/src/check/facts.rs`) and nothing that writes; `workload` adds what
/// `--workload` creates (`check/workload.rs`), `webhookSecret` the webhook's Secret by name;
/// `subjects` are bound to both roles.
#[test]
fn the_check_role_grants_what_gpu_dra_check_reads_and_writes_only_when_asked() {
    let Some(helm) = helm() else { return };
    let check_objects = |objects: Vec<Value>| -> Vec<Value> {
        objects
            .into_iter()
            .filter(|o| o["metadata"]["labels"]["app.kubernetes.io/component"] == "check")
            .collect()
    };
    assert!(check_objects(render(&helm, &[])).is_empty());

    let other_ns = Some("team");
    let release_ns = Some(NAMESPACE);
    // (group, resource, verb), the namespace of the request (None: cluster-scoped), the name.
    let reads = [
        (("resource.k8s.io", "deviceclasses", "list"), None, ""),
        (("resource.k8s.io", "resourceslices", "list"), None, ""),
        (("", "nodes", "list"), None, ""),
        (("", "events", "list"), None, ""),
        (("", "pods", "get"), other_ns, "stuck"),
        (
            (
                "admissionregistration.k8s.io",
                "validatingwebhookconfigurations",
                "list",
            ),
            None,
            "",
        ),
        (("apps", "daemonsets", "list"), release_ns, ""),
        (("", "pods", "list"), release_ns, ""),
        (
            ("apps", "deployments", "get"),
            release_ns,
            "rel-gpu-dra-driver-webhook",
        ),
        (
            ("discovery.k8s.io", "endpointslices", "list"),
            release_ns,
            "",
        ),
        (
            ("", "services/proxy", "get"),
            release_ns,
            "https:rel-gpu-dra-driver-webhook:443",
        ),
    ];
    let workload = [
        (("", "namespaces", "create"), None, ""),
        (("", "namespaces", "delete"), None, "gpu-dra-check-x7k2q"),
        (("", "serviceaccounts", "get"), other_ns, "default"),
        (
            ("resource.k8s.io", "resourceclaims", "create"),
            other_ns,
            "",
        ),
        (
            ("resource.k8s.io", "resourceclaims", "get"),
            other_ns,
            "gpu",
        ),
        (("", "pods", "create"), other_ns, ""),
        (("", "pods/log", "get"), other_ns, "workload"),
    ];
    let secret = (
        ("", "secrets", "get"),
        release_ns,
        "rel-gpu-dra-driver-webhook-tls",
    );
    // The dry-run probe's create would publish devices if it were not a dry run.
    let probe = (("resource.k8s.io", "resourceslices", "create"), None, "");

    let objects = check_objects(render(&helm, &["checkRole.enabled=true"]));
    for (request, ns, name) in reads {
        assert!(
            rbac_allows(&objects, request, ns, name),
            "{request:?} in {ns:?}"
        );
    }
    for (request, ns, name) in workload.into_iter().chain([secret, probe]) {
        assert!(
            !rbac_allows(&objects, request, ns, name),
            "{request:?} in {ns:?}"
        );
    }
    // Only reads, and no binding without subjects.
    for o in &objects {
        for r in o["rules"].as_array().into_iter().flatten() {
            assert!(
                strs(&r["verbs"])
                    .iter()
                    .all(|v| ["get", "list"].contains(v)),
                "{r}"
            );
        }
        assert!(
            !o["kind"].as_str().unwrap_or_default().ends_with("Binding"),
            "{o}"
        );
    }

    let objects = check_objects(render(
        &helm,
        &[
            "checkRole.enabled=true",
            "checkRole.workload=true",
            "checkRole.webhookSecret=true",
            "checkRole.subjects[0].kind=Group",
            "checkRole.subjects[0].name=gpu-operators",
            "checkRole.subjects[0].apiGroup=rbac.authorization.k8s.io",
        ],
    ));
    for (request, ns, name) in reads.into_iter().chain(workload).chain([secret]) {
        assert!(
            rbac_allows(&objects, request, ns, name),
            "{request:?} in {ns:?}"
        );
    }
    // The Secret by its name only, and the probe's create still not.
    let other_secret = (("", "secrets", "get"), release_ns, "other");
    for (request, ns, name) in [other_secret, probe] {
        assert!(
            !rbac_allows(&objects, request, ns, name),
            "{request:?} {name}"
        );
    }
    let subjects = serde_json::json!([
        {"kind": "Group", "name": "gpu-operators", "apiGroup": "rbac.authorization.k8s.io"}]);
    for (kind, role_kind) in [
        ("ClusterRoleBinding", "ClusterRole"),
        ("RoleBinding", "Role"),
    ] {
        let b = find(&objects, kind, "rel-gpu-dra-driver-check");
        assert_eq!(b["subjects"], subjects, "{kind}");
        assert_eq!(b["roleRef"]["kind"], role_kind);
        assert_eq!(b["roleRef"]["name"], "rel-gpu-dra-driver-check");
    }
    assert_eq!(
        find(&objects, "RoleBinding", "rel-gpu-dra-driver-check")["metadata"]["namespace"],
        NAMESPACE
    );
}
