//! `nvidia-smi --query-gpu`, `-q` and the plain summary: what the tool reports about the
//! GPUs, in its formats (CSV with the real field names and units, the `-q` key-value layout).

use std::io::Write;

use super::{EXIT_GPU_LOST, EXIT_INVALID, EXIT_OK, lost_line};
use crate::state::State;

/// The `--query-gpu` fields the stand-in answers, with the header name each prints.
const QUERY_FIELDS: &[(&str, &str)] = &[
    ("index", "index"),
    ("uuid", "uuid"),
    ("gpu_uuid", "uuid"),
    ("name", "name"),
    ("gpu_name", "name"),
    ("pci.bus_id", "pci.bus_id"),
    ("gpu_bus_id", "pci.bus_id"),
    ("serial", "serial"),
    ("gpu_serial", "serial"),
    ("count", "count"),
    ("driver_version", "driver_version"),
    ("memory.total", "memory.total"),
    ("compute_mode", "compute_mode"),
    ("mig.mode.current", "mig.mode.current"),
    ("mig.mode.pending", "mig.mode.pending"),
    ("persistence_mode", "persistence_mode"),
];

/// `--query-gpu=<fields> --format=csv[,noheader][,nounits]`: one CSV line per target GPU.
pub(super) fn query_gpu(
    state: &State,
    targets: &[usize],
    fields: &str,
    format: Option<&str>,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let Some(format) = format else {
        writeln!(
            out,
            "\"--format=\" switch is missing. Please run 'nvidia-smi -h' for help."
        )?;
        return Ok(EXIT_INVALID);
    };
    let mut csv = false;
    let mut header = true;
    let mut units = true;
    for f in format.split(',').map(str::trim) {
        match f {
            "csv" => csv = true,
            "noheader" => header = false,
            "nounits" => units = false,
            _ => {
                writeln!(out, "\"{f}\" is not a valid format option.")?;
                return Ok(EXIT_INVALID);
            }
        }
    }
    if !csv {
        writeln!(out, "\"csv\" is missing in the --format switch.")?;
        return Ok(EXIT_INVALID);
    }
    let mut cols = Vec::new();
    for f in fields.split(',').map(str::trim) {
        match QUERY_FIELDS.iter().find(|(n, _)| *n == f) {
            Some((_, canon)) => cols.push((f, *canon)),
            None => {
                writeln!(out, "Field \"{f}\" is not a valid field to query.")?;
                return Ok(EXIT_INVALID);
            }
        }
    }
    if header {
        let names: Vec<String> = cols
            .iter()
            .map(|(f, c)| match *c {
                "memory.total" => format!("{f} [MiB]"),
                _ => (*f).to_string(),
            })
            .collect();
        writeln!(out, "{}", names.join(", "))?;
    }
    for &i in targets {
        let g = &state.profile.gpus[i];
        let s = &state.gpus[i];
        let mig = g.mig_profiles().is_some();
        let on_off = |b: bool| if b { "Enabled" } else { "Disabled" };
        let vals: Vec<String> = cols
            .iter()
            .map(|(_, c)| match *c {
                "index" => i.to_string(),
                "uuid" => g.uuid.clone(),
                "name" => g.name.clone(),
                "pci.bus_id" => g.pci().long(),
                "serial" => g.serial.clone().unwrap_or_else(|| "[N/A]".into()),
                "count" => state.gpus.len().to_string(),
                "driver_version" => state.profile.driver_version.clone(),
                "memory.total" if units => format!("{} MiB", g.memory_mib),
                "memory.total" => g.memory_mib.to_string(),
                "compute_mode" => s.compute_mode.query_name().to_string(),
                "mig.mode.current" if mig => on_off(s.mig_current).to_string(),
                "mig.mode.pending" if mig => on_off(s.mig_pending).to_string(),
                "persistence_mode" => on_off(s.persistence).to_string(),
                _ => "[N/A]".to_string(),
            })
            .collect();
        writeln!(out, "{}", vals.join(", "))?;
    }
    Ok(EXIT_OK)
}

/// The summary printed without options, and the longer one of `-q` (`detailed`).
pub(super) fn summary(
    state: &State,
    targets: &[usize],
    detailed: bool,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let lost: Vec<usize> = targets
        .iter()
        .copied()
        .filter(|i| state.gpus[*i].health.lost)
        .collect();
    if !lost.is_empty() {
        for i in lost {
            writeln!(out, "{}", lost_line(state, i))?;
        }
        return Ok(EXIT_GPU_LOST);
    }
    let p = &state.profile;
    let cuda = format!(
        "{}.{}",
        p.cuda_driver_version / 1000,
        p.cuda_driver_version % 1000 / 10
    );
    if !detailed {
        writeln!(
            out,
            "+-----------------------------------------------------------------------------------------+"
        )?;
        writeln!(
            out,
            "| NVIDIA-SMI {:<17} Driver Version: {:<14} CUDA Version: {:<9}|",
            p.driver_version, p.driver_version, cuda
        )?;
        writeln!(
            out,
            "+-----------------------------------------------------------------------------------------+"
        )?;
        for &i in targets {
            let g = &p.gpus[i];
            let s = &state.gpus[i];
            writeln!(
                out,
                "| {i:>3}  {:<32} {:<16} {:>8}MiB  {:<17}|",
                g.name,
                g.pci().long(),
                g.memory_mib,
                s.compute_mode.query_name()
            )?;
        }
        writeln!(
            out,
            "+-----------------------------------------------------------------------------------------+"
        )?;
        return Ok(EXIT_OK);
    }
    writeln!(out, "\n==============NVSMI LOG==============\n")?;
    writeln!(out, "{:<42}: {}", "Driver Version", p.driver_version)?;
    writeln!(out, "{:<42}: {cuda}\n", "CUDA Version")?;
    writeln!(out, "{:<42}: {}", "Attached GPUs", p.gpus.len())?;
    for &i in targets {
        let g = &p.gpus[i];
        let s = &state.gpus[i];
        let kv = |k: &str, v: &str| format!("    {k:<38}: {v}");
        writeln!(out, "GPU {}", g.pci().long())?;
        writeln!(out, "{}", kv("Product Name", &g.name))?;
        writeln!(out, "{}", kv("Product Brand", &g.brand))?;
        writeln!(out, "{}", kv("Product Architecture", &g.architecture))?;
        writeln!(
            out,
            "{}",
            kv(
                "Persistence Mode",
                if s.persistence { "Enabled" } else { "Disabled" }
            )
        )?;
        writeln!(out, "    MIG Mode")?;
        let mig = |b: bool| {
            if g.mig_table.is_none() {
                "N/A"
            } else if b {
                "Enabled"
            } else {
                "Disabled"
            }
        };
        writeln!(out, "        {:<34}: {}", "Current", mig(s.mig_current))?;
        writeln!(out, "        {:<34}: {}", "Pending", mig(s.mig_pending))?;
        writeln!(
            out,
            "{}",
            kv("Serial Number", g.serial.as_deref().unwrap_or("N/A"))
        )?;
        writeln!(out, "{}", kv("GPU UUID", &g.uuid))?;
        writeln!(out, "{}", kv("Minor Number", &g.minor.to_string()))?;
        writeln!(out, "    FB Memory Usage")?;
        writeln!(out, "        {:<34}: {} MiB", "Total", g.memory_mib)?;
        writeln!(out, "{}", kv("Compute Mode", s.compute_mode.query_name()))?;
    }
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::super::EXIT_INVALID;
    use super::super::tests::{host, smi};

    #[test]
    fn query_gpu_csv_with_and_without_units() {
        let h = host("dgx-a100-40gb");
        let (code, out) = smi(
            &h,
            "-i 0,5 --query-gpu=index,pci.bus_id,memory.total,compute_mode,mig.mode.current --format=csv",
        );
        assert_eq!(code, 0);
        assert_eq!(
            out,
            "index, pci.bus_id, memory.total [MiB], compute_mode, mig.mode.current\n\
             0, 00000000:07:00.0, 40960 MiB, Default, Enabled\n\
             5, 00000000:90:00.0, 40960 MiB, Default, Disabled\n"
        );
        let (_, out) = smi(
            &h,
            "-i 7 --query-gpu=memory.total,name --format=csv,noheader,nounits",
        );
        assert_eq!(out, "40960, NVIDIA A100-SXM4-40GB\n");
        let (code, out) = smi(&h, "--query-gpu=bogus --format=csv");
        assert_eq!(code, EXIT_INVALID);
        assert_eq!(out, "Field \"bogus\" is not a valid field to query.\n");
        let (code, out) = smi(&h, "--query-gpu=index");
        assert_eq!(code, EXIT_INVALID);
        assert!(out.starts_with("\"--format=\" switch is missing."));
        let t4 = host("t4");
        let (_, out) = smi(&t4, "--query-gpu=mig.mode.current --format=csv,noheader");
        assert_eq!(out, "[N/A]\n");
    }
}
