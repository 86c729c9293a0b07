//! The `maxrun` command line.

fn main() {
    eprintln!("maxrun: artifact execution is not built yet (issue #3)");
    std::process::exit(2);
}
