//! The compile cache (`maxc compile --cache-dir DIR`, or `MAXC_CACHE_DIR`):
//! artifacts kept by build id, so that compiling the same inputs again copies
//! (or hard-links) the finished artifact instead of building it.
//!
//! An entry is `DIR/<build id>-<config>.mef` with `DIR/<build id>-<config>.mef.xxh3`
//! beside it (the whole file's xxh3-128 and size). The build id is the one the
//! artifact records, computed before compiling by the function the provenance
//! uses ([`crate::provenance::provenance`]: maxc's version and revision, the
//! manifest, the provenance flags, every input file's hash). `config` hashes
//! what the build id does not see but the artifact depends on: the resolved
//! compile configuration, which holds the CPU that `--target cpu` means on this
//! machine (so a cache shared by machines with different CPUs gives each its
//! own native code), and, for a maxc built from a checkout with changes, the
//! maxc executable itself (its git revision no longer names its code).
//!
//! Entries are written to a temporary file and renamed, the artifact before its
//! checksum, so a reader sees a whole entry or none; two compiles of one key at
//! once each write their own temporary file and rename the same bytes. An entry
//! is used only when its whole file matches its checksum and its header records
//! the key's build id; one that does not is reported, removed and rebuilt.

use std::fs::File;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

use crate::driver::Phase;
use crate::error::{Error, Result};
use crate::manifest::LoadedManifest;

/// What names a cache entry: the artifact's build id and a hash of the
/// resolved configuration (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub build_id: String,
    pub config: u64,
}

impl Key {
    /// The key of compiling `manifest` with the provenance `flags` (the command
    /// line as the artifact records it). Reads and hashes every input file, as
    /// the compile's provenance does; errors are the ones the compile would
    /// report first (the configuration, then the import).
    pub fn compute(manifest: &LoadedManifest, flags: &[String]) -> Result<Key> {
        let config = crate::compile_config::CompileConfig::resolve(manifest).map_err(|mut problems| problems.remove(0))?;
        let m = &manifest.manifest;
        let path = &m.model.path;
        // A GGUF file is its own only input (`import::import_gguf`), which spares
        // the key the import's tokenizer rebuild (most of a cache hit's time);
        // other models list what they read as the import does.
        let inputs = if crate::import::is_gguf(path) && path.is_file() {
            vec![path.clone()]
        } else {
            crate::import::import(path, m.model.architecture.as_deref())?.input_files
        };
        let provenance = crate::provenance::provenance(&manifest.text, &config.target_spec, flags, &inputs)?;
        let mut resolved = format!("{config:?}");
        let revision = crate::provenance::GIT_REVISION;
        if revision.ends_with("-dirty") || revision == "unknown" {
            let exe = std::env::current_exe().map_err(|e| Error::io("the maxc executable", e))?;
            let exe = crate::provenance::hash_file(&exe)?;
            resolved.push_str(&format!("\nmaxc executable: {} bytes, xxh3 {:016x}", exe.bytes, exe.xxh3));
        }
        Ok(Key { build_id: provenance.build_id, config: xxhash_rust::xxh3::xxh3_64(resolved.as_bytes()) })
    }

    /// The entry's file name without extension.
    pub fn name(&self) -> String {
        format!("{}-{:016x}", self.build_id, self.config)
    }
}

/// The whole-file checksum stored beside an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Checksum {
    xxh3_128: u128,
    bytes: u64,
}

impl Checksum {
    /// Streams `file` from its start.
    fn of(file: &mut File) -> std::io::Result<Checksum> {
        file.rewind()?;
        let mut state = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            state.update(&buf[..n]);
            bytes += n as u64;
        }
        Ok(Checksum { xxh3_128: state.digest128(), bytes })
    }

    fn to_line(self) -> String {
        format!("xxh3-128 {:032x} bytes {}\n", self.xxh3_128, self.bytes)
    }

    fn parse(text: &str) -> Option<Checksum> {
        let mut words = text.split_whitespace();
        let (Some("xxh3-128"), Some(hash), Some("bytes"), Some(bytes), None) = (words.next(), words.next(), words.next(), words.next(), words.next()) else {
            return None;
        };
        Some(Checksum { xxh3_128: u128::from_str_radix(hash, 16).ok()?, bytes: bytes.parse().ok()? })
    }
}

impl std::fmt::Display for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "xxh3-128 {:032x} over {} bytes", self.xxh3_128, self.bytes)
    }
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// A whole, verified entry; `file` is the open file that was verified.
    Hit { entry: PathBuf, file: File },
    /// No entry, or half of one: an artifact whose checksum is not written yet
    /// (a store in progress), or a checksum without its artifact.
    Miss,
    /// An entry that failed verification, now removed: why, for the warning.
    Corrupt { entry: PathBuf, reason: String },
}

/// How an entry became the output, or the output an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    HardLink,
    Copy,
}

impl Transfer {
    pub fn name(self) -> &'static str {
        match self {
            Transfer::HardLink => "hard link",
            Transfer::Copy => "copy",
        }
    }
}

/// A cache directory (created on the first store).
#[derive(Debug, Clone)]
pub struct Cache {
    pub dir: PathBuf,
}

impl Cache {
    pub fn new(dir: impl Into<PathBuf>) -> Cache {
        Cache { dir: dir.into() }
    }

    /// The artifact of `key`'s entry.
    pub fn entry(&self, key: &Key) -> PathBuf {
        self.dir.join(format!("{}.mef", key.name()))
    }

    fn checksum_path(entry: &Path) -> PathBuf {
        let mut name = entry.file_name().unwrap_or_default().to_os_string();
        name.push(".xxh3");
        entry.with_file_name(name)
    }

    /// Finds and verifies `key`'s entry: the whole file against its checksum,
    /// then its header (format, header and section checksums) and build id. A
    /// corrupt entry is removed, so that the rebuild replaces it.
    pub fn lookup(&self, key: &Key) -> Lookup {
        let entry = self.entry(key);
        let sum_path = Self::checksum_path(&entry);
        let corrupt = |reason: String| {
            let _ = std::fs::remove_file(&sum_path);
            let _ = std::fs::remove_file(&entry);
            Lookup::Corrupt { entry: entry.clone(), reason }
        };
        if !self.dir.is_dir() {
            // No cache yet, or a path that cannot be one (the store says so).
            return Lookup::Miss;
        }
        let expected = match std::fs::read_to_string(&sum_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Lookup::Miss,
            Err(e) => return corrupt(format!("its checksum file {} cannot be read: {e}", sum_path.display())),
        };
        let Some(expected) = Checksum::parse(&expected) else {
            return corrupt(format!("its checksum file {} is malformed", sum_path.display()));
        };
        let mut file = match File::open(&entry) {
            Ok(f) => f,
            // A checksum whose artifact was removed by hand: nothing to use.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Lookup::Miss,
            Err(e) => return corrupt(format!("it cannot be read: {e}")),
        };
        match Checksum::of(&mut file) {
            Ok(found) if found == expected => {}
            Ok(found) => return corrupt(format!("its contents give {found}, its checksum file says {expected}")),
            Err(e) => return corrupt(format!("it cannot be read: {e}")),
        }
        match maxrun_runtime::artifact::Artifact::open(&entry) {
            Ok(a) if a.header.provenance.build_id == key.build_id => Lookup::Hit { entry, file },
            Ok(a) => corrupt(format!("it records build id {}, not {}", a.header.provenance.build_id, key.build_id)),
            Err(e) => corrupt(format!("it is not a valid artifact: {e}")),
        }
    }

    /// Makes the verified entry of a [`Lookup::Hit`] the file at `output`:
    /// a hard link where both are on one filesystem, else a copy of the
    /// verified file; in either case through a temporary file renamed over the
    /// output.
    pub fn materialize(entry: &Path, file: &mut File, output: &Path) -> std::io::Result<Transfer> {
        link_or_copy(entry, file, output)
    }

    /// Stores the finished artifact at `artifact` as `key`'s entry (a hard link
    /// where possible, else a copy), then its checksum. Returns the entry.
    pub fn store(&self, key: &Key, artifact: &Path) -> std::io::Result<(PathBuf, Transfer)> {
        std::fs::create_dir_all(&self.dir)?;
        let mut file = File::open(artifact)?;
        let sum = Checksum::of(&mut file)?;
        let entry = self.entry(key);
        let how = link_or_copy(artifact, &mut file, &entry)?;
        maxrun_runtime::output::write_atomically(&Self::checksum_path(&entry), sum.to_line().as_bytes())?;
        Ok((entry, how))
    }
}

/// How one compile used the cache: for its messages and `--json`'s `cache` object.
#[derive(Debug)]
pub struct CacheUse {
    pub cache: Cache,
    pub key: Key,
    pub entry: PathBuf,
    /// `hit`, `miss`, `rebuilt` (a corrupt entry was found, removed and built
    /// again) or `store_only` (the compile writes debugging outputs, which only a
    /// build gives; its artifact is stored all the same).
    pub status: &'static str,
    /// How the entry became the output (a hit) or the output the entry (a store).
    pub transfer: Option<Transfer>,
    /// Problems with the cache, each one line; the compile goes on without it.
    pub warnings: Vec<String>,
    /// The cache's own phases: computing the key and looking it up, then
    /// putting the entry at the output (a hit) or storing the artifact.
    pub phases: Vec<Phase>,
}

impl CacheUse {
    /// Computes the key of this compile and, when `read`, looks it up: on a
    /// hit the entry is put at `output` and the compile is done.
    pub fn begin(dir: PathBuf, manifest: &LoadedManifest, flags: &[String], output: &Path, read: bool) -> Result<CacheUse> {
        let clock = std::time::Instant::now();
        let key = Key::compute(manifest, flags)?;
        let cache = Cache::new(dir);
        let entry = cache.entry(&key);
        let mut this = CacheUse { cache, key, entry, status: "store_only", transfer: None, warnings: Vec::new(), phases: Vec::new() };
        if !read {
            this.lap("cache key", clock);
            return Ok(this);
        }
        this.status = "miss";
        match this.cache.lookup(&this.key) {
            Lookup::Miss => this.lap("cache key + lookup", clock),
            Lookup::Corrupt { entry, reason } => {
                this.warnings.push(format!("cache entry {} is corrupt ({reason}); removed, building it again", entry.display()));
                this.status = "rebuilt";
                this.lap("cache key + lookup", clock);
            }
            Lookup::Hit { entry, mut file } => {
                this.lap("cache key + lookup", clock);
                let clock = std::time::Instant::now();
                if let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty() && !p.is_dir()) {
                    return Err(Error::invalid(output, "-o", format!("the output directory {} does not exist", parent.display())));
                }
                this.transfer = Some(Cache::materialize(&entry, &mut file, output).map_err(|e| Error::write(output, e))?);
                this.status = "hit";
                this.lap("cache to output", clock);
            }
        }
        Ok(this)
    }

    /// Whether the output came from the cache.
    pub fn hit(&self) -> bool {
        self.status == "hit"
    }

    /// After a build wrote `output`: stores it as this key's entry. A store
    /// that fails is a warning (returned; the artifact is written all the same).
    pub fn store(&mut self, output: &Path) -> Option<String> {
        let clock = std::time::Instant::now();
        let result = self.cache.store(&self.key, output);
        self.lap("cache store", clock);
        match result {
            Ok((_, how)) => {
                self.transfer = Some(how);
                None
            }
            Err(e) => {
                let w = format!("cache {}: cannot store the artifact: {e}; the artifact is written, the cache is not", self.cache.dir.display());
                self.warnings.push(w.clone());
                Some(w)
            }
        }
    }

    fn lap(&mut self, name: &'static str, since: std::time::Instant) {
        let (peak_rss_bytes, peak_anon_bytes) = (crate::resident::peak_rss_bytes(), crate::resident::anon_bytes());
        self.phases.push(Phase { name, wall_s: since.elapsed().as_secs_f64(), peak_rss_bytes, peak_anon_bytes });
    }

    /// `--json`'s and `--log-format json`'s `cache` object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "dir": self.cache.dir.display().to_string(),
            "key": self.key.name(),
            "entry": self.entry.display().to_string(),
            "status": self.status,
            "transfer": self.transfer.map(Transfer::name),
            "warnings": self.warnings,
        })
    }
}

/// Puts the file `source` (open as `file`) at `target` through a temporary
/// file beside it: a hard link when that gives the same file, else a copy of
/// `file`'s contents (synced before the rename).
fn link_or_copy(source: &Path, file: &mut File, target: &Path) -> std::io::Result<Transfer> {
    use std::os::unix::fs::MetadataExt;
    let tmp = maxrun_runtime::output::TempFile::new(target);
    let tmp_path = tmp.path().to_path_buf();
    let _ = std::fs::remove_file(&tmp_path);
    let source_meta = file.metadata()?;
    // The link is checked to name the very file that was verified (not one
    // renamed over `source` since).
    let linked = std::fs::hard_link(source, &tmp_path).is_ok()
        && std::fs::metadata(&tmp_path).is_ok_and(|m| m.dev() == source_meta.dev() && m.ino() == source_meta.ino());
    let how = if linked {
        Transfer::HardLink
    } else {
        let _ = std::fs::remove_file(&tmp_path);
        file.rewind()?;
        let mut out = File::create(&tmp_path)?;
        std::io::copy(file, &mut out)?;
        out.sync_all()?;
        Transfer::Copy
    };
    tmp.commit()?;
    // Renaming a link over another name of the same file does nothing (POSIX),
    // which leaves the temporary name when the target already was that file.
    if linked {
        let _ = std::fs::remove_file(&tmp_path);
    }
    Ok(how)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_lines_round_trip_and_reject_garbage() {
        let sum = Checksum { xxh3_128: 0x0123_4567_89ab_cdef_0011_2233_4455_6677, bytes: 4096 };
        assert_eq!(Checksum::parse(&sum.to_line()), Some(sum));
        for bad in ["", "xxh3-128 zz bytes 1", "xxh3-128 00 bytes", "xxh3-128 00 bytes 1 more", "md5 00 bytes 1"] {
            assert_eq!(Checksum::parse(bad), None, "{bad:?}");
        }
    }
}
