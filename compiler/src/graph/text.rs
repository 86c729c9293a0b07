//! The text form of the graph IR (`.mxir`): a printer and a parser that reads it back.
//!
//! ```text
//! graph "llama" {
//!   %0 = input "tokens" : i32[seq]
//!   %1 = weight "model.embed_tokens.weight" : f32[49152, 64]
//!   %2 = embedding %1, %0 : f32[seq, 64]
//!   %3 = rope %2, %4 {head_dim = 16, theta = 10000.0, scaling = none} : f32[seq, 64]
//!   output "logits" = %9
//! }
//! ```
//!
//! Floats print in Rust's shortest round-trip form, so `parse(print(g)) == g`
//! exactly; tests check it for every builder's graph.

use std::fmt::Write as _;

use super::infer::shape_str;
use super::ir::*;
use crate::error::{Error, Result};

/// Prints a graph in the text form.
pub fn print(graph: &Graph) -> String {
    let mut s = String::new();
    writeln!(s, "graph {} {{", quote(&graph.name)).unwrap();
    for (i, node) in graph.nodes.iter().enumerate() {
        write!(s, "  %{i} = {}", node.op.mnemonic()).unwrap();
        match &node.op {
            Op::Input { name, .. } | Op::Weight { name, .. } => write!(s, " {}", quote(name)).unwrap(),
            Op::Constant { values, .. } => {
                let v: Vec<String> = values.iter().map(|x| float(*x)).collect();
                write!(s, " [{}]", v.join(", ")).unwrap();
            }
            _ => {}
        }
        let inputs: Vec<String> = node.inputs.iter().map(|v| v.to_string()).collect();
        if !inputs.is_empty() {
            write!(s, " {}", inputs.join(", ")).unwrap();
        }
        let attrs = attributes(&node.op);
        if !attrs.is_empty() {
            write!(s, " {{{}}}", attrs.join(", ")).unwrap();
        }
        writeln!(s, " : {}", type_str(&node.ty)).unwrap();
    }
    for (name, v) in &graph.outputs {
        writeln!(s, "  output {} = {v}", quote(name)).unwrap();
    }
    s.push_str("}\n");
    s
}

/// Formats a type as `f32[seq, 64]`, with ` @sharded(1)` etc. when not replicated.
pub fn type_str(ty: &TensorType) -> String {
    let mut s = format!("{}{}", ty.dtype.name(), shape_str(&ty.shape));
    match ty.placement {
        Placement::Replicated => {}
        Placement::Sharded { axis } => write!(s, " @sharded({axis})").unwrap(),
        Placement::PartialSum => s.push_str(" @partial_sum"),
    }
    match ty.quant {
        WeightEncoding::Float32 => {}
        q => s.push_str(&format!(" quant({})", q.name())),
    }
    s
}

fn attributes(op: &Op) -> Vec<String> {
    match op {
        Op::Weight { shard: Some(sh), .. } => {
            vec![format!("shard_axis = {}", sh.axis), format!("shard_index = {}", sh.index), format!("shard_devices = {}", sh.devices)]
        }
        Op::AllGather { axis, devices } => vec![format!("axis = {axis}"), format!("devices = {devices}")],
        Op::ShardSlice { axis, index, devices } => vec![format!("axis = {axis}"), format!("index = {index}"), format!("devices = {devices}")],
        Op::Input { .. }
        | Op::Weight { shard: None, .. }
        | Op::AllReduce
        | Op::Constant { .. }
        | Op::Embedding
        | Op::MatMul
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::SwiGlu
        | Op::MeanRows
        | Op::L2Normalize
        | Op::Transpose
        | Op::MatMulAdd => vec![],
        Op::LayerNorm { eps } => vec![format!("eps = {}", float(*eps))],
        Op::RmsNorm { eps } => vec![format!("eps = {}", float(*eps))],
        Op::Rope { head_dim, theta, scaling } => {
            let scaling = match scaling {
                RopeScaling::None => "none".to_string(),
                RopeScaling::Linear { factor } => format!("linear({})", float(*factor)),
                RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => format!(
                    "llama3({}, {}, {}, {original_max_position})",
                    float(*factor),
                    float(*low_freq_factor),
                    float(*high_freq_factor)
                ),
                RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, truncate } => format!(
                    "yarn({}, {original_max_position}, {}, {}, {})",
                    float(*factor),
                    float(*beta_fast),
                    float(*beta_slow),
                    u8::from(*truncate)
                ),
                RopeScaling::FreqFactors(f) => {
                    let v: Vec<String> = f.iter().map(|x| float(*x)).collect();
                    format!("factors[{}]", v.join(", "))
                }
            };
            vec![format!("head_dim = {head_dim}"), format!("theta = {}", float(*theta)), format!("scaling = {scaling}")]
        }
        Op::Attention { layer, heads, kv_heads, head_dim, scale, window, softcap, causal, sinks } => {
            let mut a = vec![
                format!("layer = {layer}"),
                format!("heads = {heads}"),
                format!("kv_heads = {kv_heads}"),
                format!("head_dim = {head_dim}"),
                format!("scale = {}", float(*scale)),
                format!("window = {}", window.map_or("none".to_string(), |w| w.to_string())),
            ];
            if let Some(c) = softcap {
                a.push(format!("softcap = {}", float(*c)));
            }
            if !causal {
                a.push("causal = false".into());
            }
            if *sinks {
                a.push("sinks = true".into());
            }
            a
        }
        Op::Concat { axis } => vec![format!("axis = {axis}")],
        Op::Moe { experts, top_k, routing, activation, biases, shared } => {
            let mut a = vec![format!("experts = {experts}"), format!("top_k = {top_k}"), format!("routing = {}", routing.name())];
            if let MoeActivation::ClampedSwiGlu { alpha, limit } = activation {
                a.extend([format!("activation = {}", activation.name()), format!("swiglu_alpha = {}", float(*alpha)), format!("swiglu_limit = {}", float(*limit))]);
            }
            if *biases {
                a.push("biases = true".into());
            }
            if *shared {
                a.push("shared = true".into());
            }
            a
        }
        Op::Slice { axis, start, len } => {
            vec![format!("axis = {axis}"), format!("start = {start}"), format!("len = {len}")]
        }
    }
}

fn float(x: f32) -> String {
    let s = format!("{x:?}");
    if s.contains('.') || s.contains('e') || s.contains("inf") || s.contains("NaN") {
        s
    } else {
        format!("{s}.0")
    }
}

fn quote(s: &str) -> String {
    format!("{s:?}")
}

/// Lexical tokens of one line.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Value(u32),
    Ident(String),
    Num(String),
    Str(String),
    Punct(char),
}

fn lex(line: &str, lineno: usize) -> Result<Vec<Tok>> {
    let err = |m: String| Error::IrParse { line: lineno, message: m };
    let chars: Vec<char> = line.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '%' {
            let start = i + 1;
            i += 1;
            while i < chars.len() && chars[i].is_ascii_digit() {
                i += 1;
            }
            let digits: String = chars[start..i].iter().collect();
            toks.push(Tok::Value(digits.parse().map_err(|_| err(format!("bad value name `%{digits}`")))?));
        } else if c == '"' {
            let mut s = String::new();
            i += 1;
            loop {
                match chars.get(i) {
                    None => return Err(err("unterminated string".into())),
                    Some('"') => break,
                    Some('\\') => {
                        let e = chars.get(i + 1).ok_or_else(|| err("unterminated escape".into()))?;
                        s.push(match e {
                            'n' => '\n',
                            't' => '\t',
                            '"' => '"',
                            '\\' => '\\',
                            other => return Err(err(format!("unknown escape `\\{other}`"))),
                        });
                        i += 2;
                    }
                    Some(&ch) => {
                        s.push(ch);
                        i += 1;
                    }
                }
            }
            i += 1;
            toks.push(Tok::Str(s));
        } else if c.is_ascii_digit() || c == '-' {
            let start = i;
            i += 1;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '.' || ((chars[i] == '-' || chars[i] == '+') && chars[i - 1] == 'e'))
            {
                i += 1;
            }
            toks.push(Tok::Num(chars[start..i].iter().collect()));
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_' || chars[i] == '.') {
                i += 1;
            }
            toks.push(Tok::Ident(chars[start..i].iter().collect()));
        } else if "=,:[](){}@".contains(c) {
            toks.push(Tok::Punct(c));
            i += 1;
        } else {
            return Err(err(format!("unexpected character `{c}`")));
        }
    }
    Ok(toks)
}

/// A cursor over one line's tokens.
struct Cursor {
    toks: Vec<Tok>,
    pos: usize,
    line: usize,
}

impl Cursor {
    fn err<T>(&self, m: impl Into<String>) -> Result<T> {
        Err(Error::IrParse { line: self.line, message: m.into() })
    }
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        t
    }
    fn punct(&mut self, c: char) -> Result<()> {
        match self.next() {
            Some(Tok::Punct(p)) if p == c => Ok(()),
            other => self.err(format!("expected `{c}`, found {other:?}")),
        }
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn ident(&mut self) -> Result<String> {
        match self.next() {
            Some(Tok::Ident(s)) => Ok(s),
            other => self.err(format!("expected a name, found {other:?}")),
        }
    }
    fn string(&mut self) -> Result<String> {
        match self.next() {
            Some(Tok::Str(s)) => Ok(s),
            other => self.err(format!("expected a string, found {other:?}")),
        }
    }
    fn number<T: std::str::FromStr>(&mut self) -> Result<T> {
        match self.next() {
            Some(Tok::Num(s)) => s.parse().or_else(|_| self.err(format!("bad number `{s}`"))),
            Some(Tok::Ident(s)) if matches!(s.as_str(), "inf" | "NaN") => {
                s.parse().or_else(|_| self.err(format!("bad number `{s}`")))
            }
            other => self.err(format!("expected a number, found {other:?}")),
        }
    }
    fn floats(&mut self) -> Result<Vec<f32>> {
        self.punct('[')?;
        let mut v = Vec::new();
        if !self.eat(']') {
            loop {
                v.push(self.number()?);
                if self.eat(']') {
                    break;
                }
                self.punct(',')?;
            }
        }
        Ok(v)
    }
    fn done(&self) -> Result<()> {
        match self.peek() {
            None => Ok(()),
            Some(t) => self.err(format!("unexpected trailing {t:?}")),
        }
    }
}

fn parse_type(c: &mut Cursor) -> Result<TensorType> {
    let dt = c.ident()?;
    let dtype = GRAPH_DTYPES.into_iter().find(|d| d.name() == dt);
    let Some(dtype) = dtype else { return c.err(format!("unknown dtype `{dt}`")) };
    c.punct('[')?;
    let mut shape = Vec::new();
    if !c.eat(']') {
        loop {
            match c.next() {
                Some(Tok::Num(n)) => shape.push(Dim::Fixed(n.parse().or_else(|_| c.err(format!("bad dim `{n}`")))?)),
                Some(Tok::Ident(s)) => {
                    let sym = [SymDim::Seq, SymDim::Ctx, SymDim::Batch].into_iter().find(|d| d.name() == s);
                    match sym {
                        Some(d) => shape.push(Dim::Sym(d)),
                        None => return c.err(format!("unknown symbolic dim `{s}`")),
                    }
                }
                other => return c.err(format!("expected a dim, found {other:?}")),
            }
            if c.eat(']') {
                break;
            }
            c.punct(',')?;
        }
    }
    let mut ty = TensorType::new(dtype, shape);
    if c.eat('@') {
        ty.placement = match c.ident()?.as_str() {
            "replicated" => Placement::Replicated,
            "partial_sum" => Placement::PartialSum,
            "sharded" => {
                c.punct('(')?;
                let axis = c.number()?;
                c.punct(')')?;
                Placement::Sharded { axis }
            }
            other => return c.err(format!("unknown placement `{other}`")),
        };
    }
    if c.peek() == Some(&Tok::Ident("quant".into())) {
        c.next();
        c.punct('(')?;
        ty.quant = match maxc_format::WeightEncoding::from_name(&c.ident()?) {
            Some(e) if e != maxc_format::WeightEncoding::Float32 => e,
            _ => return c.err(format!("unknown quantization; expected one of {}", maxc_format::WeightEncoding::all_names())),
        };
        c.punct(')')?;
    }
    Ok(ty)
}

/// Parses `{k = v, ...}` into key / token-list pairs, consumed by `attr`.
fn parse_attrs(c: &mut Cursor) -> Result<Vec<(String, Vec<Tok>)>> {
    let mut attrs = Vec::new();
    if !c.eat('{') {
        return Ok(attrs);
    }
    loop {
        let key = c.ident()?;
        c.punct('=')?;
        let mut depth = 0;
        let mut toks = Vec::new();
        loop {
            match c.peek() {
                None => return c.err("unterminated attribute list"),
                Some(Tok::Punct('(' | '[')) => depth += 1,
                Some(Tok::Punct(')' | ']')) => depth -= 1,
                Some(Tok::Punct(',' | '}')) if depth == 0 => break,
                _ => {}
            }
            toks.push(c.next().unwrap());
        }
        attrs.push((key, toks));
        if c.eat('}') {
            break;
        }
        c.punct(',')?;
    }
    Ok(attrs)
}

struct Attrs {
    items: Vec<(String, Vec<Tok>)>,
    line: usize,
}

impl Attrs {
    /// A `true` / `false` attribute, `default` where it is absent.
    fn flag(&mut self, key: &str, default: bool) -> Result<bool> {
        if !self.items.iter().any(|(k, _)| k == key) {
            return Ok(default);
        }
        let mut c = self.take(key)?;
        match c.ident()?.as_str() {
            "true" => Ok(true),
            "false" => Ok(false),
            other => c.err(format!("{key} must be true or false, not `{other}`")),
        }
    }
    fn take(&mut self, key: &str) -> Result<Cursor> {
        let at = self.items.iter().position(|(k, _)| k == key);
        match at {
            Some(i) => Ok(Cursor { toks: self.items.remove(i).1, pos: 0, line: self.line }),
            None => Err(Error::IrParse { line: self.line, message: format!("missing attribute `{key}`") }),
        }
    }
    fn num<T: std::str::FromStr>(&mut self, key: &str) -> Result<T> {
        let mut c = self.take(key)?;
        let v = c.number()?;
        c.done()?;
        Ok(v)
    }
    fn finish(self) -> Result<()> {
        match self.items.first() {
            None => Ok(()),
            Some((k, _)) => Err(Error::IrParse { line: self.line, message: format!("unknown attribute `{k}`") }),
        }
    }
}

fn parse_scaling(c: &mut Cursor) -> Result<RopeScaling> {
    let kind = c.ident()?;
    let s = match kind.as_str() {
        "none" => RopeScaling::None,
        "linear" => {
            c.punct('(')?;
            let factor = c.number()?;
            c.punct(')')?;
            RopeScaling::Linear { factor }
        }
        "llama3" => {
            c.punct('(')?;
            let factor = c.number()?;
            c.punct(',')?;
            let low_freq_factor = c.number()?;
            c.punct(',')?;
            let high_freq_factor = c.number()?;
            c.punct(',')?;
            let original_max_position = c.number()?;
            c.punct(')')?;
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }
        }
        "yarn" => {
            c.punct('(')?;
            let factor = c.number()?;
            c.punct(',')?;
            let original_max_position = c.number()?;
            c.punct(',')?;
            let beta_fast = c.number()?;
            c.punct(',')?;
            let beta_slow = c.number()?;
            c.punct(',')?;
            let truncate: u32 = c.number()?;
            c.punct(')')?;
            RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, truncate: truncate != 0 }
        }
        "factors" => RopeScaling::FreqFactors(c.floats()?),
        other => return c.err(format!("unknown rope scaling `{other}`")),
    };
    c.done()?;
    Ok(s)
}

/// Parses the text form back into a graph (types are taken as written; run the verifier after).
pub fn parse(text: &str) -> Result<Graph> {
    let mut graph: Option<Graph> = None;
    let mut names: std::collections::HashMap<u32, ValueId> = Default::default();
    let mut closed = false;
    for (n, raw) in text.lines().enumerate() {
        let line = n + 1;
        let trimmed = raw.split("//").next().unwrap_or("").trim();
        if trimmed.is_empty() {
            continue;
        }
        let mut c = Cursor { toks: lex(trimmed, line)?, pos: 0, line };
        if closed {
            return c.err("text after the closing `}`");
        }
        let Some(g) = graph.as_mut() else {
            if c.ident()? != "graph" {
                return c.err("expected `graph \"name\" {`");
            }
            let name = c.string()?;
            c.punct('{')?;
            c.done()?;
            graph = Some(Graph::new(name));
            continue;
        };
        match c.next() {
            Some(Tok::Punct('}')) => {
                c.done()?;
                closed = true;
            }
            Some(Tok::Ident(kw)) if kw == "output" => {
                let name = c.string()?;
                c.punct('=')?;
                let v = match c.next() {
                    Some(Tok::Value(v)) => *names.get(&v).ok_or_else(|| Error::IrParse { line, message: format!("%{v} is not defined") })?,
                    other => return c.err(format!("expected a value, found {other:?}")),
                };
                c.done()?;
                g.output(name, v);
            }
            Some(Tok::Value(def)) => {
                c.punct('=')?;
                let mnemonic = c.ident()?;
                let (payload_name, payload_values) = match mnemonic.as_str() {
                    "input" | "weight" => (Some(c.string()?), None),
                    "constant" => (None, Some(c.floats()?)),
                    _ => (None, None),
                };
                let mut inputs = Vec::new();
                while let Some(Tok::Value(v)) = c.peek().cloned() {
                    c.next();
                    inputs.push(*names.get(&v).ok_or_else(|| Error::IrParse { line, message: format!("%{v} is not defined") })?);
                    if !c.eat(',') {
                        break;
                    }
                }
                let mut attrs = Attrs { items: parse_attrs(&mut c)?, line };
                c.punct(':')?;
                let ty = parse_type(&mut c)?;
                c.done()?;
                let op = match mnemonic.as_str() {
                    "input" => Op::Input { name: payload_name.unwrap(), ty: ty.clone() },
                    "weight" => Op::Weight {
                        name: payload_name.unwrap(),
                        ty: ty.clone(),
                        shard: if attrs.items.iter().any(|(k, _)| k == "shard_axis") {
                            Some(WeightShard { axis: attrs.num("shard_axis")?, index: attrs.num("shard_index")?, devices: attrs.num("shard_devices")? })
                        } else {
                            None
                        },
                    },
                    "all_reduce" => Op::AllReduce,
                    "all_gather" => Op::AllGather { axis: attrs.num("axis")?, devices: attrs.num("devices")? },
                    "shard_slice" => Op::ShardSlice { axis: attrs.num("axis")?, index: attrs.num("index")?, devices: attrs.num("devices")? },
                    "constant" => Op::Constant { values: payload_values.unwrap(), ty: ty.clone() },
                    "embedding" => Op::Embedding,
                    "matmul" => Op::MatMul,
                    "matmul_add" => Op::MatMulAdd,
                    "transpose" => Op::Transpose,
                    "layer_norm" => Op::LayerNorm { eps: attrs.num("eps")? },
                    "swiglu" => Op::SwiGlu,
                    "neg" => Op::Unary(UnaryOp::Neg),
                    "exp" => Op::Unary(UnaryOp::Exp),
                    "silu" => Op::Unary(UnaryOp::Silu),
                    "gelu_tanh" => Op::Unary(UnaryOp::GeluTanh),
                    "gelu" => Op::Unary(UnaryOp::Gelu),
                    "mean_rows" => Op::MeanRows,
                    "l2_normalize" => Op::L2Normalize,
                    "rsqrt" => Op::Unary(UnaryOp::Rsqrt),
                    "tanh" => Op::Unary(UnaryOp::Tanh),
                    "add" => Op::Binary(BinaryOp::Add),
                    "sub" => Op::Binary(BinaryOp::Sub),
                    "mul" => Op::Binary(BinaryOp::Mul),
                    "div" => Op::Binary(BinaryOp::Div),
                    "max" => Op::Binary(BinaryOp::Max),
                    "rms_norm" => Op::RmsNorm { eps: attrs.num("eps")? },
                    "rope" => Op::Rope {
                        head_dim: attrs.num("head_dim")?,
                        theta: attrs.num("theta")?,
                        scaling: parse_scaling(&mut attrs.take("scaling")?)?,
                    },
                    "attention" => Op::Attention {
                        layer: attrs.num("layer")?,
                        heads: attrs.num("heads")?,
                        kv_heads: attrs.num("kv_heads")?,
                        head_dim: attrs.num("head_dim")?,
                        scale: attrs.num("scale")?,
                        window: {
                            let mut w = attrs.take("window")?;
                            let v = match w.peek() {
                                Some(Tok::Ident(s)) if s == "none" => {
                                    w.next();
                                    None
                                }
                                _ => Some(w.number()?),
                            };
                            w.done()?;
                            v
                        },
                        softcap: if attrs.items.iter().any(|(k, _)| k == "softcap") { Some(attrs.num("softcap")?) } else { None },
                        causal: attrs.flag("causal", true)?,
                        sinks: attrs.flag("sinks", false)?,
                    },
                    "concat" => Op::Concat { axis: attrs.num("axis")? },
                    "moe" => Op::Moe {
                        experts: attrs.num("experts")?,
                        top_k: attrs.num("top_k")?,
                        routing: {
                            let mut r = attrs.take("routing")?;
                            let name = r.ident()?;
                            let routing = MoeRouting::from_name(&name).map_or_else(|| r.err(format!("routing must be softmax_topk, softmax_topk_norm or topk_softmax, not `{name}`")), Ok)?;
                            r.done()?;
                            routing
                        },
                        activation: if attrs.items.iter().any(|(k, _)| k == "activation") {
                            let mut a = attrs.take("activation")?;
                            match a.ident()?.as_str() {
                                "swiglu" => MoeActivation::SwiGlu,
                                "clamped_swiglu" => MoeActivation::ClampedSwiGlu { alpha: attrs.num("swiglu_alpha")?, limit: attrs.num("swiglu_limit")? },
                                other => return a.err(format!("activation must be swiglu or clamped_swiglu, not `{other}`")),
                            }
                        } else {
                            MoeActivation::SwiGlu
                        },
                        biases: attrs.flag("biases", false)?,
                        shared: attrs.flag("shared", false)?,
                    },
                    "slice" => Op::Slice { axis: attrs.num("axis")?, start: attrs.num("start")?, len: attrs.num("len")? },
                    other => return c.err(format!("unknown op `{other}`")),
                };
                attrs.finish()?;
                let id = g.push_typed(op, inputs, ty);
                if names.insert(def, id).is_some() {
                    return c.err(format!("%{def} is defined twice"));
                }
            }
            other => return c.err(format!("expected `%N = ...`, `output` or `}}`, found {other:?}")),
        }
    }
    match (graph, closed) {
        (Some(g), true) => Ok(g),
        _ => Err(Error::IrParse { line: text.lines().count(), message: "missing `graph \"name\" {` ... `}`".into() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_and_parses_every_op() {
        let text = r#"graph "all ops" {
  %0 = input "tokens" : i32[seq]
  %1 = input "positions" : i32[seq]
  %2 = weight "emb" : f32[10, 8]
  %3 = embedding %2, %0 : f32[seq, 8]
  %4 = constant [1.0, -2.5e-7, 3.0] : f32[3]
  %5 = weight "w" : f32[8]
  %6 = rms_norm %3, %5 {eps = 1e-5} : f32[seq, 8]
  %7 = rope %6, %1 {head_dim = 4, theta = 10000.0, scaling = llama3(8.0, 1.0, 4.0, 8192)} : f32[seq, 8]
  %8 = rope %6, %1 {head_dim = 4, theta = 10000.0, scaling = factors[1.0, 2.0]} : f32[seq, 8]
  %9 = rope %6, %1 {head_dim = 4, theta = 10000.0, scaling = linear(2.0)} : f32[seq, 8]
  %10 = attention %7, %8, %9, %1 {layer = 0, heads = 2, kv_heads = 2, head_dim = 4, scale = 0.5, window = 4} : f32[seq, 8]
  %11 = attention %7, %8, %9, %1 {layer = 1, heads = 2, kv_heads = 2, head_dim = 4, scale = 0.5, window = none, softcap = 50.0} : f32[seq, 8]
  %12 = concat %2, %2 {axis = 0} : f32[20, 8]
  %13 = matmul %11, %12 : f32[seq, 20]
  %14 = slice %13 {axis = 1, start = 4, len = 3} : f32[seq, 3]
  %15 = add %14, %4 : f32[seq, 3]
  %16 = silu %15 : f32[seq, 3]
  %17 = gelu_tanh %16 : f32[seq, 3]
  %18 = mul %17, %17 : f32[seq, 3]
  %19 = neg %18 : f32[seq, 3]
  %20 = sub %19, %4 : f32[seq, 3]
  %21 = div %20, %4 : f32[seq, 3]
  %22 = max %21, %4 : f32[seq, 3]
  %23 = exp %22 : f32[seq, 3]
  %24 = rsqrt %23 : f32[seq, 3]
  %25 = tanh %24 : f32[seq, 3]
  %26 = matmul %11, %2 : f32[seq, 10] @sharded(1)
  %27 = swiglu %13 : f32[seq, 10]
  %28 = matmul_add %11, %2, %27 : f32[seq, 10]
  %29 = transpose %2 : f32[8, 10]
  %30 = layer_norm %3, %5, %5 {eps = 1e-5} : f32[seq, 8]
  %31 = attention %7, %8, %9, %1 {layer = 2, heads = 2, kv_heads = 2, head_dim = 4, scale = 0.5, window = none, causal = false} : f32[seq, 8]
  %32 = mean_rows %31 : f32[1, 8]
  %33 = l2_normalize %32 : f32[1, 8]
  %34 = gelu %31 : f32[seq, 8]
  %35 = weight "q" : f32[10, 8] quant(bfloat16)
  %36 = concat %35, %35 {axis = 0} : f32[20, 8] quant(bfloat16)
  %37 = weight "router" : f32[2, 8]
  %38 = weight "gate_up" : f32[16, 8]
  %39 = weight "down" : f32[16, 4]
  %40 = moe %3, %37, %38, %39 {experts = 2, top_k = 1, routing = softmax_topk_norm} : f32[seq, 8]
  %41 = rope %6, %1 {head_dim = 4, theta = 150000.0, scaling = yarn(32.0, 4096, 32.0, 1.0, 0)} : f32[seq, 8]
  %42 = weight "router_bias" : f32[2]
  %43 = weight "gate_up_bias" : f32[2, 8]
  %44 = weight "down_bias" : f32[2, 8]
  %45 = moe %3, %37, %38, %39, %42, %43, %44 {experts = 2, top_k = 1, routing = topk_softmax, activation = clamped_swiglu, swiglu_alpha = 1.702, swiglu_limit = 7.0, biases = true} : f32[seq, 8]
  %46 = weight "shared_gate" : f32[1, 8]
  %47 = moe %3, %37, %38, %39, %46, %3 {experts = 2, top_k = 1, routing = softmax_topk, shared = true} : f32[seq, 8]
  output "out" = %25
  output "other" = %10
}
"#;
        let g = parse(text).unwrap();
        // The last matmul is typed sharded, which inference does not produce: the
        // verifier must notice, and the rest of the graph must be well formed.
        let err = crate::graph::verify::verify(&g).unwrap_err().to_string();
        assert!(err.contains("%26"), "{err}");
        let mut g2 = g.clone();
        g2.nodes[26].ty.placement = Placement::Replicated;
        crate::graph::verify::verify(&g2).unwrap();
        assert_eq!(print(&g), text);
        assert_eq!(parse(&print(&g)).unwrap(), g);
        assert_eq!(g.nodes[4].op, Op::Constant { values: vec![1.0, -2.5e-7, 3.0], ty: TensorType::fixed(DType::F32, &[3]) });
    }

    #[test]
    fn parse_errors_name_the_line() {
        let cases = [
            ("graph \"g\" {\n  %0 = frobnicate : f32[1]\n}\n", "unknown op"),
            ("graph \"g\" {\n  %0 = matmul %5, %6 : f32[1]\n}\n", "not defined"),
            ("graph \"g\" {\n  %0 = input \"x\" : q7[1]\n}\n", "unknown dtype"),
            ("graph \"g\" {\n  %0 = input \"x\" : f32[1]\n", "missing"),
            ("graph \"g\" {\n  %0 = input \"x\" : f32[1]\n  %1 = rms_norm %0, %0 : f32[1]\n}\n", "missing attribute `eps`"),
            ("graph \"g\" {\n  %0 = input \"x\" : f32[1]\n  %1 = slice %0 {axis = 0, start = 0, len = 1, bogus = 2} : f32[1]\n}\n", "unknown attribute"),
        ];
        for (text, want) in cases {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(want) && err.contains("line"), "{text:?}: {err}");
        }
    }
}
