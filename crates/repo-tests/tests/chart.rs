//! Renders the Helm chart (deploy/helm/gpu-dra-driver) with helm and checks what matters:
//! DeviceClass selectors, the node-restriction policy's user name and node claim, RBAC, the
//! webhook registration and the node plugin's environment; and evaluates the node-restriction
//! policy's CEL (with the `cel` crate) on plugin requests for its own and other nodes.
//!
//! Needs a helm binary: env `HELM`, else `.tools/bin/helm` (`make chart-check` installs it).
//! Without one the test says so and passes, unless env `CHART_CHECK=1` demands helm
//! (`make chart-check` sets it, so there it cannot pass vacuously).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const NAMESPACE: &str = "gpu-system";
const KUBE_VERSION: &str = "1.34.0";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
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
    let mut cmd = Command::new(helm);
    cmd.args(["template", "rel"])
        .arg(repo().join("deploy/helm/gpu-dra-driver"))
        .args(["--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().expect("helm runs");
    assert!(
        out.status.success(),
        "helm template {sets:?}: {}",
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
        .arg(repo().join("deploy/helm/gpu-dra-driver"))
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

    // The node plugin: service account, env for every flag, host paths, probes.
    let ds = find(&objects, "DaemonSet", "rel-gpu-dra-driver-kubelet-plugin");
    let pod = &ds["spec"]["template"]["spec"];
    let sa = pod["serviceAccountName"].as_str().unwrap();
    let container = &pod["containers"][0];
    let env: Vec<&str> = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for flag_env in [
        "NODE_NAME",
        "DRIVER_NAME",
        "PLUGIN_DIR",
        "REGISTRAR_DIR",
        "CDI_ROOT",
        "NVIDIA_DRIVER_ROOT",
        "NVIDIA_DEV_ROOT",
        "SYSFS_ROOT",
        "HTTP_ADDRESS",
        "LOG_FORMAT",
        "LOG_LEVEL",
        "CLEANUP_INTERVAL",
    ] {
        assert!(env.contains(&flag_env), "{flag_env} missing from {env:?}");
    }
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
    // mounted at /driver-root.
    assert_eq!(plugin_env(ds, "NVIDIA_DEV_ROOT"), Some("/"));
    assert_eq!(plugin_env(ds, "NVIDIA_DRIVER_ROOT"), Some("/driver-root"));
    let mounts = mount_paths(ds);
    assert!(
        mounts.contains(&"/dev") && mounts.contains(&"/driver-root"),
        "{mounts:?}"
    );
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
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
            (
                "resource.k8s.io".into(),
                "resourceclaims".into(),
                vec!["get", "list", "watch"]
            ),
            (
                "resource.k8s.io".into(),
                "resourceslices".into(),
                vec!["create", "update", "delete", "list", "watch"]
            ),
            ("".into(), "nodes".into(), vec!["get"]),
        ]
    );
    let bindings: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
        .collect();
    assert_eq!(bindings.len(), 1, "only the plugin is bound to a role");
    assert_eq!(bindings[0]["subjects"][0]["name"], sa);
    assert_eq!(bindings[0]["subjects"][0]["namespace"], NAMESPACE);

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

    // The webhook: registered for our three resources in v1 only, with a CA bundle.
    let vwc = find(
        &objects,
        "ValidatingWebhookConfiguration",
        "rel-gpu-dra-driver-webhook",
    );
    let hook = &vwc["webhooks"][0];
    assert_eq!(hook["failurePolicy"], "Fail");
    assert_eq!(strs(&hook["admissionReviewVersions"]), ["v1"]);
    assert_eq!(hook["clientConfig"]["service"]["path"], "/validate");
    assert!(
        !hook["clientConfig"]["caBundle"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    let rule = &hook["rules"][0];
    assert_eq!(strs(&rule["apiVersions"]), ["v1"]);
    assert_eq!(
        strs(&rule["resources"]),
        ["resourceclaims", "resourceclaimtemplates", "deviceclasses"]
    );
    assert_eq!(strs(&rule["operations"]), ["CREATE", "UPDATE"]);
    let deploy = find(&objects, "Deployment", "rel-gpu-dra-driver-webhook");
    let webhook_pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(webhook_pod["automountServiceAccountToken"], false);
    assert_eq!(
        webhook_pod["containers"][0]["readinessProbe"]["httpGet"]["scheme"],
        "HTTPS"
    );
    let secret = find(&objects, "Secret", "rel-gpu-dra-driver-webhook-tls");
    assert_eq!(
        secret["data"]["ca.crt"], hook["clientConfig"]["caBundle"],
        "the registered CA is the one that signed the served certificate"
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
            "webhook.failurePolicy=Ignore",
            "webhook.v1beta1=true",
            "webhook.v1beta2=true",
            "webhook.tls.mode=certManager",
            "kubeletPlugin.driverRoot=/run/nvidia/driver",
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
    assert_eq!(hook["webhooks"][0]["failurePolicy"], "Ignore");
    assert_eq!(
        strs(&hook["webhooks"][0]["rules"][0]["apiVersions"]),
        ["v1", "v1beta2", "v1beta1"]
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
        ("kubeletPlugin.driverRoot=relative", "driverRoot"),
        ("logFormat=xml", "logFormat"),
        ("webhook.tls.mode=secret", "webhook.tls.secret.name"),
    ] {
        let out = Command::new(&helm)
            .args(["template", "rel"])
            .arg(repo().join("deploy/helm/gpu-dra-driver"))
            .args(["--kube-version", KUBE_VERSION, "--set", set])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set} accepted");
        assert!(err.contains(want), "{set}: {err}");
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
    let spec = &vap["spec"];
    let mut vars = serde_json::json!({
        "request": {"operation": op, "userInfo": {"username": user, "extra": extra}},
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
        let cel::Value::String(s) = eval(expr, &vars) else {
            panic!("variable {} is not a string", var["name"]);
        };
        variables.insert(
            var["name"].as_str().expect("name").to_owned(),
            Value::String(s.to_string()),
        );
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
        Some(n) => serde_json::json!({"spec": {"driver": "gpu.nvidia.com", "nodeName": n}}),
        None => serde_json::json!({"spec": {"driver": "gpu.nvidia.com", "allNodes": true}}),
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
            "the kubelet plugin on node node-a may only write ResourceSlices with spec.nodeName node-a, not \"node-b\""
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
}
