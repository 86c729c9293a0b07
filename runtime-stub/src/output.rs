//! Files the tools write for the user (maxc's artifact, maxrun's `--dump-logits`):
//! never over an input or a special file, never half-written.
//!
//! [`check_output`] refuses a path that resolves (after symbolic links) to an
//! input of the command, or to anything that is not a regular file or a new
//! path (a directory, a device such as /dev/null, a FIFO). Writers go through
//! [`TempFile`]: a hidden temporary file beside the output (`.NAME.tmp-PID`),
//! renamed over it only when complete and removed on error, on drop, and by
//! [`remove_temp_files`], which the tools call on SIGINT / SIGTERM / SIGHUP.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Temporary files being written, for [`remove_temp_files`].
static TEMP_FILES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn registry() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    TEMP_FILES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Refuses `output` (named `flag` in the message) when writing it would destroy
/// something: one of `inputs` (compared after symbolic links), a directory, or
/// a file that is not a regular one. A new path, or a regular file that is not
/// an input, is fine.
pub fn check_output(flag: &str, output: &Path, inputs: &[PathBuf]) -> Result<(), String> {
    let shown = output.display();
    if let Ok(meta) = std::fs::metadata(output) {
        if !meta.is_file() {
            let kind = if meta.is_dir() { "a directory" } else { "not a regular file (a device, FIFO or socket)" };
            return Err(format!("{flag} {shown} is {kind}; writing would replace it: give a new file name"));
        }
    }
    let Ok(out) = std::fs::canonicalize(output) else { return Ok(()) };
    for input in inputs {
        if std::fs::canonicalize(input).is_ok_and(|i| i == out) {
            let what = if input == output { String::new() } else { format!(" ({})", input.display()) };
            return Err(format!("{flag} {shown} is an input of this command{what}; writing would replace it: write elsewhere"));
        }
    }
    Ok(())
}

/// A temporary file beside `target`, registered for [`remove_temp_files`].
/// [`TempFile::commit`] renames it over the target; dropping it uncommitted
/// removes it.
pub struct TempFile {
    path: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl TempFile {
    /// Registers the temporary path for `target` (nothing is created yet).
    pub fn new(target: &Path) -> TempFile {
        let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "output".into());
        let path = target.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        registry().push(path.clone());
        TempFile { path, target: target.to_path_buf(), committed: false }
    }

    /// Where to write.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the finished file over the target.
    pub fn commit(mut self) -> std::io::Result<()> {
        std::fs::rename(&self.path, &self.target)?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
        registry().retain(|p| p != &self.path);
    }
}

/// Writes `bytes` to `target` through a [`TempFile`] (synced before the rename).
pub fn write_atomically(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = TempFile::new(target);
    let mut f = std::fs::File::create(tmp.path())?;
    f.write_all(bytes)?;
    f.sync_all()?;
    tmp.commit()
}

/// Removes every temporary file still being written: what the tools do on
/// SIGINT, SIGTERM and SIGHUP before they exit, so that a cancelled command
/// leaves nothing beside its output.
pub fn remove_temp_files() {
    remove_registered(|_| true);
}

/// Removes (and forgets) the registered temporary files that `which` picks.
/// The tests pick their own folder's: the registry is the process's, and
/// another test's file being written at the same time must stay.
fn remove_registered(which: impl Fn(&Path) -> bool) {
    let picked: Vec<PathBuf> = {
        let mut files = registry();
        let (picked, kept) = std::mem::take(&mut *files).into_iter().partition(|p| which(p));
        *files = kept;
        picked
    };
    for f in picked {
        let _ = std::fs::remove_file(f);
    }
}

/// On SIGINT, SIGTERM or SIGHUP: remove the temporary files being written,
/// say `TOOL: stopped by signal N; WHAT` and exit with 128 + N, as a shell
/// reports it. Not for `maxrun serve`, whose signals end it gracefully.
pub fn remove_temp_files_on_signals(tool: &'static str, what: &'static str) {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else { return };
    std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            remove_temp_files();
            eprintln!("{tool}: stopped by signal {signal}; {what}");
            std::process::exit(128 + signal);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("maxrun-output-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn inputs_directories_and_devices_are_refused() {
        let d = dir("check");
        let input = d.join("model.mef");
        std::fs::write(&input, b"x").unwrap();
        let link = d.join("link.npy");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        let inputs = [input.clone()];
        assert!(check_output("-o", &input, &inputs).unwrap_err().contains("is an input"));
        let e = check_output("--dump-logits", &link, &inputs).unwrap_err();
        assert!(e.contains("--dump-logits") && e.contains("model.mef"), "{e}");
        assert!(check_output("-o", &d, &inputs).unwrap_err().contains("a directory"));
        assert!(check_output("-o", Path::new("/dev/null"), &inputs).unwrap_err().contains("not a regular file"));
        assert!(check_output("-o", &d.join("new.npy"), &inputs).is_ok());
        let other = d.join("other.npy");
        std::fs::write(&other, b"old").unwrap();
        assert!(check_output("-o", &other, &inputs).is_ok(), "a regular file that is no input may be replaced");
    }

    #[test]
    fn temp_files_are_renamed_when_done_and_removed_otherwise() {
        let d = dir("temp");
        let target = d.join("out.npy");
        write_atomically(&target, b"data").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"data");
        let tmp = TempFile::new(&d.join("half.npy"));
        std::fs::write(tmp.path(), b"partial").unwrap();
        assert!(tmp.path().file_name().unwrap().to_string_lossy().starts_with(".half.npy.tmp-"));
        drop(tmp);
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from("out.npy")]);
        let tmp = TempFile::new(&d.join("signalled.npy"));
        std::fs::write(tmp.path(), b"partial").unwrap();
        remove_registered(|p| p.starts_with(&d));
        assert!(!tmp.path().exists(), "removed as on a signal");
    }
}
