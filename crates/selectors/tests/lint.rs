//! The selector lint on selectors users write: each bad one gets exactly its pinned finding,
//! and good ones (including every selector in NVIDIA's documentation that works with both
//! drivers) get none.

use gpu_dra_core::slices::DeviceKind;
use gpu_dra_selectors::{Finding, Severity, Target, lint_expression};

const DRIVER: &str = "gpu.nvidia.com";

fn gpu_class() -> Target<'static> {
    Target {
        driver: DRIVER,
        kinds: &[DeviceKind::Gpu],
        class: Some("gpu.nvidia.com"),
    }
}

fn mig_class() -> Target<'static> {
    Target {
        driver: DRIVER,
        kinds: &[DeviceKind::Mig],
        class: Some("mig.nvidia.com"),
    }
}

fn lint(expr: &str, target: Target<'_>) -> Vec<(Severity, String)> {
    lint_expression(expr, &target)
        .into_iter()
        .map(|Finding { severity, message }| (severity, message))
        .collect()
}

#[test]
fn good_selectors_have_no_findings() {
    for expr in [
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
        "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-SXM4-40GB'",
        "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA A100')",
        "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('575.0.0')) >= 0",
        "device.attributes['gpu.nvidia.com'].cudaComputeCapability.isGreaterThan(semver('7.5.0'))",
        "device.attributes['gpu.nvidia.com'].cudaComputeCapability.major() >= 8",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
        "device.attributes['resource.kubernetes.io'].numaNode == 0",
        "'addressingMode' in device.attributes['gpu.nvidia.com'] && device.attributes['gpu.nvidia.com'].addressingMode == 'HMM'",
        "device.attributes['gpu.nvidia.com'].architecture in ['Ampere', 'Hopper']",
        "size(device.attributes['gpu.nvidia.com'].uuid) > 0",
        "unknownVariable == 3",
    ] {
        assert_eq!(lint(expr, gpu_class()), vec![], "{expr}");
    }
    for expr in [
        "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'",
        "device.capacity['gpu.nvidia.com'].multiprocessors.compareTo(quantity('14')) >= 0",
        "device.capacity['gpu.nvidia.com'].memorySlice0.compareTo(quantity('1')) == 0",
    ] {
        assert_eq!(lint(expr, mig_class()), vec![], "{expr}");
    }
}

#[test]
fn nvidia_quickstart_index_selector_is_flagged_with_a_hint() {
    let f = lint(
        "device.attributes['gpu.nvidia.com'].index == 0",
        gpu_class(),
    );
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].0, Severity::Warning);
    assert_eq!(
        f[0].1,
        "`device.attributes['gpu.nvidia.com'].index`: attribute \"index\" is not published by \
         gpu.nvidia.com, so evaluating it fails with \"no such key: index\" on every \
         gpu.nvidia.com device and none is selected; GPU indexes are not published by either \
         driver (NVML's enumeration order is not stable across reboots); to get several GPUs \
         set `count` on the request, to pick one select on `uuid`, `productName` or \
         `resource.kubernetes.io/pciBusID`"
    );
}

#[test]
fn each_bad_selector_gets_its_pinned_finding() {
    let cases: &[(&str, Target<'static>, Severity, &str)] = &[
        (
            "device.attributes['gpu.nvidia.com'].productname == 'x'",
            gpu_class(),
            Severity::Warning,
            "`device.attributes['gpu.nvidia.com'].productname`: attribute \"productname\" is not \
             published by gpu.nvidia.com, so evaluating it fails with \"no such key: productname\" \
             on every gpu.nvidia.com device and none is selected; did you mean \"productName\"?",
        ),
        (
            "device.capacity['gpu.nvidia.com'].memroy.compareTo(quantity('1Gi')) > 0",
            gpu_class(),
            Severity::Warning,
            "`device.capacity['gpu.nvidia.com'].memroy`: capacity \"memroy\" is not published by \
             gpu.nvidia.com, so evaluating it fails with \"no such key: memroy\" on every \
             gpu.nvidia.com device and none is selected; did you mean \"memory\"?",
        ),
        (
            "device.attributes['gpu.nvidia.com'].memory > 1000",
            gpu_class(),
            Severity::Warning,
            "`device.attributes['gpu.nvidia.com'].memory`: attribute \"memory\" is not published \
             by gpu.nvidia.com, so evaluating it fails with \"no such key: memory\" on every \
             gpu.nvidia.com device and none is selected; memory is a capacity: \
             device.capacity['gpu.nvidia.com'].memory, a quantity: compare it with quantity(...)",
        ),
        (
            "device.attributes['gpu.nvidia.com'].productName == 80",
            gpu_class(),
            Severity::Warning,
            "`device.attributes['gpu.nvidia.com'].productName == 80`: attribute productName is a \
             string, compared here with an int; no device can match",
        ),
        (
            "device.attributes['resource.kubernetes.io'].numaNode == '0'",
            gpu_class(),
            Severity::Warning,
            "`device.attributes['resource.kubernetes.io'].numaNode == '0'`: attribute numaNode is \
             an int, compared here with a string; no device can match",
        ),
        (
            "device.capacity['gpu.nvidia.com'].memory >= 42949672960",
            gpu_class(),
            Severity::Warning,
            "`device.capacity['gpu.nvidia.com'].memory >= 42949672960`: capacity memory is a \
             quantity, compared here with an int, which fails at evaluation; write \
             `device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('42949672960')) >= 0`",
        ),
        (
            "device.capacity['gpu.nvidia.com'].memory.compareTo('40Gi') >= 0",
            gpu_class(),
            Severity::Warning,
            "`device.capacity['gpu.nvidia.com'].memory.compareTo('40Gi')`: capacity memory is a \
             quantity: compare it with a quantity, \
             `device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi'))`",
        ),
        (
            "device.attributes['gpu.nvidia.com'].driverVersion >= '575.0.0'",
            gpu_class(),
            Severity::Warning,
            "`device.attributes['gpu.nvidia.com'].driverVersion >= '575.0.0'`: attribute \
             driverVersion is a version, compared here with a string, which fails at evaluation; \
             write `device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('575.0.0')) >= 0`",
        ),
        (
            "device.attributes['gpu.nvidia.com'].driverVersion.startsWith('580')",
            gpu_class(),
            Severity::Warning,
            "`device.attributes['gpu.nvidia.com'].driverVersion.startsWith('580')`: attribute \
             driverVersion is a version, not a string: startsWith() fails at evaluation; compare \
             versions with compareTo(semver('...'))",
        ),
        (
            "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('575')) >= 0",
            gpu_class(),
            Severity::Warning,
            "`semver('575')` fails at evaluation: \"575\" is not a semantic version: semver() \
             needs major.minor.patch, e.g. '1.2.3'",
        ),
        (
            "device.attributes['example.com'].model == 'x'",
            gpu_class(),
            Severity::Info,
            "`device.attributes['example.com']`: gpu.nvidia.com devices have no attributes in \
             domain \"example.com\" (theirs are under \"gpu.nvidia.com\" and \
             \"resource.kubernetes.io\"); fine if DeviceClass gpu.nvidia.com selects whole GPUs \
             also selects another driver's devices",
        ),
        (
            "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'",
            gpu_class(),
            Severity::Warning,
            "`device.attributes['gpu.nvidia.com'].profile`: attribute \"profile\" is published \
             only on MIG devices, but DeviceClass gpu.nvidia.com selects whole GPUs; no device \
             can match",
        ),
        (
            "device.capacity['gpu.nvidia.com'].multiprocessors.compareTo(quantity('14')) >= 0",
            gpu_class(),
            Severity::Warning,
            "`device.capacity['gpu.nvidia.com'].multiprocessors`: capacity \"multiprocessors\" is \
             published only on MIG devices, but DeviceClass gpu.nvidia.com selects whole GPUs; \
             no device can match",
        ),
        (
            "device.attributes['gpu.nvidia.com'].type == 'gpu' &&",
            gpu_class(),
            Severity::Warning,
            "does not parse: line 1, column 53: Syntax error: mismatched input '<EOF>' expecting \
             {'[', '{', '(', '.', '-', '!', 'true', 'false', 'null', NUM_FLOAT, NUM_INT, NUM_UINT, \
             STRING, BYTES, IDENTIFIER}",
        ),
    ];
    for (expr, target, severity, message) in cases {
        let got = lint(expr, *target);
        assert_eq!(got, vec![(*severity, (*message).to_owned())], "{expr}");
    }
}
