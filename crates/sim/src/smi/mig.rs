//! `nvidia-smi -mig` and `nvidia-smi mig`: MIG mode and GPU/compute instances, so tests and
//! demos can change a simulated node's MIG layout the way an operator changes a real one.
//!
//! The stand-in creates only full-size compute instances (`-cgi … -C`, `-cci` without a
//! profile; smaller ones come through NVML). The rules are the state's
//! ([`State::create_gpu_instance`] and friends), shared with the NVML exports, and after every
//! change the capability files under `proc/` and `dev/nvidia-caps/` of the simulated root are
//! brought in line with the new layout.

use std::io::Write;

use super::{EXIT_INVALID, EXIT_NOT_FOUND, EXIT_NOT_SUPPORTED, EXIT_OK, EXIT_OTHER};
use super::{INVALID_COMBINATION, no_driver, resolve_ids, switch_value};
use crate::mig as tables;
use crate::state::{MigError, State, StateFile};

/// Applies `f` under the state lock, with the capability files brought in line
/// ([`crate::setup::change_mig_layout`]); `None` when the state cannot be changed.
fn change<T>(file: &StateFile, f: impl FnOnce(&mut State) -> T) -> Option<T> {
    match crate::setup::change_mig_layout(file, |s| Ok::<T, std::convert::Infallible>(f(s))).ok()? {
        Ok(v) => Some(v),
        Err(never) => match never {},
    }
}

fn exit_for(e: &MigError) -> i32 {
    match e {
        MigError::NotCapable | MigError::NotEnabled => EXIT_NOT_SUPPORTED,
        MigError::NotFound => EXIT_NOT_FOUND,
        MigError::UnknownProfile | MigError::BadPlacement => EXIT_INVALID,
        MigError::Insufficient | MigError::InUse => EXIT_OTHER,
    }
}

/// `nvidia-smi [-i ids] -mig 0|1`.
pub(super) fn set_mode(
    file: &StateFile,
    targets: &[usize],
    value: &str,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let Some(on) = switch_value(value) else {
        writeln!(out, "{INVALID_COMBINATION}")?;
        return Ok(EXIT_INVALID);
    };
    let (verb, word) = if on {
        ("enable", "Enabled")
    } else {
        ("disable", "Disabled")
    };
    let Some(results) = change(file, |s| {
        targets
            .iter()
            .map(|&i| (s.profile.gpus[i].pci().long(), s.set_mig_mode(i, on)))
            .collect::<Vec<_>>()
    }) else {
        return no_driver(out);
    };
    let mut code = EXIT_OK;
    for (bus, r) in results {
        match r {
            Ok(()) => writeln!(out, "{word} MIG Mode for GPU {bus}")?,
            Err(e) => {
                writeln!(out, "Unable to {verb} MIG Mode for GPU {bus}: {e}")?;
                code = exit_for(&e);
            }
        }
    }
    if code == EXIT_OK {
        writeln!(out, "All done.")?;
    }
    Ok(code)
}

#[derive(Default)]
struct MigOpts {
    id: Option<String>,
    gi: Option<String>,
    ci: Option<String>,
    create_gi: Option<String>,
    default_ci: bool,
    create_ci: bool,
    destroy_ci: bool,
    destroy_gi: bool,
    list_gip: bool,
    list_gipp: bool,
    list_gi: bool,
}

fn parse(args: &[String]) -> Option<MigOpts> {
    let mut o = MigOpts::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (name, inline) = super::split_flag(arg);
        let mut value = || inline.clone().or_else(|| it.next().cloned());
        match name {
            "-i" | "--id" => o.id = Some(value()?),
            "-gi" | "--gpu-instance-id" => o.gi = Some(value()?),
            "-ci" | "--compute-instance-id" => o.ci = Some(value()?),
            "-cgi" | "--create-gpu-instance" => o.create_gi = Some(value()?),
            "-C" | "--default-compute-instance" => o.default_ci = true,
            "-cci" | "--create-compute-instance" => o.create_ci = true,
            "-dci" | "--destroy-compute-instance" => o.destroy_ci = true,
            "-dgi" | "--destroy-gpu-instance" => o.destroy_gi = true,
            "-lgip" | "--list-gpu-instance-profiles" => o.list_gip = true,
            "-lgipp" | "--list-gpu-instance-possible-placements" => o.list_gipp = true,
            "-lgi" | "--list-gpu-instances" => o.list_gi = true,
            _ => return None,
        }
    }
    Some(o)
}

fn id_list(s: &Option<String>) -> Option<Vec<u32>> {
    s.as_ref()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
}

/// `nvidia-smi mig …`.
pub(super) fn run(file: &StateFile, args: &[String], out: &mut dyn Write) -> std::io::Result<i32> {
    let Some(o) = parse(args) else {
        writeln!(out, "{INVALID_COMBINATION}")?;
        return Ok(EXIT_INVALID);
    };
    let Ok(state) = file.load_visible() else {
        return no_driver(out);
    };
    let targets: Vec<usize> = match &o.id {
        None => (0..state.gpus.len()).collect(),
        Some(ids) => match resolve_ids(&state, ids) {
            Some(t) => t,
            None => {
                writeln!(out, "No devices were found")?;
                return Ok(EXIT_NOT_FOUND);
            }
        },
    };
    let capable: Vec<usize> = targets
        .iter()
        .copied()
        .filter(|&i| state.profile.gpus[i].mig_profiles().is_some())
        .collect();
    if capable.is_empty() {
        writeln!(out, "No MIG-supported devices found.")?;
        return Ok(EXIT_NOT_SUPPORTED);
    }
    if o.list_gip {
        return list_profiles(&state, &capable, out);
    }
    if o.list_gipp {
        return list_placements(&state, &capable, out);
    }
    if o.list_gi {
        return list_instances(&state, &capable, out);
    }
    if let Some(spec) = &o.create_gi {
        return create(file, &state, &capable, spec, o.default_ci, out);
    }
    if o.create_ci {
        return create_ci(file, &capable, id_list(&o.gi), out);
    }
    if o.destroy_ci {
        return destroy_ci(file, &capable, id_list(&o.gi), id_list(&o.ci), out);
    }
    if o.destroy_gi {
        return destroy_gi(file, &capable, id_list(&o.gi), out);
    }
    writeln!(out, "{INVALID_COMBINATION}")?;
    Ok(EXIT_INVALID)
}

/// Profiles in `nvidia-smi` listing order: by size, then memory, then index.
fn listing(table: &'static [tables::GiProfile]) -> Vec<&'static tables::GiProfile> {
    let mut v: Vec<_> = table.iter().collect();
    v.sort_by_key(|p| (p.slice_count, p.memory_mib, p.index));
    v
}

fn free_count(state: &State, gpu: usize, p: &tables::GiProfile) -> u32 {
    // MIG off (or any other refusal): nothing is free, as the real listing shows.
    state.gpu_instance_capacity(gpu, p.id).unwrap_or(0)
}

fn list_profiles(state: &State, gpus: &[usize], out: &mut dyn Write) -> std::io::Result<i32> {
    let rule = format!("+{}+", "-".repeat(77));
    writeln!(out, "{rule}")?;
    writeln!(out, "| {:<76}|", "GPU instance profiles:")?;
    writeln!(
        out,
        "| GPU   Name             ID    Instances   Memory     P2P    SM    DEC   ENC  |"
    )?;
    writeln!(
        out,
        "|                              Free/Total   GiB              CE    JPEG  OFA  |"
    )?;
    writeln!(out, "|{}|", "=".repeat(77))?;
    for (k, &i) in gpus.iter().enumerate() {
        if k > 0 {
            writeln!(out, "+{}+", "-".repeat(77))?;
        }
        let table = state.profile.gpus[i].mig_profiles().unwrap_or(&[]);
        for p in listing(table) {
            let name = format!("MIG {}", p.name);
            let free = free_count(state, i, p);
            let gib = p.memory_mib as f64 / 1024.0;
            writeln!(
                out,
                "|{i:>4}  {name:<16}{:>4}{free:>6}/{:<3}{gib:>10.2}{:>9}{:>7}{:>6}{:>6}   |",
                p.id, p.instance_count, "No", p.multiprocessors, p.decoders, p.encoders
            )?;
            writeln!(out, "|{:>62}{:>6}{:>6}   |", p.copy_engines, p.jpeg, p.ofa)?;
        }
    }
    writeln!(out, "{rule}")?;
    Ok(EXIT_OK)
}

fn list_placements(state: &State, gpus: &[usize], out: &mut dyn Write) -> std::io::Result<i32> {
    for &i in gpus {
        let table = state.profile.gpus[i].mig_profiles().unwrap_or(&[]);
        for p in listing(table) {
            let starts: Vec<String> = p.placement_starts.iter().map(u32::to_string).collect();
            let label = if starts.len() == 1 {
                "Placement :"
            } else {
                "Placements:"
            };
            writeln!(
                out,
                "GPU {i:>2} Profile ID {:>2} {label} {{{}}}:{}",
                p.id,
                starts.join(","),
                p.placement_size
            )?;
        }
    }
    Ok(EXIT_OK)
}

fn list_instances(state: &State, gpus: &[usize], out: &mut dyn Write) -> std::io::Result<i32> {
    let mut rows = Vec::new();
    for &i in gpus {
        let table = state.profile.gpus[i].mig_profiles().unwrap_or(&[]);
        for gi in &state.gpus[i].gpu_instances {
            if let Some(p) = tables::by_id(table, gi.profile_id) {
                rows.push((i, p, gi.id, gi.placement_start));
            }
        }
    }
    if rows.is_empty() {
        writeln!(out, "No GPU instances found: Not Found")?;
        return Ok(EXIT_NOT_FOUND);
    }
    let rule = format!("+{}+", "-".repeat(55));
    writeln!(out, "{rule}")?;
    writeln!(out, "| {:<54}|", "GPU instances:")?;
    writeln!(
        out,
        "| GPU   Name             Profile  Instance   Placement  |"
    )?;
    writeln!(
        out,
        "|                          ID       ID       Start:Size |"
    )?;
    writeln!(out, "|{}|", "=".repeat(55))?;
    for (i, p, id, start) in rows {
        let name = format!("MIG {}", p.name);
        let place = format!("{start}:{}", p.placement_size);
        writeln!(
            out,
            "|{i:>4}  {name:<16}{:>6}{id:>9}{place:>13}{:>5}|",
            p.id, ""
        )?;
    }
    writeln!(out, "{rule}")?;
    Ok(EXIT_OK)
}

/// Resolves a `-cgi` item (`9`, `3g.20gb`, `MIG 3g.20gb`, optionally `:<start>`).
fn resolve_profile(
    table: &'static [tables::GiProfile],
    item: &str,
) -> Option<(&'static tables::GiProfile, Option<u32>)> {
    let (name, start) = match item.split_once(':') {
        Some((n, s)) => (n.trim(), Some(s.trim().parse().ok()?)),
        None => (item.trim(), None),
    };
    let name = name.strip_prefix("MIG ").unwrap_or(name);
    let p = match name.parse::<u32>() {
        Ok(id) => tables::by_id(table, id)?,
        Err(_) => table.iter().find(|p| p.name == name)?,
    };
    Some((p, start))
}

fn create(
    file: &StateFile,
    state: &State,
    gpus: &[usize],
    spec: &str,
    with_ci: bool,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let mut code = EXIT_OK;
    for &i in gpus {
        let table = state.profile.gpus[i].mig_profiles().unwrap_or(&[]);
        for item in spec.split(',').filter(|s| !s.trim().is_empty()) {
            let Some((p, start)) = resolve_profile(table, item) else {
                writeln!(
                    out,
                    "Unable to create a GPU instance on GPU {i:>2} using profile {item}: Invalid Argument"
                )?;
                writeln!(out, "Failed to create GPU instances: Invalid Argument")?;
                return Ok(EXIT_INVALID);
            };
            let Some(res) = change(file, |s| {
                let gi = s.create_gpu_instance(i, p.id, start)?;
                let ci = if with_ci {
                    Some(s.create_compute_instance(i, gi)?)
                } else {
                    None
                };
                Ok::<_, MigError>((gi, ci))
            }) else {
                return no_driver(out);
            };
            match res {
                Ok((gi, ci)) => {
                    writeln!(
                        out,
                        "Successfully created GPU instance ID {gi:>2} on GPU {i:>2} using profile MIG {} (ID {:>2})",
                        p.name, p.id
                    )?;
                    if let Some(ci) = ci {
                        writeln!(
                            out,
                            "Successfully created compute instance ID {ci:>2} on GPU {i:>2} GPU instance ID {gi:>2} using profile MIG {} (ID {:>2})",
                            p.name,
                            p.default_ci_profile()
                        )?;
                    }
                }
                Err(e) => {
                    writeln!(
                        out,
                        "Unable to create a GPU instance on GPU {i:>2} using profile {}: {e}",
                        p.id
                    )?;
                    writeln!(out, "Failed to create GPU instances: {e}")?;
                    code = exit_for(&e);
                }
            }
        }
    }
    Ok(code)
}

fn create_ci(
    file: &StateFile,
    gpus: &[usize],
    gi_filter: Option<Vec<u32>>,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let Some(lines) = change(file, |s| {
        let mut lines = Vec::new();
        for &i in gpus {
            let gis: Vec<u32> = s.gpus[i]
                .gpu_instances
                .iter()
                .filter(|g| g.compute_instances.is_empty())
                .map(|g| g.id)
                .filter(|id| gi_filter.as_ref().is_none_or(|f| f.contains(id)))
                .collect();
            for gi in gis {
                if let Ok(ci) = s.create_compute_instance(i, gi) {
                    lines.push(format!(
                        "Successfully created compute instance ID {ci:>2} on GPU {i:>2} GPU instance ID {gi:>2}"
                    ));
                }
            }
        }
        lines
    }) else {
        return no_driver(out);
    };
    if lines.is_empty() {
        writeln!(out, "No GPU instances found: Not Found")?;
        return Ok(EXIT_NOT_FOUND);
    }
    for l in lines {
        writeln!(out, "{l}")?;
    }
    Ok(EXIT_OK)
}

fn destroy_ci(
    file: &StateFile,
    gpus: &[usize],
    gi_filter: Option<Vec<u32>>,
    ci_filter: Option<Vec<u32>>,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let Some(lines) = change(file, |s| {
        let mut lines = Vec::new();
        for &i in gpus {
            let victims: Vec<(u32, u32)> = s.gpus[i]
                .gpu_instances
                .iter()
                .filter(|g| gi_filter.as_ref().is_none_or(|f| f.contains(&g.id)))
                .flat_map(|g| g.compute_instances.iter().map(move |c| (g.id, c.id)))
                .filter(|(_, c)| ci_filter.as_ref().is_none_or(|f| f.contains(c)))
                .collect();
            for (gi, ci) in victims {
                if s.destroy_compute_instance(i, gi, ci).is_ok() {
                    lines.push(format!(
                        "Successfully destroyed compute instance ID {ci:>2} from GPU {i:>2} GPU instance ID {gi:>2}"
                    ));
                }
            }
        }
        lines
    }) else {
        return no_driver(out);
    };
    if lines.is_empty() {
        writeln!(out, "No compute instances found: Not Found")?;
        return Ok(EXIT_NOT_FOUND);
    }
    for l in lines {
        writeln!(out, "{l}")?;
    }
    Ok(EXIT_OK)
}

fn destroy_gi(
    file: &StateFile,
    gpus: &[usize],
    gi_filter: Option<Vec<u32>>,
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let Some(results) = change(file, |s| {
        let mut results = Vec::new();
        for &i in gpus {
            let ids: Vec<u32> = s.gpus[i]
                .gpu_instances
                .iter()
                .map(|g| g.id)
                .filter(|id| gi_filter.as_ref().is_none_or(|f| f.contains(id)))
                .collect();
            for gi in ids {
                results.push((i, gi, s.destroy_gpu_instance(i, gi)));
            }
        }
        results
    }) else {
        return no_driver(out);
    };
    if results.is_empty() {
        writeln!(out, "No GPU instances found: Not Found")?;
        return Ok(EXIT_NOT_FOUND);
    }
    let mut code = EXIT_OK;
    for (i, gi, r) in results {
        match r {
            Ok(()) => writeln!(
                out,
                "Successfully destroyed GPU instance ID {gi:>2} from GPU {i:>2}"
            )?,
            Err(e) => {
                writeln!(
                    out,
                    "Unable to destroy GPU instance ID {gi:>2} from GPU {i:>2}: {e}"
                )?;
                code = exit_for(&e);
            }
        }
    }
    if code != EXIT_OK {
        writeln!(
            out,
            "Failed to destroy GPU instances: In use by another client"
        )?;
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profile;

    fn smi(file: &StateFile, args: &str) -> (i32, String) {
        let args: Vec<String> = args.split_whitespace().map(String::from).collect();
        let mut out = Vec::new();
        let code = super::super::run(Ok(file.clone()), &args, &mut out);
        (code, String::from_utf8(out).expect("utf8"))
    }

    fn host(profile: &str) -> (tempfile::TempDir, StateFile) {
        let dir = tempfile::tempdir().expect("tmp");
        let file = StateFile::under_root(dir.path());
        let state = State::from_profile(Profile::load(profile).expect("profile"));
        file.create(&state).expect("create");
        // The device nodes, as `gpu-sim setup` lays them out: what is visible follows them.
        for g in &state.profile.gpus {
            let node = dir.path().join(format!("dev/nvidia{}", g.minor));
            std::fs::create_dir_all(node.parent().expect("dev")).expect("dev");
            std::fs::write(node, b"").expect("node");
        }
        crate::setup::sync_mig_files(dir.path(), &state).expect("MIG nodes");
        (dir, file)
    }

    #[test]
    fn lgipp_matches_the_real_output() {
        let (_d, f) = host("dgx-a100-40gb");
        let (code, out) = smi(&f, "mig -i 0 -lgipp");
        assert_eq!(code, 0);
        assert_eq!(
            out,
            "GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1\n\
             GPU  0 Profile ID 20 Placements: {0,1,2,3,4,5,6}:1\n\
             GPU  0 Profile ID 15 Placements: {0,2,4,6}:2\n\
             GPU  0 Profile ID 14 Placements: {0,2,4}:2\n\
             GPU  0 Profile ID  9 Placements: {0,4}:4\n\
             GPU  0 Profile ID  5 Placement : {0}:4\n\
             GPU  0 Profile ID  0 Placement : {0}:8\n"
        );
    }

    #[test]
    fn lgip_rows_match_the_real_layout() {
        let (_d, f) = host("dgx-a100-40gb");
        let (code, out) = smi(&f, "mig -i 4 -lgip");
        assert_eq!(code, 0);
        // MIG is off on GPU 4: nothing is free.
        assert!(
            out.contains("|   4  MIG 1g.5gb        19     0/7        4.75       No     14     0     0   |\n\
                          |                                                             1     0     0   |\n"),
            "{out}"
        );
        let (_, out) = smi(&f, "-i 4 -mig 1");
        assert_eq!(
            out,
            "Enabled MIG Mode for GPU 00000000:87:00.0\nAll done.\n"
        );
        let (_, out) = smi(&f, "mig -i 4 -lgip");
        assert!(
            out.contains(
                "|   4  MIG 3g.20gb        9     2/2       19.50       No     42     2     0   |"
            ),
            "{out}"
        );
    }

    #[test]
    fn create_list_and_destroy_instances() {
        let (dir, f) = host("dgx-h100");
        let (code, out) = smi(&f, "mig -i 0 -cgi 9 -C");
        assert_eq!(code, EXIT_NOT_SUPPORTED, "MIG is off: {out}");
        smi(&f, "-i 0 -mig 1");
        let (code, out) = smi(&f, "mig -i 0 -cgi 3g.40gb:4,19 -C");
        assert_eq!(code, 0, "{out}");
        assert_eq!(
            out,
            "Successfully created GPU instance ID  1 on GPU  0 using profile MIG 3g.40gb (ID  9)\n\
             Successfully created compute instance ID  0 on GPU  0 GPU instance ID  1 using profile MIG 3g.40gb (ID  2)\n\
             Successfully created GPU instance ID  2 on GPU  0 using profile MIG 1g.10gb (ID 19)\n\
             Successfully created compute instance ID  0 on GPU  0 GPU instance ID  2 using profile MIG 1g.10gb (ID  0)\n"
        );
        assert!(
            dir.path()
                .join("proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access")
                .is_file()
        );
        let (code, out) = smi(&f, "mig -i 0 -cgi 9:4");
        assert_eq!(code, EXIT_OTHER);
        assert!(out.ends_with("Failed to create GPU instances: Insufficient Resources\n"));
        let (_, out) = smi(&f, "mig -lgi");
        assert!(
            out.contains("|   0  MIG 3g.40gb          9        1          4:4     |"),
            "{out}"
        );
        let (code, _) = smi(&f, "-i 0 -mig 0");
        assert_eq!(code, EXIT_OTHER, "instances exist");
        let (code, out) = smi(&f, "mig -i 0 -dgi -gi 1");
        assert_eq!(code, EXIT_OTHER);
        assert!(out.contains("In use by another client"), "{out}");
        let (code, out) = smi(&f, "mig -i 0 -dci");
        assert_eq!(code, 0);
        assert_eq!(out.lines().count(), 2);
        let (code, out) = smi(&f, "mig -i 0 -dgi");
        assert_eq!(code, 0);
        assert_eq!(
            out,
            "Successfully destroyed GPU instance ID  1 from GPU  0\n\
             Successfully destroyed GPU instance ID  2 from GPU  0\n"
        );
        assert!(
            !dir.path()
                .join("proc/driver/nvidia/capabilities/gpu0/mig/gi2")
                .exists()
        );
        let (code, out) = smi(&f, "mig -lgi");
        assert_eq!(
            (code, out.as_str()),
            (EXIT_NOT_FOUND, "No GPU instances found: Not Found\n")
        );
        let t4 = host("t4");
        let (code, _) = smi(&t4.1, "mig -lgip");
        assert_eq!(code, EXIT_NOT_SUPPORTED);
    }
}
