//! The compile driver: manifest -> imported model -> graph -> passes, shared by the CLI and tests.

use std::path::Path;

use crate::builders::build_graph;
use crate::error::Result;
use crate::graph::Graph;
use crate::import::{import, ImportedModel};
use crate::manifest::LoadedManifest;
use crate::passes::{run_pipeline, PipelineOptions};

/// A model imported and lowered to an optimized graph.
#[derive(Debug)]
pub struct Frontend {
    pub manifest: LoadedManifest,
    pub model: ImportedModel,
    pub graph: Graph,
}

/// Imports the manifest's model and runs the graph pipeline.
pub fn frontend(manifest: LoadedManifest, options: &PipelineOptions<'_>) -> Result<Frontend> {
    let m = &manifest.manifest;
    let model = import(&m.model.path, m.model.architecture.as_deref())?;
    let mut graph = build_graph(&model)?;
    run_pipeline(&mut graph, options)?;
    Ok(Frontend { manifest, model, graph })
}

/// Loads a manifest file, or the default manifest for `--model PATH`.
pub fn load_manifest(manifest: Option<&Path>, model: Option<&Path>, overrides: &[String]) -> Result<LoadedManifest> {
    match (manifest, model) {
        (Some(m), _) => LoadedManifest::from_file(m, overrides),
        (None, Some(p)) => LoadedManifest::from_model_path(p, overrides),
        (None, None) => Err(crate::Error::Flag {
            flag: "MANIFEST".into(),
            message: "give a manifest file or --model PATH".into(),
        }),
    }
}
