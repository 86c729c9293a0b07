//! The pass pipeline: a [`Pass`] trait, the ordered list of passes, and the driver
//! that verifies after every pass and can dump the IR (`maxc compile --dump-ir`).

pub mod canonicalize;
pub mod const_fold;
pub mod cse;
pub mod dce;
pub mod fuse_matmul_add;
pub mod fuse_swiglu;
pub mod quantize;
pub mod shard;
pub mod stack_linear;

use std::path::Path;

use crate::error::{Error, Result};
use crate::graph::text::print;
use crate::graph::verify::verify;
use crate::graph::{Graph, Node, ValueId};

/// A graph-to-graph transformation that keeps the graph's outputs (checked by tests
/// against the reference interpreter).
pub trait Pass {
    /// The name used in dumps (`NN-<name>.mxir`) and `--stop-after`.
    fn name(&self) -> &'static str;
    /// Transforms the graph in place.
    fn run(&self, graph: &mut Graph) -> Result<()>;
}

/// The graph passes, in order, for float32 weights.
pub fn pipeline() -> Vec<Box<dyn Pass>> {
    pipeline_for(crate::graph::WeightEncoding::Float32)
}

/// The graph passes, in order, with linear weights stored as `encoding` (and the
/// embedding / lm_head as the quantize pass's default for it).
pub fn pipeline_for(encoding: crate::graph::WeightEncoding) -> Vec<Box<dyn Pass>> {
    pipeline_with(encoding, None, None, None)
}

/// The graph passes, in order, with linear weights stored as `encoding` and the
/// embedding table / lm_head as `embedding` (`None`: the default), for one device
/// of a mesh when `shard` is given (the shard pass runs only then).
pub fn pipeline_with(
    encoding: crate::graph::WeightEncoding,
    embedding: Option<crate::graph::WeightEncoding>,
    shard: Option<crate::sharding::ShardTarget>,
    stored: Option<std::sync::Arc<std::collections::HashMap<String, crate::graph::WeightEncoding>>>,
) -> Vec<Box<dyn Pass>> {
    let mut passes: Vec<Box<dyn Pass>> = vec![Box::new(canonicalize::Canonicalize), Box::new(const_fold::ConstantFold), Box::new(cse::Cse)];
    if let Some(target) = shard.filter(|t| t.devices > 1) {
        passes.push(Box::new(shard::Shard { target }));
    }
    passes.extend::<[Box<dyn Pass>; 5]>([
        Box::new(stack_linear::StackLinear { stored: stored.clone() }),
        Box::new(fuse_swiglu::FuseSwiGlu),
        Box::new(fuse_matmul_add::FuseMatMulAdd),
        Box::new(dce::Dce),
        Box::new(quantize::Quantize { encoding, embedding, stored }),
    ]);
    passes
}

/// Every pass name, in pipeline order, including `shard` (which runs only on a mesh).
pub fn pass_names() -> Vec<&'static str> {
    let mesh = crate::sharding::ShardTarget { index: 0, devices: 2, split_attention: true };
    pipeline_with(crate::graph::WeightEncoding::Float32, None, Some(mesh), None).iter().map(|p| p.name()).collect()
}

/// Finds a pass by name.
pub fn by_name(name: &str) -> Option<Box<dyn Pass>> {
    pipeline().into_iter().find(|p| p.name() == name)
}

/// How to run the pipeline.
#[derive(Debug, Default, Clone)]
pub struct PipelineOptions<'a> {
    /// Run the verifier after every pass (always on in debug builds and tests).
    pub verify_each: bool,
    /// Write `00-input.mxir` and `NN-<pass>.mxir` here.
    pub dump_dir: Option<&'a Path>,
    /// Stop after the pass of this name.
    pub stop_after: Option<&'a str>,
    /// The storage encoding of the linear layers' weights.
    pub encoding: crate::graph::WeightEncoding,
    /// The storage encoding of the embedding table and lm_head (`None`: default).
    pub embedding_encoding: Option<crate::graph::WeightEncoding>,
    /// `--quantization-encoding stored`: each weight's encoding by name (the
    /// checkpoint's own, or the nearest more precise one with kernels), in place
    /// of `encoding`.
    pub stored: Option<std::sync::Arc<std::collections::HashMap<String, crate::graph::WeightEncoding>>>,
    /// Build the graph of this device of a mesh (`None`: one device).
    pub shard: Option<crate::sharding::ShardTarget>,
}

/// Runs the pipeline over `graph`.
pub fn run_pipeline(graph: &mut Graph, options: &PipelineOptions<'_>) -> Result<()> {
    let verify_each = options.verify_each || cfg!(debug_assertions);
    if let Some(dir) = options.dump_dir {
        std::fs::create_dir_all(dir).map_err(|e| Error::write(dir, e))?;
        dump(dir, "00-input", graph)?;
    }
    verify(graph)?;
    for (i, pass) in pipeline_with(options.encoding, options.embedding_encoding, options.shard, options.stored.clone()).iter().enumerate() {
        pass.run(graph)?;
        if verify_each {
            verify(graph).map_err(|e| Error::Verify(format!("after pass `{}`: {e}", pass.name())))?;
        }
        if let Some(dir) = options.dump_dir {
            dump(dir, &format!("{:02}-{}", i + 1, pass.name()), graph)?;
        }
        if options.stop_after == Some(pass.name()) {
            break;
        }
    }
    Ok(())
}

fn dump(dir: &Path, stem: &str, graph: &Graph) -> Result<()> {
    let path = dir.join(format!("{stem}.mxir"));
    std::fs::write(&path, print(graph)).map_err(|e| Error::write(&path, e))
}

/// Rebuilds a graph node by node. `f` receives the new graph, the old node and its
/// inputs already mapped to new ids, and returns the new value that stands for the
/// old node (it may add several nodes, or return an existing value).
pub fn rewrite(
    graph: &Graph,
    mut f: impl FnMut(&mut Graph, ValueId, &Node, Vec<ValueId>) -> Result<ValueId>,
) -> Result<Graph> {
    let mut out = Graph::new(graph.name.clone());
    let mut map = Vec::with_capacity(graph.nodes.len());
    for (i, node) in graph.nodes.iter().enumerate() {
        let inputs = node.inputs.iter().map(|v| map[v.index()]).collect();
        map.push(f(&mut out, ValueId(i as u32), node, inputs)?);
    }
    out.outputs = graph.outputs.iter().map(|(n, v)| (n.clone(), map[v.index()])).collect();
    Ok(out)
}

/// Copies a node unchanged into the graph being rebuilt.
pub fn copy_node(g: &mut Graph, node: &Node, inputs: Vec<ValueId>) -> ValueId {
    g.push_typed(node.op.clone(), inputs, node.ty.clone())
}

/// How many times each value is used (graph outputs count as uses).
pub fn use_counts(graph: &Graph) -> Vec<usize> {
    let mut uses = vec![0; graph.nodes.len()];
    for n in &graph.nodes {
        for v in &n.inputs {
            uses[v.index()] += 1;
        }
    }
    for (_, v) in &graph.outputs {
        uses[v.index()] += 1;
    }
    uses
}
