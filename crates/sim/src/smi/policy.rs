//! `nvidia-smi compute-policy`: the CUDA time-slice policy of GPUs (`-l` lists it,
//! `--set-timeslice <0..3>` sets it), with the real tool's help, messages and refusal on GPUs
//! that do not support it.

use std::io::Write;

use super::{EXIT_INVALID, EXIT_NOT_FOUND, EXIT_NOT_SUPPORTED, EXIT_OK};
use super::{INVALID_COMBINATION, no_driver, resolve_ids};
use crate::state::StateFile;

/// Names of the time-slice values 0..=3, as the tool prints them.
const TIMESLICE_NAMES: [&str; 4] = ["Default", "Short", "Medium", "Long"];

/// What `compute-policy -h` prints.
const POLICY_HELP: &str = "compute-policy -- Control and list compute policies.

Usage: nvidia-smi compute-policy [options]

Options include:
[-i | --id]: GPU device ID's. Provide comma separated values for more than one device
[-l | --list]: List all compute policies
[ | --set-timeslice]: Set timeslice config for a GPU: 0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG
[-h | --help]: Display help information";

/// `nvidia-smi compute-policy`: lists or sets the time-slice policy of GPUs.
pub(super) fn compute_policy(
    file: &StateFile,
    args: &[String],
    out: &mut dyn Write,
) -> std::io::Result<i32> {
    let mut id = None;
    let mut list = false;
    let mut timeslice = None;
    let mut help = false;
    let mut commands = 0;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (name, inline) = super::split_flag(arg);
        let mut value = || inline.clone().or_else(|| it.next().cloned());
        match name {
            "-i" | "--id" => id = value(),
            "-l" | "--list" => {
                list = true;
                commands += 1;
            }
            "--set-timeslice" => {
                timeslice = Some(value().unwrap_or_default());
                commands += 1;
            }
            "-h" | "--help" => help = true,
            _ => {
                writeln!(out, "{INVALID_COMBINATION}")?;
                return Ok(EXIT_INVALID);
            }
        }
    }
    if help || commands == 0 {
        writeln!(out, "{POLICY_HELP}")?;
        return Ok(if help { EXIT_OK } else { EXIT_INVALID });
    }
    if commands > 1 {
        writeln!(
            out,
            "One, and only one, compute-policy command allowed at a time"
        )?;
        return Ok(EXIT_INVALID);
    }
    let Ok(state) = file.load_visible() else {
        return no_driver(out);
    };
    let targets = match &id {
        None => (0..state.gpus.len()).collect(),
        Some(ids) => match resolve_ids(&state, ids) {
            Some(t) => t,
            None => {
                writeln!(out, "No devices were found")?;
                return Ok(EXIT_NOT_FOUND);
            }
        },
    };
    if list {
        writeln!(out, "+-------------------------------------+")?;
        writeln!(out, "| GPU compute policies:               |")?;
        writeln!(out, "| GPU     Name           Value        |")?;
        writeln!(out, "|=====================================|")?;
        for &i in &targets {
            let g = &state.profile.gpus[i];
            let v = if g.timeslice_supported {
                TIMESLICE_NAMES
                    .get(state.gpus[i].timeslice as usize)
                    .copied()
                    .unwrap_or("Default")
            } else {
                "N/A"
            };
            writeln!(out, "| {i:>3}     {:<14} {v:<12} |", "Timeslice")?;
        }
        writeln!(out, "+-------------------------------------+")?;
        return Ok(EXIT_OK);
    }
    let raw = timeslice.unwrap_or_default();
    let value = match raw.parse::<u32>() {
        Ok(v) if v < 4 => v,
        _ => {
            writeln!(
                out,
                "Invalid value for --set-timeslice: \"{raw}\". Valid values: 0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG"
            )?;
            return Ok(EXIT_INVALID);
        }
    };
    let name = TIMESLICE_NAMES[value as usize];
    let mut lines = Vec::new();
    let mut failed = false;
    let res = file.update(|s| {
        for &i in &targets {
            if !s.profile.gpus[i].timeslice_supported {
                lines.push(format!(
                    "Failed to set timeslice policy with value {name} for GPU {i} : Not Supported"
                ));
                failed = true;
                continue;
            }
            s.gpus[i].timeslice = value;
            lines.push(format!(
                "Successfully set timeslice policy with value {name} for GPU {i}"
            ));
        }
        Ok::<(), ()>(())
    });
    if res.is_err() {
        return no_driver(out);
    }
    for l in lines {
        writeln!(out, "{l}")?;
    }
    if failed {
        writeln!(
            out,
            "Failed to set timeslice for requested devices : Not Supported"
        )?;
        return Ok(EXIT_NOT_SUPPORTED);
    }
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{host, smi};
    use super::super::{EXIT_INVALID, EXIT_NOT_SUPPORTED};

    #[test]
    fn timeslice_is_set_and_listed() {
        let h = host("dgx-h100");
        let (code, out) = smi(&h, "compute-policy -i 2 --set-timeslice 3");
        assert_eq!(code, 0, "{out}");
        assert_eq!(
            out,
            "Successfully set timeslice policy with value Long for GPU 2\n"
        );
        assert_eq!(h.file.load().expect("state").gpus[2].timeslice, 3);
        let (code, out) = smi(&h, "compute-policy -l -i 2");
        assert_eq!(code, 0);
        assert!(
            out.contains("|   2     Timeslice      Long         |"),
            "{out}"
        );
        let (code, out) = smi(&h, "compute-policy -l --set-timeslice 1");
        assert_eq!(code, EXIT_INVALID);
        assert!(out.contains("One, and only one"));
        let (code, _) = smi(&h, "compute-policy --set-timeslice 4");
        assert_eq!(code, EXIT_INVALID);
    }

    #[test]
    fn timeslice_on_a_p4_is_not_supported() {
        let h = host("p4");
        let (code, out) = smi(&h, "compute-policy -i 0 --set-timeslice 0");
        assert_eq!(code, EXIT_NOT_SUPPORTED);
        assert_eq!(
            out,
            "Failed to set timeslice policy with value Default for GPU 0 : Not Supported\n\
             Failed to set timeslice for requested devices : Not Supported\n"
        );
    }
}
