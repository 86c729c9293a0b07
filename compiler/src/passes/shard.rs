//! Shard: rewrites the global graph into one device's graph of a tensor-parallel
//! mesh (Megatron-style), driven by the rule table in `sharding/rules`.
//!
//! 1. Demand: a backward sweep marks the values that every reader can take split
//!    by columns (a row-parallel matmul, element-wise ops and head-local ops on the
//!    way to one, the logits output). Only matmuls whose result is such a value
//!    are split by columns, so a split never runs into a reader that would gather
//!    it straight back.
//! 2. Propagation: a forward sweep asks each op's rule for the placements its
//!    inputs need and its result gets.
//! 3. Rewrite: the device's graph, with weights replaced by this device's slices
//!    (`weight ... {shard_axis, shard_index, shard_devices}`), attention over its
//!    share of the heads, and a reshard wherever a value arrives in another
//!    placement than its reader needs: `all_reduce` (partial sum -> whole),
//!    `all_gather` (split -> whole), `shard_slice` (whole -> this device's part).
//!
//! Every device's graph has the same ops and shapes; they differ only in which
//! slice of each weight they read (and so in the embedding's vocabulary range).

use std::collections::HashMap;

use super::Pass;
use crate::error::{Error, Result};
use crate::graph::{Graph, Op, Placement, TensorType, ValueId, WeightShard};
use crate::sharding::rules::{self, attention::local_attention, Decision, RuleCtx, COLUMNS};
use crate::sharding::ShardTarget;

pub struct Shard {
    pub target: ShardTarget,
}

impl Pass for Shard {
    fn name(&self) -> &'static str {
        "shard"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        if self.target.devices <= 1 {
            return Ok(());
        }
        let ctx = RuleCtx { devices: self.target.devices as u64, want_sharded: false, split_attention: self.target.split_attention };
        let ok = demand(graph, &ctx);
        let decisions = propagate(graph, &ctx, &ok);
        *graph = Rewriter::new(graph, &decisions, self.target).run()?;
        Ok(())
    }
}

/// For each value: whether all its readers take it split by columns.
fn demand(g: &Graph, ctx: &RuleCtx) -> Vec<bool> {
    let n = g.nodes.len();
    let mut readers: Vec<Vec<(ValueId, usize)>> = vec![Vec::new(); n];
    for id in g.ids() {
        for (slot, &i) in g.node(id).inputs.iter().enumerate() {
            readers[i.index()].push((id, slot));
        }
    }
    let mut output_ok = vec![None; n];
    for (name, v) in &g.outputs {
        // Split logits are gathered once at the end; other outputs are read whole.
        let accepted = name == "logits" && output_ok[v.index()] != Some(false);
        output_ok[v.index()] = Some(accepted);
    }
    let mut ok = vec![false; n];
    for i in (0..n).rev() {
        let used = !readers[i].is_empty() || output_ok[i].is_some();
        ok[i] = used
            && output_ok[i] != Some(false)
            && readers[i].iter().all(|&(r, slot)| rules::accepts_columns(g, r, slot, ok[r.index()], ctx));
    }
    ok
}

fn propagate(g: &Graph, ctx: &RuleCtx, ok: &[bool]) -> Vec<Decision> {
    let mut placement: Vec<Placement> = Vec::with_capacity(g.nodes.len());
    let mut decisions = Vec::with_capacity(g.nodes.len());
    for id in g.ids() {
        let have: Vec<Placement> = g.node(id).inputs.iter().map(|i| placement[i.index()]).collect();
        let d = rules::decide(g, id, &have, &RuleCtx { want_sharded: ok[id.index()], ..*ctx });
        placement.push(d.output);
        decisions.push(d);
    }
    decisions
}

struct Rewriter<'g> {
    old: &'g Graph,
    decisions: &'g [Decision],
    target: ShardTarget,
    new: Graph,
    /// (old value, placement) -> the new value holding it.
    at: HashMap<(ValueId, Placement), ValueId>,
}

impl<'g> Rewriter<'g> {
    fn new(old: &'g Graph, decisions: &'g [Decision], target: ShardTarget) -> Self {
        Rewriter { old, decisions, target, new: Graph::new(old.name.clone()), at: HashMap::new() }
    }

    fn run(mut self) -> Result<Graph> {
        let old = self.old;
        // Every placement each value is read in.
        let mut wanted: Vec<Vec<Placement>> = vec![Vec::new(); old.nodes.len()];
        for id in old.ids() {
            for (&i, &p) in old.node(id).inputs.iter().zip(&self.decisions[id.index()].inputs) {
                if !wanted[i.index()].contains(&p) {
                    wanted[i.index()].push(p);
                }
            }
        }
        for id in old.ids() {
            let node = old.node(id);
            match &node.op {
                // Leaves are emitted where they stood (weights first, as stack-linear
                // expects), once per placement they are read in.
                Op::Weight { .. } | Op::Constant { .. } => {
                    let mut placements = wanted[id.index()].clone();
                    if placements.is_empty() {
                        placements.push(Placement::Replicated);
                    }
                    for p in placements {
                        let v = self.leaf(id, p)?;
                        self.at.insert((id, p), v);
                    }
                }
                _ => {
                    let d = &self.decisions[id.index()];
                    let mut inputs = Vec::with_capacity(node.inputs.len());
                    for (&i, &p) in node.inputs.iter().zip(&d.inputs) {
                        inputs.push(self.get(i, p)?);
                    }
                    let op = if d.output == COLUMNS { local_attention(&node.op, self.target.devices) } else { node.op.clone() };
                    let v = self.add(op, &inputs)?;
                    let got = self.new.ty(v).placement;
                    if got != d.output {
                        return Err(Error::Verify(format!(
                            "shard: {id} ({}) was placed {:?} but its inputs give {got:?}",
                            node.op.mnemonic(),
                            d.output
                        )));
                    }
                    self.at.insert((id, d.output), v);
                }
            }
        }
        for (name, v) in &old.outputs {
            let local = self.get(*v, Placement::Replicated)?;
            self.new.output(name.clone(), local);
        }
        Ok(self.new)
    }

    fn add(&mut self, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
        let ty = crate::graph::infer::infer_type(&self.new, &op, inputs)
            .map_err(|e| Error::Verify(format!("shard: a {} on device {}: {e}", op.mnemonic(), self.target.index)))?;
        Ok(self.new.push_typed(op, inputs.to_vec(), ty))
    }

    /// This device's copy of leaf `id` in placement `p`.
    fn leaf(&mut self, id: ValueId, p: Placement) -> Result<ValueId> {
        let node = self.old.node(id);
        let Placement::Sharded { axis } = p else {
            return Ok(self.new.push_typed(node.op.clone(), vec![], node.ty.clone()));
        };
        let (index, devices) = (self.target.index, self.target.devices);
        let dims: Vec<usize> = node.ty.shape.iter().map(|d| d.fixed().expect("constants are static") as usize).collect();
        let a = axis as usize;
        if a >= dims.len() || !dims[a].is_multiple_of(devices as usize) {
            return Err(Error::Verify(format!("shard: {id} of shape {dims:?} does not split into {devices} parts along axis {axis}")));
        }
        let len = dims[a] / devices as usize;
        let mut ty = TensorType { placement: p, ..node.ty.clone() };
        ty.shape[a] = crate::graph::Dim::Fixed(len as u64);
        let op = match &node.op {
            Op::Weight { name, shard: None, .. } => {
                Op::Weight { name: name.clone(), ty: ty.clone(), shard: Some(WeightShard { axis, index, devices }) }
            }
            Op::Constant { values, .. } => {
                Op::Constant { values: crate::interp::slice_axis(values, &dims, a, index as usize * len, len), ty: ty.clone() }
            }
            other => return Err(Error::Verify(format!("shard: cannot split leaf {id} ({})", other.mnemonic()))),
        };
        Ok(self.new.push_typed(op, vec![], ty))
    }

    /// The new value holding old value `v` in placement `p`, adding reshards as needed.
    fn get(&mut self, v: ValueId, p: Placement) -> Result<ValueId> {
        if let Some(&x) = self.at.get(&(v, p)) {
            return Ok(x);
        }
        let have = self.decisions[v.index()].output;
        let (index, devices) = (self.target.index, self.target.devices);
        let x = match (have, p) {
            (Placement::PartialSum, Placement::Replicated) => {
                let src = self.get(v, have)?;
                self.add(Op::AllReduce, &[src])?
            }
            (Placement::Sharded { axis }, Placement::Replicated) => {
                let src = self.get(v, have)?;
                self.add(Op::AllGather { axis, devices }, &[src])?
            }
            (_, Placement::Sharded { axis }) => {
                let whole = self.get(v, Placement::Replicated)?;
                self.add(Op::ShardSlice { axis, index, devices }, &[whole])?
            }
            (_, Placement::PartialSum) | (Placement::Replicated, Placement::Replicated) => {
                return Err(Error::Verify(format!("shard: no reshard from {have:?} to {p:?} for {v}")))
            }
        };
        self.at.insert((v, p), x);
        Ok(x)
    }
}
