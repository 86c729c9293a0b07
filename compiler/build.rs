//! Records the git revision maxc is built from (MAXC_GIT_REVISION) for artifact provenance.

use std::path::Path;
use std::process::Command;

fn main() {
    let rev = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .is_some_and(|o| !o.stdout.is_empty());
    println!("cargo:rustc-env=MAXC_GIT_REVISION={rev}{}", if dirty { "-dirty" } else { "" });
    for f in ["../.git/HEAD", "../.git/index", "../.git/packed-refs", "../.git/refs/heads"] {
        if Path::new(f).exists() {
            println!("cargo:rerun-if-changed={f}");
        }
    }
}
