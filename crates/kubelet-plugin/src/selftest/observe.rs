//! What the self-test reads, as plain data: `nvidia-smi -L` and `--query-gpu` output, the CUDA
//! probe's JSON report; and the pure judgements over them (does a container see exactly its
//! claim's device, does an MPS client get its limits). No I/O here, so every judgement is
//! tested with fixtures of the real tools' output.

use serde::Deserialize;

/// One line of `nvidia-smi -L`: a GPU or a MIG device under the GPU listed before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listed {
    /// `GPU <i>: <name> (UUID: GPU-...)`.
    Gpu {
        /// The UUID, with its `GPU-` prefix.
        uuid: String,
    },
    /// `  MIG <profile> Device <n>: (UUID: MIG-...)`.
    Mig {
        /// The UUID, with its `MIG-` prefix.
        uuid: String,
    },
}

/// Parses `nvidia-smi -L` (lines that are neither GPUs nor MIG devices, such as the "Unable to
/// determine the device handle" line of a lost GPU, are left out).
pub fn parse_list(out: &str) -> Vec<Listed> {
    out.lines()
        .filter_map(|line| {
            let uuid = line
                .rsplit_once("(UUID: ")
                .map(|(_, rest)| rest.trim_end().trim_end_matches(')').to_string())?;
            let trimmed = line.trim_start();
            if trimmed.starts_with("GPU ") {
                Some(Listed::Gpu { uuid })
            } else if trimmed.starts_with("MIG ") {
                Some(Listed::Mig { uuid })
            } else {
                None
            }
        })
        .collect()
}

/// Whether a container's `nvidia-smi -L` shows exactly the claim's device `uuid`: for a GPU,
/// that one GPU and no MIG device; for a MIG device (`MIG-...`), that one MIG device (under
/// its parent GPU, which the tool always lists). `Err` says what was seen instead.
pub fn lists_exactly(listed: &[Listed], uuid: &str) -> Result<(), String> {
    let gpus: Vec<&str> = listed
        .iter()
        .filter_map(|l| match l {
            Listed::Gpu { uuid } => Some(uuid.as_str()),
            Listed::Mig { .. } => None,
        })
        .collect();
    let migs: Vec<&str> = listed
        .iter()
        .filter_map(|l| match l {
            Listed::Mig { uuid } => Some(uuid.as_str()),
            Listed::Gpu { .. } => None,
        })
        .collect();
    let ok = if uuid.starts_with("MIG-") {
        migs == [uuid] && gpus.len() == 1
    } else {
        gpus == [uuid] && migs.is_empty()
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "expected only {uuid}, saw GPUs [{}] and MIG devices [{}]",
            gpus.join(", "),
            migs.join(", ")
        ))
    }
}

/// One GPU as `nvidia-smi --query-gpu=index,uuid,name,driver_version,compute_mode,
/// mig.mode.current --format=csv,noheader` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmiGpu {
    /// NVML index.
    pub index: u32,
    /// `GPU-...`.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Driver version.
    pub driver_version: String,
    /// `Default`, `Exclusive_Process`, `Prohibited`.
    pub compute_mode: String,
    /// `Enabled`, `Disabled` or `[N/A]`.
    pub mig_mode: String,
}

/// The `--query-gpu` fields [`parse_query`] reads, in its order.
pub const QUERY_FIELDS: &str = "index,uuid,name,driver_version,compute_mode,mig.mode.current";

/// Parses the CSV lines of [`QUERY_FIELDS`]; a line of another shape is an error naming it.
pub fn parse_query(out: &str) -> Result<Vec<SmiGpu>, String> {
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            match f.as_slice() {
                [index, uuid, name, driver, mode, mig] => Ok(SmiGpu {
                    index: index
                        .parse()
                        .map_err(|_| format!("not an index in {line:?}"))?,
                    uuid: (*uuid).to_string(),
                    name: (*name).to_string(),
                    driver_version: (*driver).to_string(),
                    compute_mode: (*mode).to_string(),
                    mig_mode: (*mig).to_string(),
                }),
                _ => Err(format!("unexpected line {line:?}")),
            }
        })
        .collect()
}

/// Parses `nvidia-smi -q -x` (the XML report, `nvsmi_device_v*.dtd`) into the same facts as
/// [`parse_query`]: per `<gpu>`, its `<product_name>`, `<uuid>`, `<compute_mode>` and
/// `<mig_mode><current_mig>`, with the report's `<driver_version>`. Only elements directly at
/// those paths count (a MIG device's own `<uuid>` deeper down does not). Enough XML for the
/// tool's output: tags, text, `<?...?>` and `<!...>`; no entities beyond the five predefined.
pub fn parse_q_xml(xml: &str) -> Result<Vec<SmiGpu>, String> {
    let mut path: Vec<&str> = Vec::new();
    let mut driver = String::new();
    let mut gpus: Vec<SmiGpu> = Vec::new();
    let mut rest = xml;
    while let Some(open) = rest.find('<') {
        let text = &rest[..open];
        let after = &rest[open + 1..];
        let close = after
            .find('>')
            .ok_or_else(|| "unterminated tag in nvidia-smi's XML".to_string())?;
        let tag = &after[..close];
        rest = &after[close + 1..];
        let value = || {
            text.trim()
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&quot;", "\"")
                .replace("&apos;", "'")
                .replace("&amp;", "&")
        };
        if let Some(name) = tag.strip_prefix('/') {
            if path.last() != Some(&name.trim()) {
                return Err(format!("nvidia-smi's XML closes <{name}> out of order"));
            }
            let here = path.join("/");
            let gpu = gpus.last_mut();
            match (here.as_str(), gpu) {
                ("nvidia_smi_log/driver_version", _) => driver = value(),
                ("nvidia_smi_log/gpu/product_name", Some(g)) => g.name = value(),
                ("nvidia_smi_log/gpu/uuid", Some(g)) => g.uuid = value(),
                ("nvidia_smi_log/gpu/compute_mode", Some(g)) => g.compute_mode = value(),
                ("nvidia_smi_log/gpu/mig_mode/current_mig", Some(g)) => g.mig_mode = value(),
                _ => {}
            }
            path.pop();
        } else if tag.starts_with('?') || tag.starts_with('!') || tag.ends_with('/') {
            // Declarations, comments and empty elements carry nothing read here.
        } else {
            let name = tag.split_whitespace().next().unwrap_or_default();
            path.push(name);
            if path == ["nvidia_smi_log", "gpu"] {
                gpus.push(SmiGpu {
                    index: u32::try_from(gpus.len()).unwrap_or(u32::MAX),
                    uuid: String::new(),
                    name: String::new(),
                    driver_version: String::new(),
                    compute_mode: String::new(),
                    mig_mode: String::new(),
                });
            }
        }
    }
    if !path.is_empty() {
        return Err(format!("nvidia-smi's XML ends inside <{}>", path.join("/")));
    }
    for g in &mut gpus {
        g.driver_version.clone_from(&driver);
        if g.uuid.is_empty() {
            return Err("a <gpu> of nvidia-smi's XML has no <uuid>".into());
        }
    }
    Ok(gpus)
}

/// One device as the CUDA probe saw it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ProbeDevice {
    /// CUDA's index.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// The 16 UUID bytes as `8-4-4-4-12` hex, without prefix.
    pub uuid: String,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
    pub sm_count: u32,
}

/// The kernel run of the probe.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ProbeKernel {
    /// Elements computed.
    pub elements: u64,
    /// Launched and every element verified.
    pub ok: bool,
    /// Elements with a wrong result.
    #[serde(default)]
    pub mismatches: u64,
}

/// The probe's extra allocation (`--alloc-bytes`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ProbeAlloc {
    /// Size asked.
    pub bytes: u64,
    /// Whether `cuMemAlloc` succeeded.
    pub ok: bool,
    /// CUDA's error name when it did not.
    #[serde(default)]
    pub error: Option<String>,
}

/// The probe's report (one JSON object on its stdout).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ProbeReport {
    /// `cuDriverGetVersion`.
    #[serde(default)]
    pub driver_version: Option<u32>,
    /// Devices CUDA enumerated.
    #[serde(default)]
    pub devices: Vec<ProbeDevice>,
    /// The kernel run, when it got that far.
    #[serde(default)]
    pub kernel: Option<ProbeKernel>,
    /// The extra allocation, when asked.
    #[serde(default)]
    pub alloc: Option<ProbeAlloc>,
    /// The first failure (call and CUDA error name, or the loader's message).
    #[serde(default)]
    pub error: Option<String>,
}

/// Parses the probe's stdout: the last line that is a JSON object (a loader may print before).
pub fn parse_probe(stdout: &str) -> Result<ProbeReport, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| "the probe printed no report".to_string())?;
    serde_json::from_str(line).map_err(|e| format!("the probe's report does not parse: {e}"))
}

/// A device UUID without its `GPU-`/`MIG-` prefix, lower case: how CUDA's 16 bytes print.
pub fn bare_uuid(uuid: &str) -> String {
    uuid.trim_start_matches("GPU-")
        .trim_start_matches("MIG-")
        .to_ascii_lowercase()
}

/// Whether the probe ran its kernel on exactly the claim's device `uuid`.
pub fn probe_saw_exactly(report: &ProbeReport, uuid: &str) -> Result<(), String> {
    if let Some(error) = &report.error {
        return Err(error.clone());
    }
    let seen: Vec<String> = report
        .devices
        .iter()
        .map(|d| d.uuid.to_ascii_lowercase())
        .collect();
    if seen != [bare_uuid(uuid)] {
        return Err(format!(
            "CUDA enumerated [{}], expected only {uuid}",
            seen.join(", ")
        ));
    }
    match &report.kernel {
        Some(k) if k.ok => Ok(()),
        Some(k) => Err(format!(
            "the kernel computed {} of {} elements wrong",
            k.mismatches, k.elements
        )),
        None => Err("the kernel did not run".into()),
    }
}

/// The SM count an MPS client with `percentage` of the threads is expected to see on a GPU of
/// `full` SMs, as a range: MPS provisions whole TPCs (2 SMs on every architecture MPS limits
/// apply to), so the count is `full * percentage / 100` rounded to a TPC either way.
pub fn mps_sm_range(full: u32, percentage: u32) -> (u32, u32) {
    let exact = u64::from(full) * u64::from(percentage);
    let low = exact / 100;
    let high = exact.div_ceil(100);
    (
        u32::try_from(low.saturating_sub(2)).unwrap_or(0).max(1),
        u32::try_from(high + 2).unwrap_or(u32::MAX).min(full),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST_MIG: &str = "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5c3a0b1e-0000-0000-0000-000000000000)\n  MIG 1g.5gb      Device  0: (UUID: MIG-0f0e0d0c-0000-0000-0000-000000000000)\n";

    #[test]
    fn list_parses_gpus_and_mig_devices() {
        assert_eq!(
            parse_list(LIST_MIG),
            [
                Listed::Gpu {
                    uuid: "GPU-5c3a0b1e-0000-0000-0000-000000000000".into()
                },
                Listed::Mig {
                    uuid: "MIG-0f0e0d0c-0000-0000-0000-000000000000".into()
                }
            ]
        );
    }

    #[test]
    fn exactly_one_device_is_judged_per_kind() {
        let listed = parse_list(LIST_MIG);
        assert!(lists_exactly(&listed, "MIG-0f0e0d0c-0000-0000-0000-000000000000").is_ok());
        // A MIG device's container that shows the parent's other MIG devices does not pass.
        let mut more = listed.clone();
        more.push(Listed::Mig {
            uuid: "MIG-other".into(),
        });
        assert!(lists_exactly(&more, "MIG-0f0e0d0c-0000-0000-0000-000000000000").is_err());
        // A whole GPU's container must not show MIG devices, nor other GPUs.
        assert!(lists_exactly(&listed, "GPU-5c3a0b1e-0000-0000-0000-000000000000").is_err());
        let two = parse_list("GPU 0: A (UUID: GPU-a)\nGPU 1: A (UUID: GPU-b)\n");
        let err = lists_exactly(&two, "GPU-a").expect_err("two GPUs");
        assert!(err.contains("GPU-a, GPU-b"), "{err}");
        assert!(lists_exactly(&two[..1], "GPU-a").is_ok());
    }

    #[test]
    fn query_lines_parse_and_bad_ones_are_named() {
        let gpus = parse_query(
            "0, GPU-a, NVIDIA H100 80GB HBM3, 580.95.05, Default, Disabled\n1, GPU-b, NVIDIA H100 80GB HBM3, 580.95.05, Exclusive_Process, [N/A]\n",
        )
        .expect("parses");
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[1].compute_mode, "Exclusive_Process");
        assert!(
            parse_query("0, GPU-a\n")
                .expect_err("short")
                .contains("GPU-a")
        );
    }

    #[test]
    fn q_xml_of_a_real_host_parses_to_the_query_facts() {
        let gpus = parse_q_xml(include_str!(
            "../../tests/testdata/h100-580-nvidia-smi-q.xml"
        ))
        .expect("the real report parses");
        assert_eq!(
            gpus,
            [SmiGpu {
                index: 0,
                uuid: "GPU-bd649d6e-5694-b281-b88a-cbeae76206e5".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
                driver_version: "580.159.04".into(),
                compute_mode: "Default".into(),
                mig_mode: "Disabled".into(),
            }]
        );
        // A MIG device's UUID deeper in the GPU is not the GPU's.
        let nested = "<nvidia_smi_log><driver_version>1</driver_version><gpu id=\"a\"><uuid>GPU-a</uuid><mig_devices><mig_device><uuid>MIG-b</uuid></mig_device></mig_devices><mig_mode><current_mig>Enabled</current_mig></mig_mode></gpu></nvidia_smi_log>";
        let gpus = parse_q_xml(nested).expect("parses");
        assert_eq!(
            (gpus[0].uuid.as_str(), gpus[0].mig_mode.as_str()),
            ("GPU-a", "Enabled")
        );
        assert!(parse_q_xml("<nvidia_smi_log><gpu>").is_err());
        assert!(parse_q_xml("<a></b>").is_err());
    }

    #[test]
    fn probe_report_is_judged_on_devices_and_kernel() {
        let report = parse_probe(
            r#"{"driver_version":12080,"devices":[{"index":0,"name":"H100","uuid":"5C3A0B1E-0000-0000-0000-000000000000","total_memory":1,"sm_count":132}],"kernel":{"device":0,"elements":4096,"ok":true,"mismatches":0},"error":null}"#,
        )
        .expect("parses");
        assert!(probe_saw_exactly(&report, "GPU-5c3a0b1e-0000-0000-0000-000000000000").is_ok());
        assert!(probe_saw_exactly(&report, "GPU-other").is_err());
        let mut wrong = report.clone();
        wrong.kernel = Some(ProbeKernel {
            elements: 4096,
            ok: false,
            mismatches: 7,
        });
        assert!(
            probe_saw_exactly(&wrong, "GPU-5c3a0b1e-0000-0000-0000-000000000000")
                .expect_err("wrong results")
                .contains("7 of 4096")
        );
        let failed = parse_probe(
            "warning\n{\"devices\":[],\"error\":\"dlopen libcuda.so.1: libcuda.so.1: cannot open shared object file\"}\n",
        )
        .expect("parses");
        assert!(
            probe_saw_exactly(&failed, "GPU-a")
                .expect_err("no libcuda")
                .contains("libcuda.so.1")
        );
        assert!(parse_probe("Segmentation fault\n").is_err());
    }

    #[test]
    fn mps_sm_range_brackets_the_share() {
        assert_eq!(mps_sm_range(132, 50), (64, 68));
        assert_eq!(mps_sm_range(40, 25), (8, 12));
        // Never above the whole GPU, never zero.
        assert_eq!(mps_sm_range(4, 100), (2, 4));
        assert_eq!(mps_sm_range(2, 1), (1, 2));
    }
}
