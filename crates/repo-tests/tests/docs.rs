//! The docs a newcomer reads first agree with the tree.
//!
//! - Every crate's `//!` doc names each module its `lib.rs` declares (in backticks, a rustdoc
//!   link for public ones), so a module added or renamed without its line in the crate doc fails
//!   here. Unit-test modules (`mod tests`) are exempt.
//! - The README's layout table has one row per workspace member with its package name, and no
//!   row for a path that is gone.
//! - The binaries' rows in that table list exactly their subcommands, read from the same clap
//!   definitions the binaries parse.
//! - `unsafe_code` is forbidden workspace-wide; a crate that needs it (the NVML calls, the
//!   simulator's C ABI) lowers the lint for itself and allows it file by file: the files with
//!   such an `allow` are exactly those its crate doc lists in its "Unsafe code" paragraph.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::CommandFactory;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The workspace members, as paths relative to the repository root.
fn members() -> Vec<String> {
    let manifest = read(&repo().join("Cargo.toml"));
    let start = manifest
        .find("members = [")
        .expect("the root Cargo.toml lists its members");
    let end = start + manifest[start..].find(']').expect("members list closes");
    manifest[start..end]
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The `name` of a member's `[package]`.
fn package_name(member: &str) -> String {
    let manifest = read(&repo().join(member).join("Cargo.toml"));
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("name = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or_else(|| panic!("{member}/Cargo.toml has no package name"))
        .to_owned()
}

/// Modules declared at the top of a `lib.rs` (`mod x;` / `pub mod x;`, whatever their `cfg`).
fn declared_modules(lib: &str) -> Vec<String> {
    lib.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let name = l.strip_prefix("mod ")?.strip_suffix(';')?;
            Some(name.to_owned())
        })
        .collect()
}

fn crate_doc(lib: &str) -> String {
    lib.lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_crate_doc_names_its_modules() {
    let mut problems = Vec::new();
    for member in members() {
        let path = repo().join(&member).join("src/lib.rs");
        let Ok(lib) = std::fs::read_to_string(&path) else {
            continue;
        };
        let doc = crate_doc(&lib);
        for module in declared_modules(&lib) {
            if module == "tests" {
                continue;
            }
            if !doc.contains(&format!("`{module}`")) {
                problems.push(format!(
                    "{member}/src/lib.rs declares module `{module}` but its crate doc does not name it"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The README's layout table: (path, package, what) per row.
fn layout_rows() -> Vec<(String, String, String)> {
    let readme = read(&repo().join("README.md"));
    let start = readme
        .find("## Layout")
        .expect("the README has a Layout section");
    readme[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2) // header and separator
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            let strip = |s: &str| s.trim_matches('`').trim_end_matches('/').to_owned();
            (
                strip(cells[0]),
                strip(cells.get(1).copied().unwrap_or("")),
                cells.get(2).copied().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

#[test]
fn readme_layout_table_matches_the_workspace() {
    let rows = layout_rows();
    let mut problems = Vec::new();
    for member in members() {
        let package = package_name(&member);
        match rows.iter().find(|(path, _, _)| *path == member) {
            None => problems.push(format!("README layout table has no row for {member}")),
            Some((_, named, _)) if *named != package => problems.push(format!(
                "README layout table names {member} as {named}, its package is {package}"
            )),
            Some(_) => {}
        }
    }
    for (path, _, _) in &rows {
        if !repo().join(path).exists() {
            problems.push(format!(
                "README layout table has a row for {path}, which is not in the tree"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The subcommands a row lists: the backticked words of its first parenthesis.
fn listed_subcommands(what: &str) -> BTreeSet<String> {
    let inside = what
        .split_once('(')
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(inside, _)| inside)
        .unwrap_or("");
    inside
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

fn subcommands(command: &clap::Command) -> BTreeSet<String> {
    command
        .get_subcommands()
        .map(|c| c.get_name().to_owned())
        .filter(|name| name != "help")
        .collect()
}

#[test]
fn readme_lists_each_binarys_subcommands() {
    let rows = layout_rows();
    for (path, command) in [
        ("crates/cli", gpu_dra_cli::Cli::command()),
        (
            "crates/kubelet-plugin",
            gpu_dra_kubelet_plugin::cmd::command(),
        ),
    ] {
        let (_, _, what) = rows
            .iter()
            .find(|(p, _, _)| p == path)
            .unwrap_or_else(|| panic!("no README row for {path}"));
        assert_eq!(
            listed_subcommands(what),
            subcommands(&command),
            "README layout row of {path} lists other subcommands than `{}` has: {what}",
            command.get_name()
        );
    }
}

/// The `src/...` files named in the "Unsafe code" paragraph of a crate doc.
fn documented_unsafe_files(lib: &str) -> BTreeSet<String> {
    lib.lines()
        .skip_while(|l| !l.starts_with("//! Unsafe code"))
        .take_while(|l| l.starts_with("//!") && l.trim_end() != "//!")
        .flat_map(|l| l.split('`').skip(1).step_by(2))
        .filter(|w| w.starts_with("src/") && w.ends_with(".rs"))
        .map(str::to_owned)
        .collect()
}

/// The files under `dir` with an `allow` attribute naming `unsafe_code`, relative to `root`.
fn files_allowing_unsafe(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).expect("read source folder") {
        let path = entry.expect("folder entry").path();
        if path.is_dir() {
            files_allowing_unsafe(root, &path, out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let allows = read(&path).lines().map(str::trim_start).any(|l| {
            (l.starts_with("#![allow(") || l.starts_with("#[allow(")) && l.contains("unsafe_code")
        });
        if allows {
            let rel = path.strip_prefix(root).expect("under the crate");
            out.insert(rel.display().to_string());
        }
    }
}

#[test]
fn every_crate_doc_lists_the_files_that_allow_unsafe_code() {
    let mut problems = Vec::new();
    let mut crates_with_unsafe = 0;
    for member in members() {
        let root = repo().join(&member);
        let Ok(lib) = std::fs::read_to_string(root.join("src/lib.rs")) else {
            continue;
        };
        let mut found = BTreeSet::new();
        files_allowing_unsafe(&root, &root.join("src"), &mut found);
        crates_with_unsafe += usize::from(!found.is_empty());
        let documented = documented_unsafe_files(&lib);
        if documented != found {
            problems.push(format!(
                "{member}: files allowing unsafe_code {found:?}, its crate doc's \"Unsafe code\" paragraph lists {documented:?}"
            ));
        }
    }
    assert!(
        crates_with_unsafe >= 2,
        "the NVML backend and the simulator's C ABI need unsafe code; the scan found {crates_with_unsafe} crates"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
