//! Every example manifest in manifests/ parses; those whose model is present compile.

use maxc::driver::frontend;
use maxc::manifest::LoadedManifest;
use maxc::passes::PipelineOptions;
use maxc_tests::workspace_root;

#[test]
fn example_manifests_parse_and_local_ones_build() {
    let dir = workspace_root().join("manifests");
    let mut built = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let m = LoadedManifest::from_file(&path, &[]).unwrap_or_else(|e| panic!("{e}"));
        if m.manifest.model.path.exists() {
            let fe = frontend(m, &PipelineOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(fe.graph.count("attention") > 0);
            built += 1;
        }
    }
    assert!(built >= 3, "the fixture and SmolLM2 manifests must build");
}
