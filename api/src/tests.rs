//! Decoding tests: every rule, both apiVersions, the examples users copy from talks, and
//! malformed input of every kind.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::*;

const V1BETA1: &str = "resource.nvidia.com/v1beta1";
const V1ALPHA1: &str = "gpu.nvidia.com/v1alpha1";
const GPU0: &str = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c";
const MIG0: &str = "MIG-cd8ad1b9-d0c3-5bbc-9a4b-93c2e5c9b0f1";

fn gpu(sharing: Value) -> Value {
    json!({"apiVersion": V1BETA1, "kind": "GpuConfig", "sharing": sharing})
}

fn mig(sharing: Value) -> Value {
    json!({"apiVersion": V1BETA1, "kind": "MigDeviceConfig", "sharing": sharing})
}

/// The error lines of a config that must not decode.
fn errors(v: &Value) -> Vec<String> {
    match decode(v) {
        Ok(c) => panic!("decoded {v} to {c:?}, expected errors"),
        Err(e) => e.iter().map(ToString::to_string).collect(),
    }
}

/// Asserts exactly one error, at `path`, whose message contains `needle`.
fn one_error(v: &Value, path: &str, needle: &str) {
    let e = decode(v).expect_err("expected an error");
    assert_eq!(e.len(), 1, "{e}");
    let fe = &e.0[0];
    assert_eq!(fe.path, path, "{e}");
    assert!(fe.message.contains(needle), "{e}\n  lacks {needle:?}");
}

fn mps(config: &Config) -> &MpsConfig {
    match config.sharing() {
        Some(Sharing::Mps(m)) => m,
        other => panic!("expected MPS, got {other:?}"),
    }
}

#[test]
fn both_api_versions_decode_the_same() {
    for (v, expected) in [
        (V1BETA1, ApiVersion::ResourceNvidiaComV1beta1),
        (V1ALPHA1, ApiVersion::GpuNvidiaComV1alpha1),
    ] {
        for kind in KINDS {
            let c = decode(&json!({"apiVersion": v, "kind": kind})).unwrap();
            assert_eq!(c.api_version(), expected);
            assert_eq!(c.kind().as_str(), kind);
            assert_eq!(c.sharing(), None, "no sharing = exclusive");
        }
    }
}

#[test]
fn talk_example_time_slicing_long() {
    let c = decode_yaml(
        "apiVersion: gpu.nvidia.com/v1alpha1\n\
         kind: GpuConfig\n\
         sharing:\n  strategy: TimeSlicing\n  timeSlicingConfig:\n    interval: Long\n",
    )
    .unwrap();
    assert_eq!(c.kind(), ConfigKind::Gpu);
    assert_eq!(
        c.sharing(),
        Some(&Sharing::TimeSlicing {
            interval: Interval::Long
        })
    );
    assert_eq!(Interval::Long.as_nvidia_smi_value(), 3);
}

#[test]
fn talk_example_mps_50_percent_5gi() {
    let c = decode_yaml(
        "apiVersion: resource.nvidia.com/v1beta1\n\
         kind: GpuConfig\n\
         sharing:\n  strategy: MPS\n  mpsConfig:\n    defaultActiveThreadPercentage: 50\n    \
         defaultPinnedDeviceMemoryLimit: 5Gi\n",
    )
    .unwrap();
    let m = mps(&c);
    assert_eq!(m.active_thread_percentage, Some(50));
    assert_eq!(m.pinned_memory_limit_mib, Some(5 * 1024));
    assert!(m.per_device_pinned_memory_limit_mib.is_empty());
}

#[test]
fn multi_user_is_a_boolean_defaulting_to_false_in_both_kinds() {
    assert!(!mps(&decode(&gpu(json!({"strategy": "MPS"}))).unwrap()).multi_user);
    for config in [
        gpu(json!({"strategy": "MPS", "mpsConfig": {"multiUser": true}})),
        mig(json!({"strategy": "MPS", "mpsConfig": {"multiUser": true}})),
    ] {
        let c = decode(&config).unwrap();
        assert!(mps(&c).multi_user);
        // The canonical form keeps it, and only when set.
        assert_eq!(c.to_parameters()["sharing"]["mpsConfig"]["multiUser"], true);
        assert_eq!(decode(&c.to_parameters()).unwrap(), c);
    }
    let off = decode(&gpu(
        json!({"strategy": "MPS", "mpsConfig": {"multiUser": false}}),
    ))
    .unwrap();
    assert!(!mps(&off).multi_user);
    assert_eq!(off.to_parameters()["sharing"]["mpsConfig"], json!({}));
    one_error(
        &gpu(json!({"strategy": "MPS", "mpsConfig": {"multiUser": "yes"}})),
        "sharing.mpsConfig.multiUser",
        "must be true or false, got string \"yes\"",
    );
    // Strict decoding still refuses a misspelling, and suggests the field.
    let e = decode(&gpu(
        json!({"strategy": "MPS", "mpsConfig": {"multiuser": true}}),
    ))
    .unwrap_err();
    assert_eq!(e.len(), 1, "{e}");
    assert!(e.to_string().contains("multiUser"), "{e}");
}

#[test]
fn talk_example_mig_device_config_with_mps() {
    let c = decode(&mig(json!({"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 25,
        "defaultPerDevicePinnedMemoryLimit": {"0": "2Gi", MIG0: "1536Mi"}}})))
    .unwrap();
    assert_eq!(c.kind(), ConfigKind::Mig);
    let m = mps(&c);
    assert_eq!(m.active_thread_percentage, Some(25));
    assert_eq!(
        m.per_device_pinned_memory_limit_mib,
        BTreeMap::from([
            (DeviceKey::Index(0), 2048),
            (DeviceKey::Uuid(MIG0.into()), 1536)
        ])
    );
}

#[test]
fn canonical_parameters_write_defaults_and_whole_mib() {
    let c = decode(&gpu(json!({"strategy": "MPS", "mpsConfig": {
        "defaultPinnedDeviceMemoryLimit": "1.5G",
        "defaultPerDevicePinnedMemoryLimit": {GPU0: "1Gi"}}})))
    .unwrap();
    assert_eq!(
        c.to_parameters(),
        gpu(json!({"strategy": "MPS", "mpsConfig": {
            "defaultPinnedDeviceMemoryLimit": "1430Mi",
            "defaultPerDevicePinnedMemoryLimit": {GPU0: "1024Mi"}}}))
    );
    let c = decode(&gpu(json!({"strategy": "TimeSlicing"}))).unwrap();
    assert_eq!(
        c.to_parameters(),
        gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}}))
    );
    let c = decode(&mig(json!({"strategy": "TimeSlicing"}))).unwrap();
    assert_eq!(c.to_parameters(), mig(json!({"strategy": "TimeSlicing"})));
    let c = decode(&json!({"apiVersion": V1ALPHA1, "kind": "GpuConfig"})).unwrap();
    assert_eq!(
        c.to_parameters(),
        json!({"apiVersion": V1ALPHA1, "kind": "GpuConfig"})
    );
}

#[test]
fn defaults_are_applied() {
    let ts = |tsc: Value| {
        let mut s = json!({"strategy": "TimeSlicing"});
        if !tsc.is_null() {
            s["timeSlicingConfig"] = tsc;
        }
        decode(&gpu(s)).unwrap()
    };
    let default = Some(Sharing::TimeSlicing {
        interval: Interval::Default,
    });
    assert_eq!(ts(Value::Null).sharing().cloned(), default);
    // `timeSlicingConfig: {}` crashed the NVIDIA plugin; here it is just the default.
    assert_eq!(ts(json!({})).sharing().cloned(), default);
    assert_eq!(ts(json!({"interval": null})).sharing().cloned(), default);
    for (name, value) in [("Default", 0), ("Short", 1), ("Medium", 2), ("Long", 3)] {
        let c = ts(json!({ "interval": name }));
        let Some(Sharing::TimeSlicing { interval }) = c.sharing() else {
            panic!()
        };
        assert_eq!(interval.as_nvidia_smi_value(), value);
        assert_eq!(interval.as_str(), name);
    }
    let c = decode(&gpu(json!({"strategy": "MPS"}))).unwrap();
    assert_eq!(mps(&c), &MpsConfig::default());
    let c = decode(&gpu(json!({"strategy": "MPS", "mpsConfig": {}}))).unwrap();
    assert_eq!(mps(&c), &MpsConfig::default());
    // Explicit nulls mean "not set", as in Kubernetes' own decoding.
    let c = decode(&json!({"apiVersion": V1BETA1, "kind": "GpuConfig", "sharing": null})).unwrap();
    assert_eq!(c.sharing(), None);
    let c = decode(&mig(json!({"strategy": "TimeSlicing"}))).unwrap();
    assert_eq!(
        c.sharing().cloned(),
        default,
        "MIG time slicing is the default"
    );
}

#[test]
fn strategy_must_be_spelled_exactly() {
    for (input, meant) in [
        ("Time-Slicing", "TimeSlicing"),
        ("timeslicing", "TimeSlicing"),
        ("time_slicing", "TimeSlicing"),
        ("TIMESLICING", "TimeSlicing"),
        ("mps", "MPS"),
        ("Mps", "MPS"),
    ] {
        let v = gpu(json!({ "strategy": input }));
        one_error(
            &v,
            "sharing.strategy",
            &format!("unknown strategy {input:?}; did you mean \"{meant}\"?"),
        );
    }
    one_error(
        &gpu(json!({"strategy": "Exclusive"})),
        "sharing.strategy",
        "unknown strategy \"Exclusive\"; valid: \"TimeSlicing\" or \"MPS\"",
    );
    one_error(&gpu(json!({})), "sharing.strategy", "required");
    one_error(
        &gpu(json!({"strategy": null})),
        "sharing.strategy",
        "required",
    );
    one_error(
        &gpu(json!({"strategy": 1})),
        "sharing.strategy",
        "must be a string (\"TimeSlicing\" or \"MPS\"), got number 1",
    );
}

#[test]
fn interval_must_be_spelled_exactly() {
    for (input, meant) in [("long", "Long"), ("SHORT", "Short"), ("Meduim", "Medium")] {
        one_error(
            &gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": input}})),
            "sharing.timeSlicingConfig.interval",
            &format!("did you mean \"{meant}\"?"),
        );
    }
    one_error(
        &gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": 3}})),
        "sharing.timeSlicingConfig.interval",
        "must be a string (\"Default\", \"Short\", \"Medium\" or \"Long\"), got number 3",
    );
}

#[test]
fn sub_configs_only_with_their_strategy() {
    one_error(
        &gpu(
            json!({"strategy": "TimeSlicing", "mpsConfig": {"defaultActiveThreadPercentage": 50}}),
        ),
        "sharing.mpsConfig",
        "only allowed with strategy \"MPS\", but strategy is \"TimeSlicing\"",
    );
    one_error(
        &gpu(json!({"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}})),
        "sharing.timeSlicingConfig",
        "only allowed with strategy \"TimeSlicing\", but strategy is \"MPS\"",
    );
    // An empty block is still a block in the wrong place.
    one_error(
        &gpu(json!({"strategy": "MPS", "timeSlicingConfig": {}})),
        "sharing.timeSlicingConfig",
        "only allowed with strategy \"TimeSlicing\"",
    );
}

#[test]
fn mig_device_config_has_no_time_slicing_config() {
    one_error(
        &mig(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})),
        "sharing.timeSlicingConfig",
        "not supported in MigDeviceConfig",
    );
}

#[test]
fn thread_percentage_is_1_to_100() {
    let with = |p: Value| {
        gpu(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": p}}))
    };
    for ok in [1, 50, 100] {
        assert_eq!(
            mps(&decode(&with(json!(ok))).unwrap()).active_thread_percentage,
            Some(ok)
        );
    }
    let path = "sharing.mpsConfig.defaultActiveThreadPercentage";
    one_error(
        &with(json!(0)),
        path,
        "0 is out of range 1..=100 (MPS rejects 0)",
    );
    assert_eq!(
        errors(&with(json!(150))),
        ["sharing.mpsConfig.defaultActiveThreadPercentage: 150 is out of range 1..=100"]
    );
    one_error(&with(json!(-1)), path, "-1 is out of range");
    one_error(
        &with(json!(u64::MAX)),
        path,
        "18446744073709551615 is out of range",
    );
    one_error(
        &with(json!(50.5)),
        path,
        "must be a whole number 1..=100, got number 50.5",
    );
    one_error(&with(json!("50")), path, "got string \"50\"");
    one_error(&with(json!("50%")), path, "must be a whole number");
}

#[test]
fn memory_limits_are_whole_mib_rounded_down_and_at_least_1mi() {
    let with = |q: Value| {
        gpu(json!({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": q}}))
    };
    let mib = |q: Value| mps(&decode(&with(q)).unwrap()).pinned_memory_limit_mib;
    assert_eq!(mib(json!("1Mi")), Some(1));
    assert_eq!(mib(json!("5Gi")), Some(5120));
    assert_eq!(mib(json!("1.5Gi")), Some(1536));
    assert_eq!(mib(json!("1536Mi")), Some(1536));
    assert_eq!(
        mib(json!("1G")),
        Some(953),
        "10^9 bytes = 953.67 MiB, rounded down"
    );
    assert_eq!(mib(json!("2047Ki")), Some(1), "rounded down, not up");
    assert_eq!(mib(json!("1e9")), Some(953));
    assert_eq!(
        mib(json!(1_073_741_824)),
        Some(1024),
        "bare numbers are quantities too"
    );
    assert_eq!(mib(json!(1.5e9)), Some(1430));
    let path = "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit";
    one_error(&with(json!("1M")), path, "1M is below the minimum 1Mi");
    one_error(&with(json!("1023Ki")), path, "below the minimum 1Mi");
    one_error(&with(json!("0")), path, "must be positive");
    one_error(&with(json!("-1Gi")), path, "-1Gi must be positive");
    one_error(&with(json!("16Ei")), path, "too large");
    one_error(
        &with(json!("5GB")),
        path,
        "invalid quantity \"5GB\": unknown suffix \"GB\"",
    );
    one_error(
        &with(json!(true)),
        path,
        "must be a memory quantity such as \"5Gi\"",
    );
    one_error(&with(json!({})), path, "got an object");
}

#[test]
fn per_device_keys_are_well_formed() {
    let with = |k: &str| {
        gpu(
            json!({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {k: "1Gi"}}}),
        )
    };
    for good in [
        "0",
        "7",
        "4294967295",
        GPU0,
        MIG0,
        "MIG-GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c/1/0",
        "GPU-4CF8DB2D-06C0-7D70-1A51-E59B25B2C16C",
    ] {
        let c = decode(&with(good)).unwrap_or_else(|e| panic!("{good}: {e}"));
        assert_eq!(
            mps(&c)
                .per_device_pinned_memory_limit_mib
                .keys()
                .next()
                .map(ToString::to_string),
            Some(good.to_owned())
        );
    }
    for bad in [
        "",
        "01",
        "+1",
        "-1",
        " 1",
        "1.0",
        "gpu-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c",
        "GPU-4cf8db2d",
        "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16",
        "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16g",
        "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c-00",
        "MIG-GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c/1",
        "MIG-GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c/1/0/0",
        "MIG-GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c/01/0",
        "MIG-GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c/a/0",
        "gpu0",
    ] {
        let path = format!("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{bad}]");
        one_error(&with(bad), &path, "invalid device key");
    }
    one_error(
        &with("4294967296"),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[4294967296]",
        "out of range",
    );
    // The value is checked too, and both problems of one entry are reported.
    let v = gpu(
        json!({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"x": "1k"}}}),
    );
    assert_eq!(errors(&v).len(), 2);
    one_error(
        &gpu(
            json!({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": ["1Gi"]}}),
        ),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",
        "must be a map from device index or UUID to a memory quantity, got a list",
    );
    let c = decode(&gpu(
        json!({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": null}}),
    ))
    .unwrap();
    assert!(mps(&c).per_device_pinned_memory_limit_mib.is_empty());
}

#[test]
fn unknown_fields_are_rejected_at_every_level() {
    one_error(
        &json!({"apiVersion": V1BETA1, "kind": "GpuConfig", "metadata": {}}),
        "metadata",
        "unknown field; valid fields here: apiVersion, kind, sharing",
    );
    one_error(
        &gpu(json!({"strategy": "TimeSlicing", "timeslicingConfig": {}})),
        "sharing.timeslicingConfig",
        "unknown field; did you mean \"timeSlicingConfig\"?",
    );
    one_error(
        &gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"intervall": "Long"}})),
        "sharing.timeSlicingConfig.intervall",
        "did you mean \"interval\"?",
    );
    one_error(
        &gpu(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercent": 5}})),
        "sharing.mpsConfig.defaultActiveThreadPercent",
        "unknown field",
    );
    one_error(
        &mig(json!({"strategy": "MPS", "extra": 1})),
        "sharing.extra",
        "valid fields here: strategy, mpsConfig",
    );
}

#[test]
fn wrong_types_are_rejected_at_every_level() {
    for v in [json!(null), json!([]), json!("GpuConfig"), json!(3)] {
        let e = errors(&v);
        assert_eq!(e.len(), 1);
        assert!(
            e[0].starts_with("must be an object with apiVersion, kind and sharing"),
            "{e:?}"
        );
    }
    one_error(
        &gpu(json!("MPS")),
        "sharing",
        "must be an object with strategy",
    );
    one_error(
        &gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": "Long"})),
        "sharing.timeSlicingConfig",
        "must be an object with an optional interval",
    );
    one_error(
        &gpu(json!({"strategy": "MPS", "mpsConfig": [1]})),
        "sharing.mpsConfig",
        "must be an object with optional defaultActiveThreadPercentage",
    );
    one_error(
        &json!({"apiVersion": 1, "kind": "GpuConfig"}),
        "apiVersion",
        "must be a string",
    );
    one_error(
        &json!({"apiVersion": V1BETA1, "kind": ["GpuConfig"]}),
        "kind",
        "must be a string (\"GpuConfig\" or \"MigDeviceConfig\"), got a list",
    );
}

#[test]
fn api_version_and_kind_are_required_and_known() {
    assert_eq!(
        errors(&json!({})),
        [
            "apiVersion: required: one of \"resource.nvidia.com/v1beta1\" or \"gpu.nvidia.com/v1alpha1\"",
            "kind: required: one of \"GpuConfig\" or \"MigDeviceConfig\"",
        ]
    );
    one_error(
        &json!({"apiVersion": "resource.nvidia.com/v1beta2", "kind": "GpuConfig"}),
        "apiVersion",
        "unknown apiVersion \"resource.nvidia.com/v1beta2\"; did you mean \"resource.nvidia.com/v1beta1\"?",
    );
    one_error(
        &json!({"apiVersion": "v1", "kind": "GpuConfig"}),
        "apiVersion",
        "valid: \"resource.nvidia.com/v1beta1\" or \"gpu.nvidia.com/v1alpha1\"",
    );
    one_error(
        &json!({"apiVersion": V1BETA1, "kind": "GPUConfig"}),
        "kind",
        "did you mean \"GpuConfig\"?",
    );
}

#[test]
fn all_problems_are_reported_together() {
    let v = json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "GpuConfig",
        "extra": true,
        "sharing": {
            "strategy": "TimeSlicing",
            "timeSlicingConfig": {"interval": "long"},
            "mpsConfig": {
                "defaultActiveThreadPercentage": 0,
                "defaultPinnedDeviceMemoryLimit": "1k",
                "defaultPerDevicePinnedMemoryLimit": {"01": "1Gi"}
            }
        }
    });
    let e = errors(&v);
    let paths: Vec<&str> = e.iter().map(|l| l.split(": ").next().unwrap()).collect();
    assert_eq!(
        paths,
        [
            "extra",
            "apiVersion",
            "sharing.timeSlicingConfig.interval",
            "sharing.mpsConfig.defaultActiveThreadPercentage",
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[01]",
            "sharing.mpsConfig",
        ],
        "{e:#?}"
    );
}

#[test]
fn unknown_kind_still_reports_body_errors() {
    let v = json!({"apiVersion": V1BETA1, "kind": "MigConfig", "sharing": {"strategy": "mps"}});
    let e = errors(&v);
    assert_eq!(e.len(), 2, "{e:?}");
    assert!(e[1].starts_with("sharing.strategy: unknown strategy \"mps\""));
}

#[test]
fn yaml_input_errors_are_clear() {
    let e = decode_yaml("apiVersion: [unclosed\nkind: GpuConfig\n").unwrap_err();
    assert_eq!(e.len(), 1);
    assert!(
        e.0[0]
            .message
            .starts_with("invalid YAML: line 2 column 5: "),
        "{e}"
    );
    assert!(!e.0[0].message.contains('\n'), "{e}");
    assert!(e.0[0].path.is_empty());
    let e = decode_yaml("- a\n- b\n").unwrap_err();
    assert!(e.to_string().starts_with("must be an object"), "{e}");
    let e = decode_yaml("").unwrap_err();
    assert_eq!(e.len(), 1, "{e}");
    // JSON is YAML.
    decode_yaml(r#"{"apiVersion": "gpu.nvidia.com/v1alpha1", "kind": "GpuConfig"}"#).unwrap();
}

#[test]
fn validate_catches_hand_built_configs() {
    let bad = Config::Gpu(GpuConfig {
        api_version: ApiVersion::ResourceNvidiaComV1beta1,
        sharing: Some(Sharing::Mps(MpsConfig {
            active_thread_percentage: Some(0),
            pinned_memory_limit_mib: Some(0),
            per_device_pinned_memory_limit_mib: BTreeMap::from([(
                DeviceKey::Uuid("nope".into()),
                1,
            )]),
            multi_user: false,
        })),
    });
    assert_eq!(bad.validate().unwrap_err().len(), 3);
    let bad = Config::Mig(MigDeviceConfig {
        api_version: ApiVersion::GpuNvidiaComV1alpha1,
        sharing: Some(Sharing::TimeSlicing {
            interval: Interval::Long,
        }),
    });
    assert_eq!(
        bad.validate().unwrap_err().to_string(),
        "sharing.timeSlicingConfig: not supported in MigDeviceConfig: MIG devices have no time-slice setting"
    );
}

mod fuzzish {
    //! Property tests: decoding never panics, whatever the input.
    use super::*;
    use proptest::prelude::*;

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| json!(f)),
            "[a-zA-Z0-9.+-]{0,12}".prop_map(Value::String),
            prop::sample::select(vec![
                "GpuConfig",
                "MigDeviceConfig",
                V1BETA1,
                V1ALPHA1,
                "TimeSlicing",
                "MPS",
                "Long",
                "5Gi",
                "1e3",
                "0",
                GPU0,
                MIG0,
                "-1Mi",
                "1.5E-3",
            ])
            .prop_map(|s| Value::String(s.to_owned())),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            let key = prop::sample::select(vec![
                "apiVersion",
                "kind",
                "sharing",
                "strategy",
                "timeSlicingConfig",
                "interval",
                "mpsConfig",
                "defaultActiveThreadPercentage",
                "defaultPinnedDeviceMemoryLimit",
                "defaultPerDevicePinnedMemoryLimit",
                "multiUser",
                "0",
                "1",
                GPU0,
                "x",
            ])
            .prop_map(str::to_owned);
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(key, inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn valid_configs() -> Vec<Value> {
        vec![
            gpu(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})),
            gpu(json!({"strategy": "MPS", "mpsConfig": {
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "5Gi",
                "defaultPerDevicePinnedMemoryLimit": {"0": "1Gi", GPU0: "2Gi"}}})),
            mig(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 10}})),
            json!({"apiVersion": V1ALPHA1, "kind": "MigDeviceConfig"}),
        ]
    }

    /// Every JSON pointer into `v`.
    fn pointers(v: &Value, base: String, out: &mut Vec<String>) {
        out.push(base.clone());
        match v {
            Value::Object(m) => {
                for (k, c) in m {
                    pointers(c, format!("{base}/{k}"), out);
                }
            }
            Value::Array(a) => {
                for (i, c) in a.iter().enumerate() {
                    pointers(c, format!("{base}/{i}"), out);
                }
            }
            _ => {}
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn decode_never_panics_on_arbitrary_json(v in arb_json()) {
            if let Ok(c) = decode(&v) {
                prop_assert!(c.validate().is_ok());
            }
        }

        #[test]
        fn decode_never_panics_on_mutated_valid_configs(
            which in 0usize..4,
            pick in any::<prop::sample::Index>(),
            replacement in arb_json(),
        ) {
            let mut v = valid_configs()[which].clone();
            let mut ptrs = Vec::new();
            pointers(&v, String::new(), &mut ptrs);
            let ptr = pick.get(&ptrs).clone();
            if let Some(slot) = v.pointer_mut(&ptr) {
                *slot = replacement;
            }
            match decode(&v) {
                Ok(c) => {
                    prop_assert!(c.validate().is_ok());
                    let _ = validate_for_devices(&c, &[ClaimDevice::gpu(GPU0), ClaimDevice::mig(MIG0)]);
                }
                Err(e) => {
                    prop_assert!(!e.is_empty());
                    for fe in &e {
                        prop_assert!(!fe.message.is_empty());
                    }
                }
            }
        }

        #[test]
        fn canonical_parameters_round_trip(v in arb_json()) {
            if let Ok(c) = decode(&v) {
                prop_assert_eq!(decode(&c.to_parameters()), Ok(c));
            }
        }

        #[test]
        fn yaml_decode_never_panics(text in "\\PC{0,200}") {
            let _ = decode_yaml(&text);
        }

        #[test]
        fn quantity_parse_never_panics(text in "[-+0-9.eEkKMGTPinum ]{0,24}") {
            if let Ok(q) = quantity::Quantity::parse(&text) {
                let _ = q.to_bytes_ceil();
                // The canonical display parses back to the same value.
                let again = quantity::Quantity::parse(&q.to_string()).unwrap();
                prop_assert_eq!(again.to_bytes_ceil(), q.to_bytes_ceil());
            }
        }
    }

    #[test]
    fn valid_configs_are_valid_and_round_trip() {
        for v in valid_configs() {
            let c = decode(&v).unwrap_or_else(|e| panic!("{v}: {e}"));
            assert_eq!(decode(&c.to_parameters()), Ok(c));
        }
    }
}
