//! Tests of the advice: each offering kind, each refusal, GPUs without MIG, the margin as a
//! floor, packing, and the template change.

use super::*;

fn a100_80() -> GpuModel {
    GpuModel {
        product: "NVIDIA A100-SXM4-80GB".into(),
        memory_bytes: 80 * GIB,
        mig: mig_tables::table_for_product("NVIDIA A100-SXM4-80GB"),
        offered: None,
    }
}

fn t4() -> GpuModel {
    GpuModel {
        product: "Tesla T4".into(),
        memory_bytes: 16 * GIB,
        mig: mig_tables::table_for_product("Tesla T4"),
        offered: None,
    }
}

fn opts() -> Options {
    Options {
        margin: 20,
        sm_threshold: 50,
        min_samples: 100,
        min_history: 3600,
        offerings: vec![
            OfferingKind::Mig,
            OfferingKind::Share,
            OfferingKind::Mps,
            OfferingKind::Timeslicing,
        ],
    }
}

fn seen(peak: u64, sm: Option<u32>) -> Evidence {
    Evidence {
        peak_used_bytes: peak,
        p95_used_bytes: Some(peak),
        sm_p95_percent: sm,
        samples: 5760,
        covered_seconds: 86_400,
    }
}

fn decide_gpu(e: &Evidence, model: &GpuModel, o: &Options) -> Offering {
    decide(Some(e), model, &Holding::Gpu, 1, o)
}

#[test]
fn a_notebook_on_an_a100_gets_the_smallest_mig_profile() {
    let got = decide_gpu(&seen(3 * GIB, Some(5)), &a100_80(), &opts());
    assert_eq!(
        got,
        Offering::Mig {
            profile: "1g.10gb".into(),
            memory_bytes: 9728 * MIB,
            compute_slices: 1
        }
    );
}

#[test]
fn compute_above_one_slice_takes_a_larger_profile_not_a_larger_memory_one() {
    // 10 GiB + 20 % = 12 GiB: 1g.20gb holds the memory, but 15 % SM + 20 % = 18 % needs two
    // of seven compute slices.
    let got = decide_gpu(&seen(10 * GIB, Some(15)), &a100_80(), &opts());
    assert!(
        matches!(&got, Offering::Mig { profile, .. } if profile == "2g.20gb"),
        "{got:?}"
    );
    let got = decide_gpu(&seen(10 * GIB, Some(10)), &a100_80(), &opts());
    assert!(
        matches!(&got, Offering::Mig { profile, .. } if profile == "1g.20gb"),
        "{got:?}"
    );
}

#[test]
fn a_gpu_without_mig_gets_a_memory_share_rounded_up_to_a_gib() {
    assert!(t4().mig.is_none());
    let got = decide_gpu(&seen(3 * GIB, Some(5)), &t4(), &opts());
    assert_eq!(
        got,
        Offering::Share {
            memory_bytes: 4 * GIB
        }
    );
}

#[test]
fn compute_above_the_memory_proportion_gets_mps_threads() {
    // 1 GiB + 20 % -> 2 GiB share = 12 % of a T4; 30 % SM + 20 % = 36 % threads.
    let got = decide_gpu(&seen(GIB, Some(30)), &t4(), &opts());
    assert_eq!(
        got,
        Offering::Mps {
            memory_bytes: 2 * GIB,
            active_thread_percentage: 36
        }
    );
}

#[test]
fn time_slicing_when_it_is_the_offering_the_cluster_runs() {
    let o = Options {
        offerings: vec![OfferingKind::Timeslicing],
        ..opts()
    };
    let got = decide_gpu(&seen(3 * GIB, Some(5)), &a100_80(), &o);
    assert_eq!(
        got,
        Offering::TimeSlicing {
            memory_bytes: 4 * GIB
        }
    );
}

#[test]
fn each_refusal_and_each_reason_to_keep_the_gpu_says_why() {
    let o = opts();
    let m = a100_80();
    let reason = |got: Offering| match got {
        Offering::Keep { reason } => format!("keep: {reason}"),
        Offering::Refused { reason } => format!("refused: {reason}"),
        other => panic!("advised {other:?}"),
    };
    let few = Evidence {
        samples: 99,
        ..seen(GIB, Some(5))
    };
    let short = Evidence {
        covered_seconds: 3599,
        ..seen(GIB, Some(5))
    };
    let cases = [
        (
            decide(None, &m, &Holding::Gpu, 1, &o),
            "refused: no usage history",
        ),
        (
            decide_gpu(&few, &m, &o),
            "refused: too little history: 99 samples, --min-samples is 100",
        ),
        (
            decide_gpu(&short, &m, &o),
            "refused: too little history: 3599s covered, --min-history is 3600s",
        ),
        (
            decide(Some(&seen(GIB, Some(5))), &m, &Holding::Gpu, 4, &o),
            "keep: multi-GPU claim (4 devices)",
        ),
        (
            decide_gpu(&seen(70 * GIB, Some(95)), &m, &o),
            "keep: SM p95 95% is at or above the threshold 50%",
        ),
        (
            decide_gpu(&seen(70 * GIB, Some(10)), &m, &o),
            "keep: peak 70.0Gi + 20% margin needs 84.0Gi of the GPU's 80.0Gi",
        ),
        (
            decide_gpu(
                &seen(3 * GIB, Some(5)),
                &t4(),
                &Options {
                    offerings: vec![OfferingKind::Mig],
                    ..opts()
                },
            ),
            "keep: no offering of [Mig] fits",
        ),
    ];
    for (got, want) in cases {
        let r = reason(got);
        assert!(r.starts_with(want), "{r:?} does not start with {want:?}");
    }
}

#[test]
fn advice_never_gives_less_memory_than_the_peak_plus_the_margin() {
    for model in [a100_80(), t4()] {
        for margin in [0, 10, 20, 50] {
            let o = Options { margin, ..opts() };
            let mut peak = 0u64;
            while peak < model.memory_bytes {
                for sm in [None, Some(0), Some(5), Some(20), Some(45)] {
                    let got = decide_gpu(&seen(peak, sm), &model, &o);
                    if let Some(m) = got.memory_bytes() {
                        assert!(
                            m >= memory_needed(peak, margin) && m > peak,
                            "{}: peak {peak} + {margin}% got {got:?}",
                            model.product
                        );
                    }
                }
                peak += 379 * MIB;
            }
        }
    }
    assert_eq!(memory_needed(10 * GIB, 20), 12 * GIB);
    assert_eq!(memory_needed(u64::MAX, 20), u64::MAX);
}

#[test]
fn a_mig_claim_without_sm_figures_keeps_at_least_its_compute() {
    // NVML gives no SM figure on MIG devices: a 3g.40gb using 2 GiB keeps 3 compute slices.
    let got = decide(
        Some(&seen(2 * GIB, None)),
        &a100_80(),
        &Holding::Mig {
            profile: "3g.40gb".into(),
        },
        1,
        &opts(),
    );
    assert!(
        matches!(
            &got,
            Offering::Mig {
                compute_slices: 3,
                ..
            }
        ),
        "{got:?}"
    );
}

fn mig_need(model: &GpuModel, profile: &str) -> Need {
    need_of(
        &Offering::Mig {
            profile: profile.into(),
            memory_bytes: 0,
            compute_slices: 0,
        },
        &Holding::Gpu,
        model,
        0,
    )
}

#[test]
fn packing_respects_mig_placements_compute_and_share_sums() {
    let m = a100_80();
    // Two 2g.20gb and four 1g.10gb: eight memory slices but eight compute slices, one too
    // many for one GPU.
    let mut needs = vec![mig_need(&m, "2g.20gb"), mig_need(&m, "2g.20gb")];
    needs.extend((0..4).map(|_| mig_need(&m, "1g.10gb")));
    assert_eq!(pack(&needs, m.memory_bytes), 2);
    // Seven 1g.10gb fit one GPU, an eighth does not.
    let ones: Vec<Need> = (0..8).map(|_| mig_need(&m, "1g.10gb")).collect();
    assert_eq!(pack(&ones[..7], m.memory_bytes), 1);
    assert_eq!(pack(&ones, m.memory_bytes), 2);
    // 4g.40gb has one placement (0): two need two GPUs though their slices would add up.
    assert_eq!(
        pack(
            &[mig_need(&m, "4g.40gb"), mig_need(&m, "4g.40gb")],
            m.memory_bytes
        ),
        2
    );
    // Shares: memory sums to at most the GPU's, compute to at most 100 %.
    let share = |gib: u64, sm: u32| Need::Share {
        bytes: gib * GIB,
        sm,
    };
    assert_eq!(
        pack(
            &[share(30, 10), share(30, 10), share(30, 10)],
            m.memory_bytes
        ),
        2
    );
    assert_eq!(
        pack(&[share(1, 40), share(1, 40), share(1, 40)], m.memory_bytes),
        2
    );
    // Whole GPUs one each, MIG and shares never on one GPU.
    assert_eq!(
        pack(
            &[Need::Whole, mig_need(&m, "1g.10gb"), share(1, 1)],
            m.memory_bytes
        ),
        3
    );
}

type Models = BTreeMap<(String, String), GpuModel>;
type EvidenceMap = BTreeMap<(String, String, String), Evidence>;

/// The workloads of a typical wasteful node of 4 A100-80GB, one claim per row.
fn rows_and_evidence() -> (Vec<GpuUsage>, Models, EvidenceMap) {
    use crate::usage::Holder;
    let mut rows = Vec::new();
    let mut models = BTreeMap::new();
    let mut ev = BTreeMap::new();
    let claims = [
        ("ns/infer-0", 10 * GIB, 15),
        ("ns/infer-1", 10 * GIB, 15),
        ("ns/nb-0", 3 * GIB, 5),
        ("ns/nb-1", 3 * GIB, 5),
    ];
    for (i, (claim, peak, sm)) in claims.iter().enumerate() {
        let gpu = format!("gpu-{i}");
        rows.push(GpuUsage {
            node: "node-a".into(),
            gpu: format!("GPU-{i}"),
            uuid: format!("GPU-{i}"),
            device: Some(gpu.clone()),
            memory: Some("80Gi".into()),
            holders: vec![Holder {
                claim: (*claim).into(),
                device: gpu.clone(),
                kind: "gpu".into(),
                detail: "whole GPU".into(),
                admin_access: false,
                uuid: None,
                memory_bytes: Some(80 * GIB),
                usage: None,
            }],
        });
        models.insert(("node-a".into(), format!("GPU-{i}")), a100_80());
        ev.insert(
            ("node-a".into(), gpu, (*claim).into()),
            seen(*peak, Some(*sm)),
        );
    }
    (rows, models, ev)
}

#[test]
fn the_fleet_counts_gpus_held_and_needed_and_the_hours_freed() {
    let (rows, models, ev) = rows_and_evidence();
    let (advice, fleet) = advise(&rows, &models, &ev, &BTreeMap::new(), &opts(), &|_, _| true);
    assert_eq!(advice.len(), 4);
    // Two 2g.20gb and two 1g.10gb: six compute slices, one GPU.
    assert_eq!(
        fleet,
        Fleet {
            gpus_held: 4,
            gpus_needed: 1,
            gpu_hours_per_month_freed: 2191.5
        }
    );
    let line = advice_text(&advice[0], 20);
    assert!(
        line.starts_with("ns/infer-0  node-a/gpu-0  NVIDIA A100-SXM4-80GB  holds whole GPU -> MIG 2g.20gb [peak 10.0Gi (+20%), p95 10.0Gi, SM p95 15%, 5760 samples over 1d0h]"),
        "{line}"
    );
    // A namespace filter that selects nothing: nothing held, nothing needed.
    let (none, fleet) = advise(&rows, &models, &ev, &BTreeMap::new(), &opts(), &|c, _| {
        c.starts_with("other/")
    });
    assert!(none.is_empty());
    assert_eq!((fleet.gpus_held, fleet.gpus_needed), (0, 0));
}

#[test]
fn history_series_become_evidence() {
    let l = r#"namespace="ns",claim="nb",claim_namespace="ns",device="gpu-0",pool="node-a",uuid="GPU-0""#;
    let text = format!(
        "gpu_dra_claim_memory_used_peak_bytes{{{l}}} 3221225472\n\
         gpu_dra_claim_memory_used_p95_bytes{{{l}}} 2147483648\n\
         gpu_dra_claim_sm_utilization_p95_percent{{{l}}} 5\n\
         gpu_dra_claim_usage_samples{{{l}}} 400\n\
         gpu_dra_claim_first_sample_timestamp_seconds{{{l}}} 1000\n\
         gpu_dra_claim_last_sample_timestamp_seconds{{{l}}} 7000\n"
    );
    let ev = evidence(&crate::metrics_text::parse(&text, "gpu_dra_claim_"));
    assert_eq!(
        ev.get(&("node-a".into(), "gpu-0".into(), "ns/nb".into())),
        Some(&Evidence {
            peak_used_bytes: 3 * GIB,
            p95_used_bytes: Some(2 * GIB),
            sm_p95_percent: Some(5),
            samples: 400,
            covered_seconds: 6000,
        })
    );
}

fn template() -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"namespace": "ns", "name": "notebook-gpu"},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
            "config": [
                {"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
                    "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing"}}}},
                {"requests": ["gpu"], "opaque": {"driver": "other.example.com", "parameters": {}}}
            ]
        }}}
    })
}

#[test]
fn the_template_change_asks_for_the_advised_device_and_validates() {
    let t = template();
    let spec = t.pointer("/spec/spec").expect("spec");
    let share = apply(
        spec,
        "gpu",
        &Offering::Mps {
            memory_bytes: 4 * GIB,
            active_thread_percentage: 36,
        },
        "mig.nvidia.com",
        "gpu.nvidia.com",
    )
    .expect("changed");
    assert_eq!(
        share.pointer("/devices/requests/0/exactly/capacity/requests/memory"),
        Some(&json!("4Gi"))
    );
    let configs = share["devices"]["config"].as_array().expect("configs");
    assert_eq!(
        configs.len(),
        2,
        "the other driver's config stays: {configs:?}"
    );
    assert_eq!(
        configs[1].pointer("/opaque/parameters/sharing"),
        Some(
            &json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 36, "defaultPinnedDeviceMemoryLimit": "4Gi"}})
        )
    );
    let mig = apply(
        spec,
        "gpu",
        &Offering::Mig {
            profile: "1g.10gb".into(),
            memory_bytes: 9728 * MIB,
            compute_slices: 1,
        },
        "mig.nvidia.com",
        "gpu.nvidia.com",
    )
    .expect("changed");
    assert_eq!(
        mig.pointer("/devices/requests/0/exactly"),
        Some(
            &json!({"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]})
        )
    );
    assert!(
        apply(
            spec,
            "gpu",
            &Offering::Keep {
                reason: String::new()
            },
            "m",
            "gpu.nvidia.com"
        )
        .is_none()
    );
    assert!(
        apply(
            spec,
            "nope",
            &Offering::Share { memory_bytes: GIB },
            "m",
            "gpu.nvidia.com"
        )
        .is_none()
    );

    // What is printed passes the validation the webhook runs.
    for spec in [share, mig] {
        let mut doc = t.clone();
        doc["spec"]["spec"] = spec;
        let mut out = Vec::new();
        let outcome =
            crate::validate_text("advice", &doc.to_string(), "gpu.nvidia.com", true, &mut out)
                .expect("validate");
        assert_eq!(outcome, Outcome::Valid, "{}", String::from_utf8_lossy(&out));
    }
}

#[test]
fn a_generated_claim_names_its_pod_and_pod_claim() {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"namespace": "ns", "name": "nb-0-gpu-x7k2", "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "nb-0", "uid": "u", "controller": true}]},
        "spec": {}
    }))
    .expect("claim");
    assert_eq!(template_of(&claim), Some(("nb-0".into(), "gpu".into())));
    let mut plain = claim.clone();
    plain.metadata.annotations = None;
    assert_eq!(template_of(&plain), None);
}

fn advised(claim: &str, advice: Offering) -> ClaimAdvice {
    ClaimAdvice {
        claim: claim.into(),
        node: "n".into(),
        device: "gpu-0".into(),
        request: "gpu".into(),
        model: "NVIDIA A100-SXM4-80GB".into(),
        holding: Holding::Gpu,
        evidence: None,
        advice,
    }
}

#[test]
fn a_template_gets_the_largest_advice_of_its_claims() {
    let mps = |gib: u64, pct: u32| Offering::Mps {
        memory_bytes: gib * GIB,
        active_thread_percentage: pct,
    };
    let (a, b, c) = (
        advised("ns/a", mps(12, 18)),
        advised("ns/b", mps(14, 16)),
        advised("ns/c", mps(4, 6)),
    );
    // Memory and threads each the largest: no claim gets less than its own advice.
    assert_eq!(merge(&[&c, &a, &b]), Ok(mps(14, 18)));
    let share = |gib: u64| Offering::Share {
        memory_bytes: gib * GIB,
    };
    assert_eq!(
        merge(&[&advised("ns/a", share(4)), &advised("ns/b", share(9))]),
        Ok(share(9))
    );
    let mig = |p: &str, mib: u64, c: u32| Offering::Mig {
        profile: p.into(),
        memory_bytes: mib * MIB,
        compute_slices: c,
    };
    assert_eq!(
        merge(&[
            &advised("ns/a", mig("2g.20gb", 19968, 2)),
            &advised("ns/b", mig("1g.10gb", 9728, 1)),
        ]),
        Ok(mig("2g.20gb", 19968, 2))
    );
    let err = merge(&[
        &advised("ns/a", mig("1g.20gb", 19968, 1)),
        &advised("ns/b", mig("2g.10gb", 10240, 2)),
    ])
    .expect_err("neither holds both");
    assert!(err.contains("neither holds both"), "{err}");
}

#[test]
fn a_template_one_of_whose_claims_keeps_its_gpu_or_differs_is_not_changed() {
    let keep = advised(
        "ns/big",
        Offering::Keep {
            reason: "SM p95 90% is at or above the threshold 50%".into(),
        },
    );
    let small = advised(
        "ns/small",
        Offering::Share {
            memory_bytes: 4 * GIB,
        },
    );
    let err = merge(&[&small, &keep]).expect_err("kept");
    assert!(
        err.contains("ns/big") && err.contains("keeps its GPU") && err.contains("threshold"),
        "{err}"
    );
    let refused = advised(
        "ns/new",
        Offering::Refused {
            reason: "too little history".into(),
        },
    );
    let err = merge(&[&small, &refused]).expect_err("refused");
    assert!(err.contains("ns/new made from it has no advice"), "{err}");
    let timeslice = advised(
        "ns/t",
        Offering::TimeSlicing {
            memory_bytes: 4 * GIB,
        },
    );
    let err = merge(&[&small, &timeslice]).expect_err("kinds differ");
    assert!(err.contains("different offerings"), "{err}");
    assert!(merge(&[]).is_err());
}

#[test]
fn the_yaml_says_how_to_apply_it_and_what_was_left() {
    let doc = template();
    let out = yaml_output(
        std::slice::from_ref(&doc),
        &["ResourceClaimTemplate ns/train not changed: claim ns/x keeps its GPU".into()],
    )
    .expect("yaml");
    // `kubectl apply` of a changed template is refused (its spec is immutable).
    assert!(
        out.starts_with("# gpu-dra advise:")
            && out.contains("kubectl replace --force -f")
            && out.contains("# ResourceClaimTemplate ns/train not changed"),
        "{out}"
    );
    let body = out.split_once("---\n").expect("a document").1;
    let back: Value = serde_saphyr::from_str(body).expect("parses back");
    assert_eq!(back, doc);
    assert!(
        yaml_output(&[], &[])
            .expect("yaml")
            .contains("nothing to change")
    );
}

#[test]
fn json_fields_of_the_advice_are_camel_case_like_the_rest() {
    let v = serde_json::to_value(advised(
        "ns/a",
        Offering::Mps {
            memory_bytes: 4 * GIB,
            active_thread_percentage: 6,
        },
    ))
    .expect("json");
    assert_eq!(
        v["advice"],
        json!({"kind": "mps", "memoryBytes": 4 * GIB, "activeThreadPercentage": 6})
    );
    let held = serde_json::to_value(Holding::Share { bytes: GIB }).expect("json");
    assert_eq!(held, json!({"kind": "share", "bytes": GIB}));
}

/// A slice of node `node` with `devices` (JSON), as the node plugin publishes them.
fn slice_of(node: &str, devices: serde_json::Value) -> ResourceSlice {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{node}-gpu-nvidia-com-0")},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices}
    }))
    .unwrap()
}

fn gpu_device(name: &str, uuid: &str, product: &str, shared: bool) -> serde_json::Value {
    let mut d = serde_json::json!({
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "uuid": {"string": uuid},
                       "productName": {"string": product}},
        "capacity": {"memory": {"value": "80Gi"}}
    });
    if shared {
        d["allowMultipleAllocations"] = serde_json::json!(true);
    }
    d
}

#[test]
fn only_what_the_cluster_offers_for_the_model_is_advised() {
    const A100: &str = "NVIDIA A100-SXM4-80GB";
    let whole_only = [slice_of(
        "node-a",
        serde_json::json!([gpu_device("gpu-0", "GPU-a", A100, false)]),
    )];
    let m = models(&whole_only, "gpu.nvidia.com");
    let model = &m[&("node-a".to_string(), "GPU-a".to_string())];
    assert_eq!(model.offered, Some(BTreeSet::new()));
    // A notebook that MIG or a share would fit: nothing is offered on this model, so the
    // whole GPU stays, and the reason says what the GPUs would need.
    match decide_gpu(&seen(3 * GIB, Some(5)), model, &opts()) {
        Offering::Keep { reason } => {
            assert!(
                reason.contains("does not offer") && reason.contains("MIG mode"),
                "{reason}"
            );
        }
        other => panic!("advised {other:?} on a cluster that offers only whole GPUs"),
    }

    // Another GPU of the model offered as memory shares: shares are advised (MIG still not).
    let with_shares = [
        whole_only[0].clone(),
        slice_of(
            "node-b",
            serde_json::json!([gpu_device("gpu-0", "GPU-b", A100, true)]),
        ),
    ];
    let m = models(&with_shares, "gpu.nvidia.com");
    let model = &m[&("node-a".to_string(), "GPU-a".to_string())];
    // (4 GiB of 80 is 5 % of the threads, under the 6 % needed: MPS with its own percentage.)
    assert_eq!(
        decide_gpu(&seen(3 * GIB, Some(5)), model, &opts()),
        Offering::Mps {
            memory_bytes: 4 * GIB,
            active_thread_percentage: 6
        }
    );

    // A MIG device of the model published anywhere: MIG is advised first again.
    let mut with_mig = with_shares.to_vec();
    with_mig.push(slice_of(
        "node-c",
        serde_json::json!([{"name": "gpu-0-mig-1g10gb-19-0", "attributes": {
            "type": {"string": "mig"}, "productName": {"string": A100},
            "uuid": {"string": "MIG-c"}}}]),
    ));
    let m = models(&with_mig, "gpu.nvidia.com");
    let model = &m[&("node-a".to_string(), "GPU-a".to_string())];
    assert!(matches!(
        decide_gpu(&seen(3 * GIB, Some(5)), model, &opts()),
        Offering::Mig { .. }
    ));
}
