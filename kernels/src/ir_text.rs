//! A text form of the kernel IR that round-trips: [`print()`] writes a whole
//! [`Kernel`] as readable, indented lines and [`parse()`] reads it back, so that
//! `parse(&print(&k)) == Ok(k)` for every kernel, and the text keeps every
//! float's bits (NaN payloads included).
//!
//! # Grammar
//!
//! Whitespace and line breaks only separate tokens; `#` starts a comment that
//! runs to the end of the line. Sections and the fields of a dot statement come
//! in the order shown, and declarations are numbered from 0 in order.
//!
//! ```text
//! kernel   := "kernel" STRING "{"
//!               "family" STRING
//!               "tasks" "per_seq" U64 "fixed" U64
//!               "task_var" VAR
//!               ["float_order" "ordered"]        # FloatOrder::Ordered; absent: reassociable
//!               "params" "{" (PARAM STRING elem ("read" | "write"))* "}"
//!               "locals" "{" (LOCAL U64)* "}"        # element counts
//!               "vars" "{" (VAR valtype)* "}"
//!               "body" block
//!             "}"
//! block    := "{" stmt* "}"
//! stmt     := "set" VAR "=" expr
//!           | "store" BUF "[" expr "]" "=" expr
//!           | ("for" | "for_vec") VAR "in" expr ".." expr block  # for_vec: LoopHint::Vectorize
//!           | "if" expr block
//!           | "prefetch" PARAM "[" expr "]"
//!           | "dot_block" "{" "acc" LOCAL "scales" "[" expr "," expr "]" "weights" PARAM
//!               "w_start" expr "form" ("int8" | "nibble_pairs") "act" PARAM "act_start" expr "}"
//!           | "pair_dot" "{" "acc" LOCAL "weights" PARAM "w_start" expr "act" PARAM
//!               "act_start" expr "}"
//!           | "widen_bf16" "{" "dst" LOCAL "weights" PARAM "start" expr "}"
//!           | "dot_rows" "{" "acc" LOCAL "weights" PARAM "w_start" expr
//!               "form" ("nibbles" | "bytes" | ("nibbles5" | "nibbles6") "high_bits" PARAM "at" expr)
//!               "act" PARAM "act_start" expr
//!               "act_levels" ("bytes" | "planes" "low" expr | "words")
//!               "act_scales" "[" expr "," expr "]"
//!               ["half_sums" ("none" | PARAM "at" expr)]   # forms with two halves (nibbles6)
//!               "row_scales" rowscale
//!               "row_min" ("offset" F32 | "stored" rowscale | "subtracted" rowscale)
//!               "prefetch_ahead" ("none" | I64) "}"
//! rowscale := "values" PARAM "at" expr "factors" ("none" | PARAM "at" expr)
//! expr     := I64 | F32 | VAR | "seq" | BUF "[" expr "]"            # a load
//!           | "(" expr binop expr ")" | "(" expr ")"
//!           | ("max" | "min") "(" expr "," expr ")"
//!           | unop "(" expr ")" | "select" "(" expr "," expr "," expr ")"
//!           | "fma" "(" expr "," expr "," expr ")"          # a * b + c, rounded once
//! binop    := "+" | "-" | "*" | "/" | "%" | "<<" | ">>" | "&" | "<" | "<=" | "=="
//! unop     := "neg" | "exp" | "sqrt" | "tanh" | "cos" | "sin" | "to_f32" | "floor"
//!           | "to_i64" | "bits_to_f32" | "half_bits_to_f32"
//! elem     := "f32" | "i32" | "bf16" | "f16" | "i8" | "u8"
//! valtype  := "f32" | "i64" | "bool"
//! ```
//!
//! `VAR` is `v` and a variable id (`v3`), `PARAM` is `p` and a parameter index
//! ([`ParamId`]) and `LOCAL` is `l` and a local index ([`LocalId`]); `BUF`
//! is either ([`Buf`]). `STRING` is double-quoted, with `\"`, `\\`, `\n`, `\r`, `\t`,
//! `\0` and `\u{HEX}` escapes. An `I64` is a decimal integer (`-5`), an `F32`
//! a decimal number with a `.` or an exponent (`0.5`, `-1.4286068e-6`), or
//! `f32(0x7fc00000)` by its bits (how [`print()`] writes infinities and NaNs).
//!
//! # Example
//!
//! ```text
//! kernel "double_w4_sN" {
//!   family "elementwise"
//!   tasks per_seq 1 fixed 0
//!   task_var v0
//!   params {
//!     p0 "x" f32 read
//!     p1 "out" f32 write
//!   }
//!   locals {
//!   }
//!   vars {
//!     v0 i64
//!     v1 i64
//!   }
//!   body {
//!     for_vec v1 in 0 .. 4 {
//!       store p1[((v0 * 4) + v1)] = (p0[((v0 * 4) + v1)] * 2.0)
//!     }
//!   }
//! }
//! ```

use std::fmt;

use crate::ir::*;

/// What the parser's steps return.
type PResult<T> = Result<T, ParseError>;

/// How deep expressions and blocks may nest in parsed text (deeper input is an
/// error, not a stack overflow; library kernels nest at most about 40 deep).
const MAX_DEPTH: usize = 256;

/// An error in kernel text: where it is and what the grammar wanted there.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}, column {column}: expected {expected}, found {found}")]
pub struct ParseError {
    /// The line of the offending token, from 1.
    pub line: usize,
    /// The column of the offending token's first character, from 1.
    pub column: usize,
    /// What the grammar allows at that point.
    pub expected: String,
    /// What the text holds there.
    pub found: String,
}

/// The text form of `kernel` (see the module documentation for its grammar).
pub fn print(kernel: &Kernel) -> String {
    KernelText(kernel).to_string()
}

/// Reads a kernel from its text form (the inverse of [`print()`]). The result is
/// not validated: call [`Kernel::validate`] for that.
///
/// # Errors
///
/// A [`ParseError`] at the first token (or character) that does not fit the
/// grammar, numbers out of range for their field included.
pub fn parse(text: &str) -> Result<Kernel, ParseError> {
    let tokens = Lexer::new(text).tokens()?;
    let mut parser = Parser { tokens, at: 0, depth: 0 };
    let kernel = parser.kernel()?;
    match parser.peek().tok {
        Tok::End => Ok(kernel),
        _ => Err(parser.error("end of input")),
    }
}

// ---------------------------------------------------------------- printing

struct KernelText<'k>(&'k Kernel);

impl fmt::Display for KernelText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let k = self.0;
        writeln!(f, "kernel {} {{", Quoted(&k.name))?;
        writeln!(f, "  family {}", Quoted(&k.family))?;
        writeln!(f, "  tasks per_seq {} fixed {}", k.tasks.per_seq, k.tasks.fixed)?;
        writeln!(f, "  task_var v{}", k.task_var)?;
        if k.float_order == FloatOrder::Ordered {
            writeln!(f, "  float_order ordered")?;
        }
        writeln!(f, "  params {{")?;
        for (i, p) in k.params.iter().enumerate() {
            writeln!(f, "    p{i} {} {} {}", Quoted(&p.name), p.elem.name(), if p.writes { "write" } else { "read" })?;
        }
        writeln!(f, "  }}\n  locals {{")?;
        for (i, len) in k.locals.iter().enumerate() {
            writeln!(f, "    l{i} {len}")?;
        }
        writeln!(f, "  }}\n  vars {{")?;
        for (i, t) in k.vars.iter().enumerate() {
            writeln!(f, "    v{i} {}", val_name(*t))?;
        }
        writeln!(f, "  }}")?;
        write!(f, "  body ")?;
        block(f, &k.body, 1)?;
        writeln!(f, "}}")
    }
}

/// Writes `{`, the statements one level deeper than `depth`, and `}` at `depth`, then a line break.
fn block(f: &mut fmt::Formatter<'_>, body: &[Stmt], depth: usize) -> fmt::Result {
    writeln!(f, "{{")?;
    for s in body {
        stmt(f, s, depth + 1)?;
    }
    writeln!(f, "{:w$}}}", "", w = 2 * depth)
}

fn stmt(f: &mut fmt::Formatter<'_>, s: &Stmt, depth: usize) -> fmt::Result {
    let pad = 2 * depth;
    write!(f, "{:pad$}", "")?;
    match s {
        Stmt::Set { var, value } => writeln!(f, "set v{var} = {}", E(value)),
        Stmt::Store { buf, index, value } => writeln!(f, "store {buf}[{}] = {}", E(index), E(value)),
        Stmt::For { var, start, end, hint, body } => {
            let keyword = match hint {
                LoopHint::Serial => "for",
                LoopHint::Vectorize => "for_vec",
            };
            write!(f, "{keyword} v{var} in {} .. {} ", E(start), E(end))?;
            block(f, body, depth)
        }
        Stmt::If { cond, then } => {
            write!(f, "if {} ", E(cond))?;
            block(f, then, depth)
        }
        Stmt::Prefetch { param, index } => writeln!(f, "prefetch {param}[{}]", E(index)),
        Stmt::DotBlock { acc, scales, weights, w_start, form, act, act_start } => {
            let form = match form {
                DotForm::Int8 => "int8",
                DotForm::NibblePairs => "nibble_pairs",
            };
            writeln!(f, "dot_block {{")?;
            let field = pad + 2;
            writeln!(f, "{:field$}acc {}", "", acc)?;
            writeln!(f, "{:field$}scales [{}, {}]", "", E(&scales[0]), E(&scales[1]))?;
            writeln!(f, "{:field$}weights {}", "", weights)?;
            writeln!(f, "{:field$}w_start {}", "", E(w_start))?;
            writeln!(f, "{:field$}form {form}", "")?;
            writeln!(f, "{:field$}act {}", "", act)?;
            writeln!(f, "{:field$}act_start {}", "", E(act_start))?;
            writeln!(f, "{:pad$}}}", "")
        }
        Stmt::PairDot { acc, weights, w_start, act, act_start } => {
            writeln!(f, "pair_dot {{")?;
            let field = pad + 2;
            writeln!(f, "{:field$}acc {}", "", acc)?;
            writeln!(f, "{:field$}weights {}", "", weights)?;
            writeln!(f, "{:field$}w_start {}", "", E(w_start))?;
            writeln!(f, "{:field$}act {}", "", act)?;
            writeln!(f, "{:field$}act_start {}", "", E(act_start))?;
            writeln!(f, "{:pad$}}}", "")
        }
        Stmt::WidenBf16 { dst, weights, start } => {
            writeln!(f, "widen_bf16 {{")?;
            let field = pad + 2;
            writeln!(f, "{:field$}dst {}", "", dst)?;
            writeln!(f, "{:field$}weights {}", "", weights)?;
            writeln!(f, "{:field$}start {}", "", E(start))?;
            writeln!(f, "{:pad$}}}", "")
        }
        Stmt::DotRows(d) => {
            let name = match d.form {
                RowsForm::Nibbles => "nibbles",
                RowsForm::Bytes => "bytes",
                RowsForm::Nibbles5 => "nibbles5",
                RowsForm::Nibbles6 => "nibbles6",
            };
            let form = match (d.form.high_bit_count() > 0, &d.high_bits) {
                (false, _) => name.to_string(),
                (true, Some((p, start))) => format!("{name} high_bits {p} at {}", E(start)),
                (true, None) => format!("{name} high_bits none"),
            };
            writeln!(f, "dot_rows {{")?;
            let field = pad + 2;
            writeln!(f, "{:field$}acc {}", "", d.acc)?;
            writeln!(f, "{:field$}weights {}", "", d.weights)?;
            writeln!(f, "{:field$}w_start {}", "", E(&d.w_start))?;
            writeln!(f, "{:field$}form {form}", "")?;
            writeln!(f, "{:field$}act {}", "", d.act)?;
            writeln!(f, "{:field$}act_start {}", "", E(&d.act_start))?;
            match &d.act_levels {
                ActLevels::Bytes => writeln!(f, "{:field$}act_levels bytes", "")?,
                ActLevels::Planes { low } => writeln!(f, "{:field$}act_levels planes low {}", "", E(low))?,
                ActLevels::Words => writeln!(f, "{:field$}act_levels words", "")?,
                ActLevels::WordPairs => writeln!(f, "{:field$}act_levels word_pairs", "")?,
            }
            writeln!(f, "{:field$}act_scales [{}, {}]", "", E(&d.act_scales[0]), E(&d.act_scales[1]))?;
            if d.form.halves() > 1 {
                match &d.half_sums {
                    Some((p, start)) => writeln!(f, "{:field$}half_sums {p} at {}", "", E(start))?,
                    None => writeln!(f, "{:field$}half_sums none", "")?,
                }
            }
            writeln!(f, "{:field$}row_scales {}", "", Scale(&d.row_scales))?;
            match &d.row_min {
                RowMin::Offset(o) => writeln!(f, "{:field$}row_min offset {}", "", F32Lit(*o))?,
                RowMin::Stored(r) => writeln!(f, "{:field$}row_min stored {}", "", Scale(r))?,
                RowMin::Subtracted(r) => writeln!(f, "{:field$}row_min subtracted {}", "", Scale(r))?,
            }
            match d.prefetch_ahead {
                None => writeln!(f, "{:field$}prefetch_ahead none", "")?,
                Some(n) => writeln!(f, "{:field$}prefetch_ahead {n}", "")?,
            }
            writeln!(f, "{:pad$}}}", "")
        }
    }
}

/// An expression in the text form.
struct E<'e>(&'e Expr);

impl fmt::Display for E<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Expr::F32(x) => write!(f, "{}", F32Lit(*x)),
            Expr::I64(x) => write!(f, "{x}"),
            Expr::Var(v) => write!(f, "v{v}"),
            Expr::Seq => f.write_str("seq"),
            Expr::Load { buf, index } => write!(f, "{buf}[{}]", E(index)),
            Expr::Bin(op @ (BinOp::Max | BinOp::Min), a, b) => write!(f, "{}({}, {})", if *op == BinOp::Max { "max" } else { "min" }, E(a), E(b)),
            Expr::Bin(op, a, b) => write!(f, "({} {} {})", E(a), bin_symbol(*op), E(b)),
            Expr::Cmp(op, a, b) => write!(f, "({} {} {})", E(a), cmp_symbol(*op), E(b)),
            Expr::Un(op, a) => write!(f, "{}({})", un_name(*op), E(a)),
            Expr::Select(c, a, b) => write!(f, "select({}, {}, {})", E(c), E(a), E(b)),
            Expr::MulAdd(a, b, c) => write!(f, "fma({}, {}, {})", E(a), E(b), E(c)),
        }
    }
}

/// An f32 literal: the shortest decimal that reads back to the same bits, or
/// `f32(0x...)` (infinities, NaNs).
struct F32Lit(f32);

impl fmt::Display for F32Lit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let x = self.0;
        if x.is_finite() {
            let text = format!("{x:?}");
            let float_like = text.contains(['.', 'e']);
            if float_like && text.parse::<f32>().map(f32::to_bits) == Ok(x.to_bits()) {
                return f.write_str(&text);
            }
        }
        write!(f, "f32(0x{:08x})", x.to_bits())
    }
}

/// A [`RowScale`]: `values PARAM at EXPR factors (none | PARAM at EXPR)`.
struct Scale<'s>(&'s RowScale);

impl fmt::Display for Scale<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (p, start) = &self.0.values;
        write!(f, "values {} at {} factors ", p, E(start))?;
        match &self.0.factors {
            None => f.write_str("none"),
            Some((p, start)) => write!(f, "{} at {}", p, E(start)),
        }
    }
}

/// A string in double quotes, with `"`, `\`, control characters and
/// whitespace other than the space escaped.
struct Quoted<'s>(&'s str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"")?;
        for c in self.0.chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                '\0' => f.write_str("\\0")?,
                c if c.is_control() || (c.is_whitespace() && c != ' ') => write!(f, "\\u{{{:x}}}", c as u32)?,
                c => write!(f, "{c}")?,
            }
        }
        f.write_str("\"")
    }
}

// ---------------------------------------------------------------- names

// Every variant of the name-bearing enums; the names themselves are stated once,
// in the printer's exhaustive matches below, and the parser looks them up there.
const VAL_TYPES: [ValType; 3] = [ValType::F32, ValType::I64, ValType::Bool];
const UN_OPS: [UnOp; 11] = [UnOp::Neg, UnOp::Exp, UnOp::Sqrt, UnOp::Tanh, UnOp::Cos, UnOp::Sin, UnOp::ToF32, UnOp::Floor, UnOp::ToI64, UnOp::BitsToF32, UnOp::HalfBitsToF32];

/// The unary operator named `name`.
fn un_op_named(name: &str) -> Option<UnOp> {
    UN_OPS.into_iter().find(|&op| un_name(op) == name)
}

fn val_name(t: ValType) -> &'static str {
    match t {
        ValType::F32 => "f32",
        ValType::I64 => "i64",
        ValType::Bool => "bool",
    }
}

fn un_name(op: UnOp) -> &'static str {
    match op {
        UnOp::Neg => "neg",
        UnOp::Exp => "exp",
        UnOp::Sqrt => "sqrt",
        UnOp::Tanh => "tanh",
        UnOp::Cos => "cos",
        UnOp::Sin => "sin",
        UnOp::ToF32 => "to_f32",
        UnOp::Floor => "floor",
        UnOp::ToI64 => "to_i64",
        UnOp::BitsToF32 => "bits_to_f32",
        UnOp::HalfBitsToF32 => "half_bits_to_f32",
    }
}

/// The infix symbol of a binary operator (`max` and `min` print as calls).
fn bin_symbol(op: BinOp) -> &'static str {
    match op {
        BinOp::Add => "+",
        BinOp::Sub => "-",
        BinOp::Mul => "*",
        BinOp::Div => "/",
        BinOp::Rem => "%",
        BinOp::Max => "max",
        BinOp::Min => "min",
        BinOp::Shl => "<<",
        BinOp::Shr => ">>",
        BinOp::And => "&",
    }
}

fn cmp_symbol(op: CmpOp) -> &'static str {
    match op {
        CmpOp::Lt => "<",
        CmpOp::Le => "<=",
        CmpOp::Eq => "==",
    }
}

/// The operator an infix symbol stands for.
enum Infix {
    Bin(BinOp),
    Cmp(CmpOp),
}

fn infix(symbol: &str) -> Option<Infix> {
    Some(match symbol {
        "+" => Infix::Bin(BinOp::Add),
        "-" => Infix::Bin(BinOp::Sub),
        "*" => Infix::Bin(BinOp::Mul),
        "/" => Infix::Bin(BinOp::Div),
        "%" => Infix::Bin(BinOp::Rem),
        "<<" => Infix::Bin(BinOp::Shl),
        ">>" => Infix::Bin(BinOp::Shr),
        "&" => Infix::Bin(BinOp::And),
        "<" => Infix::Cmp(CmpOp::Lt),
        "<=" => Infix::Cmp(CmpOp::Le),
        "==" => Infix::Cmp(CmpOp::Eq),
        _ => return None,
    })
}

// ---------------------------------------------------------------- lexing

fn error((line, column): (usize, usize), expected: &str, found: String) -> ParseError {
    ParseError { line, column, expected: expected.into(), found }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    /// A keyword or a name (`set`, `v3`, `p0`, `max`).
    Ident(String),
    /// Decimal digits (a sign is a separate `-`).
    Int(String),
    /// Decimal digits with a fraction or an exponent.
    Float(String),
    /// `0x` and hex digits.
    Hex(String),
    /// A string literal, unescaped.
    Str(String),
    Punct(&'static str),
    End,
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: usize,
    column: usize,
}

impl Token {
    fn describe(&self) -> String {
        match &self.tok {
            Tok::Ident(s) | Tok::Int(s) | Tok::Float(s) | Tok::Hex(s) => format!("`{s}`"),
            Tok::Str(s) => format!("string {}", Quoted(s)),
            Tok::Punct(p) => format!("`{p}`"),
            Tok::End => "end of input".into(),
        }
    }
}

const PUNCTS: [&str; 20] = ["..", "<<", ">>", "<=", "==", "(", ")", "[", "]", "{", "}", ",", "=", "<", "+", "-", "*", "/", "%", "&"];

struct Lexer {
    chars: Vec<char>,
    at: usize,
    line: usize,
    column: usize,
}

impl Lexer {
    fn new(text: &str) -> Self {
        Lexer { chars: text.chars().collect(), at: 0, line: 1, column: 1 }
    }

    fn peek_at(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.at + ahead).copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek_at(0)?;
        self.at += 1;
        if c == '\n' {
            self.line += 1;
            self.column = 1;
        } else {
            self.column += 1;
        }
        Some(c)
    }

    fn found_here(&self) -> String {
        match self.peek_at(0) {
            None => "end of input".into(),
            Some('\n') => "end of line".into(),
            Some(c) => format!("{c:?}"),
        }
    }

    fn tokens(mut self) -> PResult<Vec<Token>> {
        let mut out = Vec::new();
        loop {
            while let Some(c) = self.peek_at(0) {
                if c == '#' {
                    while self.peek_at(0).is_some_and(|c| c != '\n') {
                        self.bump();
                    }
                } else if c.is_whitespace() {
                    self.bump();
                } else {
                    break;
                }
            }
            let (line, column) = (self.line, self.column);
            let Some(c) = self.peek_at(0) else {
                out.push(Token { tok: Tok::End, line, column });
                return Ok(out);
            };
            let tok = if c.is_ascii_alphabetic() || c == '_' {
                let mut s = String::new();
                while let Some(c) = self.peek_at(0).filter(|c| c.is_ascii_alphanumeric() || *c == '_') {
                    s.push(c);
                    self.bump();
                }
                Tok::Ident(s)
            } else if c.is_ascii_digit() {
                self.number((line, column))?
            } else if c == '"' {
                self.string((line, column))?
            } else if let Some(p) = PUNCTS.iter().find(|p| p.chars().enumerate().all(|(i, pc)| self.peek_at(i) == Some(pc))) {
                for _ in 0..p.len() {
                    self.bump();
                }
                Tok::Punct(p)
            } else {
                return Err(error((line, column), "a token", format!("{c:?}")));
            };
            out.push(Token { tok, line, column });
        }
    }

    /// Appends the (hex) digits at the cursor to `text`; returns how many.
    fn digits(&mut self, text: &mut String, hex: bool) -> usize {
        let mut n = 0;
        while let Some(c) = self.peek_at(0).filter(|c| if hex { c.is_ascii_hexdigit() } else { c.is_ascii_digit() }) {
            text.push(c);
            self.bump();
            n += 1;
        }
        n
    }

    /// A number: `0x` and hex digits, or decimal digits with an optional
    /// fraction and exponent.
    fn number(&mut self, start: (usize, usize)) -> PResult<Tok> {
        let mut text = String::new();
        let hex = self.peek_at(0) == Some('0') && matches!(self.peek_at(1), Some('x' | 'X'));
        let mut float = false;
        if hex {
            text.push_str("0x");
            self.bump();
            self.bump();
            if self.digits(&mut text, true) == 0 {
                return Err(error((self.line, self.column), "hex digits", self.found_here()));
            }
        } else {
            self.digits(&mut text, false);
            if self.peek_at(0) == Some('.') && self.peek_at(1).is_some_and(|c| c.is_ascii_digit()) {
                text.push('.');
                self.bump();
                self.digits(&mut text, false);
                float = true;
            }
            if let Some(e @ ('e' | 'E')) = self.peek_at(0) {
                text.push(e);
                self.bump();
                if let Some(sign @ ('+' | '-')) = self.peek_at(0) {
                    text.push(sign);
                    self.bump();
                }
                if self.digits(&mut text, false) == 0 {
                    return Err(error((self.line, self.column), "the digits of an exponent", self.found_here()));
                }
                float = true;
            }
        }
        if self.peek_at(0).is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            while let Some(c) = self.peek_at(0).filter(|c| c.is_ascii_alphanumeric() || *c == '_') {
                text.push(c);
                self.bump();
            }
            return Err(error(start, "a number", format!("`{text}`")));
        }
        Ok(if hex {
            Tok::Hex(text)
        } else if float {
            Tok::Float(text)
        } else {
            Tok::Int(text)
        })
    }

    /// A double-quoted string on one line, unescaped.
    fn string(&mut self, start: (usize, usize)) -> PResult<Tok> {
        self.bump();
        let mut s = String::new();
        loop {
            let here = (self.line, self.column);
            match self.peek_at(0) {
                None | Some('\n') => return Err(error(start, "a closing `\"` on the line of its string", self.found_here())),
                Some('"') => {
                    self.bump();
                    return Ok(Tok::Str(s));
                }
                Some('\\') => {
                    self.bump();
                    let simple = match self.peek_at(0) {
                        Some('"') => Some('"'),
                        Some('\\') => Some('\\'),
                        Some('n') => Some('\n'),
                        Some('r') => Some('\r'),
                        Some('t') => Some('\t'),
                        Some('0') => Some('\0'),
                        _ => None,
                    };
                    if let Some(c) = simple {
                        self.bump();
                        s.push(c);
                    } else if self.peek_at(0) == Some('u') {
                        self.bump();
                        s.push(self.unicode_escape(here)?);
                    } else {
                        return Err(error(here, "an escape (`\\\"`, `\\\\`, `\\n`, `\\r`, `\\t`, `\\0`, `\\u{...}`)", self.found_here()));
                    }
                }
                Some(c) => {
                    s.push(c);
                    self.bump();
                }
            }
        }
    }

    /// The `{HEX}` of a `\u{HEX}` escape (after the `u`).
    fn unicode_escape(&mut self, start: (usize, usize)) -> PResult<char> {
        let bad = |lexer: &Lexer| error(start, "a `\\u{HEX}` escape of a Unicode scalar value", lexer.found_here());
        if self.peek_at(0) != Some('{') {
            return Err(bad(self));
        }
        self.bump();
        let mut hex = String::new();
        while let Some(c) = self.peek_at(0).filter(char::is_ascii_hexdigit) {
            hex.push(c);
            self.bump();
        }
        if self.peek_at(0) != Some('}') || hex.is_empty() || hex.len() > 6 {
            return Err(bad(self));
        }
        let c = u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32).ok_or_else(|| bad(self))?;
        self.bump();
        Ok(c)
    }
}

// ---------------------------------------------------------------- parsing

struct Parser {
    tokens: Vec<Token>,
    at: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> &Token {
        // The lexer always ends the tokens with `End`, which is never consumed.
        &self.tokens[self.at.min(self.tokens.len() - 1)]
    }

    fn error(&self, expected: &str) -> ParseError {
        Self::error_at(self.peek(), expected)
    }

    fn error_at(t: &Token, expected: &str) -> ParseError {
        ParseError { line: t.line, column: t.column, expected: expected.into(), found: t.describe() }
    }

    fn eat_punct(&mut self, p: &str) -> bool {
        if matches!(self.peek().tok, Tok::Punct(q) if q == p) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn punct(&mut self, p: &str) -> PResult<()> {
        if self.eat_punct(p) {
            Ok(())
        } else {
            Err(self.error(&format!("`{p}`")))
        }
    }

    fn eat_keyword(&mut self, word: &str) -> bool {
        if matches!(&self.peek().tok, Tok::Ident(w) if w == word) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn keyword(&mut self, word: &str) -> PResult<()> {
        if self.eat_keyword(word) {
            Ok(())
        } else {
            Err(self.error(&format!("`{word}`")))
        }
    }

    /// One of `choices` (keywords), as the value paired with it.
    fn choice<T: Copy>(&mut self, choices: &[(T, &str)], what: &str) -> PResult<T> {
        if let Tok::Ident(w) = &self.peek().tok {
            if let Some((value, _)) = choices.iter().find(|(_, name)| name == w) {
                let value = *value;
                self.at += 1;
                return Ok(value);
            }
        }
        let names: Vec<String> = choices.iter().map(|(_, name)| format!("`{name}`")).collect();
        Err(self.error(&format!("{what} ({})", names.join(", "))))
    }

    fn string(&mut self, what: &str) -> PResult<String> {
        match &self.peek().tok {
            Tok::Str(s) => {
                let s = s.clone();
                self.at += 1;
                Ok(s)
            }
            _ => Err(self.error(what)),
        }
    }

    /// An integer of type `T`, with an optional leading `-`.
    fn int<T: std::str::FromStr>(&mut self, what: &str) -> PResult<T> {
        let start = self.peek().clone();
        let negative = self.eat_punct("-");
        match &self.peek().tok {
            Tok::Int(digits) => {
                let text = if negative { format!("-{digits}") } else { digits.clone() };
                let value = text.parse().map_err(|_| ParseError { found: format!("`{text}`"), ..Self::error_at(&start, what) })?;
                self.at += 1;
                Ok(value)
            }
            _ => Err(self.error(what)),
        }
    }

    /// An f32 literal: a decimal number with a fraction or an exponent, with an
    /// optional leading `-`, or `f32(0x...)`.
    fn float(&mut self) -> PResult<f32> {
        const WHAT: &str = "an f32 literal (like `0.5`, `-1e-6` or `f32(0x7fc00000)`)";
        let start = self.peek().clone();
        if self.eat_keyword("f32") {
            self.punct("(")?;
            let bits = match &self.peek().tok {
                Tok::Hex(h) => u32::from_str_radix(&h[2..], 16).map_err(|_| self.error("the 32 bits of an f32 in hex (at most 8 digits)"))?,
                _ => return Err(self.error("the bits of an f32 in hex (`0x...`)")),
            };
            self.at += 1;
            self.punct(")")?;
            return Ok(f32::from_bits(bits));
        }
        let negative = self.eat_punct("-");
        match &self.peek().tok {
            Tok::Float(digits) => {
                let text = if negative { format!("-{digits}") } else { digits.clone() };
                let bad = || ParseError { found: format!("`{text}`"), ..Self::error_at(&start, "a finite f32 (others are written `f32(0x...)`)") };
                let value: f32 = text.parse().map_err(|_| bad())?;
                if !value.is_finite() {
                    return Err(bad());
                }
                self.at += 1;
                Ok(value)
            }
            _ => Err(self.error(WHAT)),
        }
    }

    /// `prefix` and a decimal number, as an ident (`v3`, `p0`, `l2`).
    fn numbered(&self, prefix: char) -> Option<&str> {
        match &self.peek().tok {
            Tok::Ident(w) => w.strip_prefix(prefix).filter(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit())),
            _ => None,
        }
    }

    /// `{prefix}{n}` with `n` a 32-bit number, consumed; else an error
    /// expecting `what`.
    fn id(&mut self, prefix: char, what: &str) -> PResult<u32> {
        match self.numbered(prefix).and_then(|d| d.parse().ok()) {
            Some(n) => {
                self.at += 1;
                Ok(n)
            }
            None => Err(self.error(what)),
        }
    }

    /// A variable: `v{id}`.
    fn var(&mut self) -> PResult<VarId> {
        self.id('v', "a variable (`v` and a 32-bit id)")
    }

    /// A buffer: `p{n}` for a parameter or `l{n}` for a local.
    fn buffer(&mut self) -> PResult<Buf> {
        const WHAT: &str = "a buffer (`p` and a parameter index, or `l` and a local index)";
        if self.numbered('l').is_some() {
            self.id('l', WHAT).map(|n| Buf::Local(LocalId(n)))
        } else {
            self.id('p', WHAT).map(|n| Buf::Param(ParamId(n)))
        }
    }

    /// A parameter: `p{n}`.
    fn param(&mut self) -> PResult<ParamId> {
        self.id('p', "a parameter (`p` and a parameter index)").map(ParamId)
    }

    /// A local: `l{n}`.
    fn local(&mut self) -> PResult<LocalId> {
        self.id('l', "a local (`l` and a local index)").map(LocalId)
    }

    /// A declaration's number: `{prefix}{expected}`.
    fn declared(&mut self, prefix: char, expected: usize) -> PResult<()> {
        if self.numbered(prefix) == Some(expected.to_string().as_str()) {
            self.at += 1;
            Ok(())
        } else {
            Err(self.error(&format!("`{prefix}{expected}` or `}}`")))
        }
    }

    /// Counts one level of nesting (undone by [`Parser::leave`]).
    fn enter(&mut self) -> PResult<()> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.error(&format!("nesting at most {MAX_DEPTH} deep")));
        }
        Ok(())
    }

    fn leave(&mut self) {
        self.depth -= 1;
    }

    fn kernel(&mut self) -> PResult<Kernel> {
        self.keyword("kernel")?;
        let name = self.string("the kernel's name (a string)")?;
        self.punct("{")?;
        self.keyword("family")?;
        let family = self.string("the kernel's family (a string)")?;
        self.keyword("tasks")?;
        self.keyword("per_seq")?;
        let per_seq = self.int("tasks per sequence row (a u64)")?;
        self.keyword("fixed")?;
        let fixed = self.int("fixed tasks (a u64)")?;
        self.keyword("task_var")?;
        let task_var = self.var()?;
        let float_order = if self.eat_keyword("float_order") {
            self.keyword("ordered")?;
            FloatOrder::Ordered
        } else {
            FloatOrder::Reassociable
        };
        self.keyword("params")?;
        self.punct("{")?;
        let mut params = Vec::new();
        while !self.eat_punct("}") {
            self.declared('p', params.len())?;
            let name = self.string("the parameter's name (a string)")?;
            let elem = self.choice(&ElemType::ALL.map(|e| (e, e.name())), "an element type")?;
            let writes = self.choice(&[(false, "read"), (true, "write")], "the parameter's access")?;
            params.push(Param { name, elem, writes });
        }
        self.keyword("locals")?;
        self.punct("{")?;
        let mut locals = Vec::new();
        while !self.eat_punct("}") {
            self.declared('l', locals.len())?;
            locals.push(self.int("the local's element count (a u64)")?);
        }
        self.keyword("vars")?;
        self.punct("{")?;
        let mut vars = Vec::new();
        while !self.eat_punct("}") {
            self.declared('v', vars.len())?;
            vars.push(self.choice(&VAL_TYPES.map(|t| (t, val_name(t))), "a value type")?);
        }
        self.keyword("body")?;
        let body = self.block()?;
        self.punct("}")?;
        Ok(Kernel { name, family, params, tasks: TaskCount { per_seq, fixed }, task_var, vars, locals, body, float_order })
    }

    fn block(&mut self) -> PResult<Vec<Stmt>> {
        self.punct("{")?;
        self.enter()?;
        let mut body = Vec::new();
        while !self.eat_punct("}") {
            body.push(self.stmt()?);
        }
        self.leave();
        Ok(body)
    }

    /// One statement. The statement kinds parse in functions of their own,
    /// which keeps the frames of the recursion through nested blocks small.
    fn stmt(&mut self) -> PResult<Stmt> {
        let word = match &self.peek().tok {
            Tok::Ident(w) => w.as_str(),
            _ => "",
        };
        let parse: fn(&mut Self) -> PResult<Stmt> = match word {
            "set" => Self::set,
            "store" => Self::store,
            "for" => |p| p.for_loop(LoopHint::Serial),
            "for_vec" => |p| p.for_loop(LoopHint::Vectorize),
            "if" => Self::if_then,
            "prefetch" => Self::prefetch,
            "dot_block" => Self::dot_block,
            "dot_rows" => Self::dot_rows,
            "pair_dot" => Self::pair_dot,
            "widen_bf16" => Self::widen_bf16,
            _ => return Err(self.error("a statement (`set`, `store`, `for`, `for_vec`, `if`, `prefetch`, `dot_block`, `dot_rows`, `pair_dot`, `widen_bf16`) or `}`")),
        };
        self.at += 1;
        parse(self)
    }

    /// `set` (consumed) `VAR = expr`.
    fn set(&mut self) -> PResult<Stmt> {
        let var = self.var()?;
        self.punct("=")?;
        Ok(Stmt::Set { var, value: self.expr()? })
    }

    /// `store` (consumed) `BUF [ expr ] = expr`.
    fn store(&mut self) -> PResult<Stmt> {
        let buf = self.buffer()?;
        let index = self.index()?;
        self.punct("=")?;
        Ok(Stmt::Store { buf, index, value: self.expr()? })
    }

    /// `for` or `for_vec` (consumed) `VAR in expr .. expr block`.
    fn for_loop(&mut self, hint: LoopHint) -> PResult<Stmt> {
        let var = self.var()?;
        self.keyword("in")?;
        let start = self.expr()?;
        self.punct("..")?;
        let end = self.expr()?;
        Ok(Stmt::For { var, start, end, hint, body: self.block()? })
    }

    /// `if` (consumed) `expr block`.
    fn if_then(&mut self) -> PResult<Stmt> {
        let cond = self.expr()?;
        Ok(Stmt::If { cond, then: self.block()? })
    }

    /// `prefetch` (consumed) `PARAM [ expr ]`.
    fn prefetch(&mut self) -> PResult<Stmt> {
        let param = self.param()?;
        Ok(Stmt::Prefetch { param, index: self.index()? })
    }

    /// `[ expr ]`.
    fn index(&mut self) -> PResult<Expr> {
        self.punct("[")?;
        let index = self.expr()?;
        self.punct("]")?;
        Ok(index)
    }

    /// `[ expr , expr ]`.
    fn pair(&mut self) -> PResult<[Expr; 2]> {
        self.punct("[")?;
        let a = self.expr()?;
        self.punct(",")?;
        let b = self.expr()?;
        self.punct("]")?;
        Ok([a, b])
    }

    /// A field of a dot statement: `name` then what `value` reads.
    fn field<T>(&mut self, name: &str, value: impl FnOnce(&mut Self) -> PResult<T>) -> PResult<T> {
        self.keyword(name)?;
        value(self)
    }

    /// `dot_block` (consumed) and its fields in braces.
    fn dot_block(&mut self) -> PResult<Stmt> {
        self.punct("{")?;
        let acc = self.field("acc", Self::local)?;
        let scales = self.field("scales", Self::pair)?;
        let weights = self.field("weights", Self::param)?;
        let w_start = self.field("w_start", Self::expr)?;
        let form = self.field("form", |p| p.choice(&[(DotForm::Int8, "int8"), (DotForm::NibblePairs, "nibble_pairs")], "a dot form"))?;
        let act = self.field("act", Self::param)?;
        let act_start = self.field("act_start", Self::expr)?;
        self.punct("}")?;
        Ok(Stmt::DotBlock { acc, scales, weights, w_start, form, act, act_start })
    }

    /// `pair_dot` (consumed) and its fields in braces.
    fn pair_dot(&mut self) -> PResult<Stmt> {
        self.punct("{")?;
        let acc = self.field("acc", Self::local)?;
        let weights = self.field("weights", Self::param)?;
        let w_start = self.field("w_start", Self::expr)?;
        let act = self.field("act", Self::param)?;
        let act_start = self.field("act_start", Self::expr)?;
        self.punct("}")?;
        Ok(Stmt::PairDot { acc, weights, w_start, act, act_start })
    }

    /// `widen_bf16` (consumed) and its fields in braces.
    fn widen_bf16(&mut self) -> PResult<Stmt> {
        self.punct("{")?;
        let dst = self.field("dst", Self::local)?;
        let weights = self.field("weights", Self::param)?;
        let start = self.field("start", Self::expr)?;
        self.punct("}")?;
        Ok(Stmt::WidenBf16 { dst, weights, start })
    }

    /// `dot_rows` (consumed) and its fields in braces.
    fn dot_rows(&mut self) -> PResult<Stmt> {
        self.punct("{")?;
        let acc = self.field("acc", Self::local)?;
        let weights = self.field("weights", Self::param)?;
        let w_start = self.field("w_start", Self::expr)?;
        let form = self.field("form", |p| p.choice(&[(RowsForm::Nibbles5, "nibbles5"), (RowsForm::Nibbles6, "nibbles6"), (RowsForm::Nibbles, "nibbles"), (RowsForm::Bytes, "bytes")], "a rows form"))?;
        let high_bits = match form.high_bit_count() {
            0 => None,
            _ => self.field("high_bits", Self::param_at_or_none)?,
        };
        let act = self.field("act", Self::param)?;
        let act_start = self.field("act_start", Self::expr)?;
        let act_levels = self.field("act_levels", |p| {
            if p.eat_keyword("bytes") {
                Ok(ActLevels::Bytes)
            } else if p.eat_keyword("word_pairs") {
                Ok(ActLevels::WordPairs)
            } else if p.eat_keyword("words") {
                Ok(ActLevels::Words)
            } else if p.eat_keyword("planes") {
                p.keyword("low")?;
                Ok(ActLevels::Planes { low: p.expr()? })
            } else {
                Err(p.error("activation levels (`bytes`, `planes low EXPR`, `words`, `word_pairs`)"))
            }
        })?;
        let act_scales = self.field("act_scales", Self::pair)?;
        let half_sums = match form.halves() {
            1 => None,
            _ => self.field("half_sums", Self::param_at_or_none)?,
        };
        let row_scales = self.field("row_scales", Self::row_scale)?;
        let row_min = self.field("row_min", |p| {
            if p.eat_keyword("offset") {
                Ok(RowMin::Offset(p.float()?))
            } else if p.eat_keyword("stored") {
                Ok(RowMin::Stored(p.row_scale()?))
            } else if p.eat_keyword("subtracted") {
                Ok(RowMin::Subtracted(p.row_scale()?))
            } else {
                Err(p.error("a row minimum (`offset`, `stored`, `subtracted`)"))
            }
        })?;
        let prefetch_ahead = self.field("prefetch_ahead", |p| if p.eat_keyword("none") { Ok(None) } else { p.int("`none` or bytes ahead (an i64)").map(Some) })?;
        self.punct("}")?;
        Ok(Stmt::DotRows(RowDot { acc, weights, w_start, form, high_bits, half_sums, act, act_start, act_levels, act_scales, row_scales, row_min, prefetch_ahead }))
    }

    /// `none`, or `PARAM at expr` (a dot's optional parameter and start).
    fn param_at_or_none(&mut self) -> PResult<Option<(ParamId, Expr)>> {
        if self.eat_keyword("none") {
            return Ok(None);
        }
        let param = self.param()?;
        self.keyword("at")?;
        Ok(Some((param, self.expr()?)))
    }

    /// `values PARAM at expr factors (none | PARAM at expr)`.
    fn row_scale(&mut self) -> PResult<RowScale> {
        let at = |p: &mut Self| -> PResult<(ParamId, Expr)> {
            let buffer = p.param()?;
            p.keyword("at")?;
            Ok((buffer, p.expr()?))
        };
        let values = self.field("values", at)?;
        let factors = self.field("factors", |p| if p.eat_keyword("none") { Ok(None) } else { at(p).map(Some) })?;
        Ok(RowScale { values, factors })
    }

    /// An expression. Its kinds parse in functions of their own, which keeps
    /// the frames of the recursion through nested expressions small.
    fn expr(&mut self) -> PResult<Expr> {
        self.enter()?;
        let parse: fn(&mut Self) -> PResult<Expr> = match &self.peek().tok {
            Tok::Punct("(") => Self::parenthesized,
            Tok::Ident(_) if self.numbered('p').is_some() || self.numbered('l').is_some() => Self::load,
            Tok::Ident(w) if matches!(w.as_str(), "max" | "min" | "select" | "fma") || un_op_named(w).is_some() => Self::call,
            _ => Self::leaf,
        };
        let e = parse(self);
        self.leave();
        e
    }

    /// `( expr )` or `( expr binop expr )`.
    fn parenthesized(&mut self) -> PResult<Expr> {
        self.punct("(")?;
        let a = self.expr()?;
        if self.eat_punct(")") {
            return Ok(a);
        }
        let op = match &self.peek().tok {
            Tok::Punct(p) => infix(p),
            _ => None,
        };
        let Some(op) = op else {
            return Err(self.error("an infix operator (`+`, `-`, `*`, `/`, `%`, `<<`, `>>`, `&`, `<`, `<=`, `==`) or `)`"));
        };
        self.at += 1;
        let (a, b) = (Box::new(a), Box::new(self.expr()?));
        self.punct(")")?;
        Ok(match op {
            Infix::Bin(op) => Expr::Bin(op, a, b),
            Infix::Cmp(op) => Expr::Cmp(op, a, b),
        })
    }

    /// `BUF [ expr ]`.
    fn load(&mut self) -> PResult<Expr> {
        let buf = self.buffer()?;
        Ok(Expr::Load { buf, index: Box::new(self.index()?) })
    }

    /// `max`, `min`, `select`, `fma` or a unary operator, with its arguments.
    fn call(&mut self) -> PResult<Expr> {
        let name = match &self.peek().tok {
            Tok::Ident(w) => w.clone(),
            _ => return Err(self.error("a function")),
        };
        self.at += 1;
        Ok(match name.as_str() {
            "max" | "min" => {
                let [a, b] = self.args()?;
                Expr::Bin(if name == "max" { BinOp::Max } else { BinOp::Min }, a, b)
            }
            "select" => {
                let [c, a, b] = self.args()?;
                Expr::Select(c, a, b)
            }
            "fma" => {
                let [a, b, c] = self.args()?;
                Expr::MulAdd(a, b, c)
            }
            _ => {
                let op = un_op_named(&name);
                let [a] = self.args()?;
                Expr::Un(op.ok_or_else(|| self.error("a unary operator"))?, a)
            }
        })
    }

    /// The arguments of a call, after its name: `( expr , ... )`, `N` of them.
    fn args<const N: usize>(&mut self) -> PResult<[Box<Expr>; N]> {
        self.punct("(")?;
        let mut args = Vec::with_capacity(N);
        for i in 0..N {
            if i > 0 {
                self.punct(",")?;
            }
            args.push(Box::new(self.expr()?));
        }
        self.punct(")")?;
        args.try_into().map_err(|_| self.error("arguments"))
    }

    /// An expression without subexpressions: a literal, a variable or `seq`.
    fn leaf(&mut self) -> PResult<Expr> {
        let next = self.tokens.get(self.at + 1).map(|n| &n.tok);
        match &self.peek().tok {
            Tok::Int(_) => Ok(Expr::I64(self.int("an i64")?)),
            Tok::Punct("-") if matches!(next, Some(Tok::Int(_))) => Ok(Expr::I64(self.int("an i64")?)),
            Tok::Float(_) => Ok(Expr::F32(self.float()?)),
            Tok::Punct("-") if matches!(next, Some(Tok::Float(_))) => Ok(Expr::F32(self.float()?)),
            Tok::Punct("-") => {
                self.at += 1;
                Err(self.error("a number after `-`"))
            }
            Tok::Ident(w) if w == "f32" => Ok(Expr::F32(self.float()?)),
            Tok::Ident(w) if w == "seq" => {
                self.at += 1;
                Ok(Expr::Seq)
            }
            Tok::Ident(_) if self.numbered('v').is_some() => Ok(Expr::Var(self.var()?)),
            _ => Err(self.error("an expression")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::dsl::*;
    use crate::library::attention::{self, AttentionShape, KeyLayout, Paging};
    use crate::library::elementwise::{self, Binary, Broadcast, Unary};
    use crate::library::matmul_panel::PanelWeights;
    use crate::library::quantize_activations::ActivationLevels;
    use crate::library::{attention_ragged, copy, embedding, matmul, matmul_blocks, matmul_int8, matmul_interleaved, matmul_panel, moe, pooling, quantize_activations, rms_norm, rope};
    use crate::library::{RegisterTile, SeqMode};
    use maxc_format::WeightEncoding;

    const SEQS: [SeqMode; 2] = [SeqMode::Fixed(1), SeqMode::Dynamic];
    const ADDENDS: [Option<Broadcast>; 4] = [None, Some(Broadcast::None), Some(Broadcast::Row), Some(Broadcast::Scalar)];
    const BLOCK_ENCODINGS: [WeightEncoding; 4] = [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K];
    /// The encodings layout `interleaved16` takes.
    const INTERLEAVED_ENCODINGS: [WeightEncoding; 8] = [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K];
    const TILES: [RegisterTile; 2] = [RegisterTile::ZMM, RegisterTile::YMM];

    /// Every kernel constructor of the library, for two shapes each where the
    /// shape matters, every sequence mode, encoding, addend, register tile and
    /// activation level the constructors accept.
    fn library_kernels() -> Vec<Kernel> {
        let mut ks = Vec::new();
        let all_encodings = WeightEncoding::ALL;
        // Mixture of experts: every routing rule, the grouping, and the grouped
        // matmuls in each layout, decode and prefill, per register tile.
        for routing in [moe::MoeRouting::SoftmaxTopK { renormalize: false }, moe::MoeRouting::SoftmaxTopK { renormalize: true }, moe::MoeRouting::TopKSoftmax] {
            ks.push(moe::moe_route(8, 3, routing));
        }
        ks.push(moe::moe_group(8, 2));
        for encoding in [WeightEncoding::Float32, WeightEncoding::BFloat16] {
            ks.push(moe::moe_router(64, 8, encoding, false));
            ks.push(moe::moe_router(64, 8, encoding, true));
        }
        for encoding in all_encodings {
            ks.push(moe::moe_matmul_rows(if encoding.block() == 256 { 256 } else { 64 }, 40, 3, encoding));
        }
        for seq in SEQS {
            for tile in TILES {
                for weights in [PanelWeights::Float(ElemType::F32), PanelWeights::Float(ElemType::BF16), PanelWeights::Float8E4M3] {
                    ks.push(moe::moe_matmul_panel(40, 48, 3, weights, seq, tile));
                }
                for encoding in INTERLEAVED_ENCODINGS {
                    let k = if encoding.block() == 256 { 256 } else { 64 };
                    for levels in ActivationLevels::ALL.into_iter().filter(|&l| !(encoding == WeightEncoding::Q6K && l == ActivationLevels::Int16Words)) {
                        ks.push(moe::moe_matmul_interleaved(k, 48, 3, encoding, seq, tile, levels));
                    }
                }
            }
        }
        for weights in [PanelWeights::Float(ElemType::F32), PanelWeights::Float8E4M3] {
            ks.push(moe::moe_matmul_panel_rows(40, 48, 3, weights));
        }
        for seq in SEQS {
            // Attention: windows, soft-capping, bidirectional, f16 caches.
            for (cache, window, softcap, causal) in [
                (ElemType::F32, None, None, true),
                (ElemType::F32, Some(6), Some(3.0), true),
                (ElemType::F16, None, None, true),
                (ElemType::F32, None, None, false),
                (ElemType::F16, Some(5), Some(2.5), false),
            ] {
                for (heads, kv_heads, head_dim, max_len, keys) in [(6, 2, 8, 20, KeyLayout::Rows), (4, 4, 16, 150, KeyLayout::Rows), (6, 2, 8, 32, KeyLayout::Panels)] {
                    let shape = AttentionShape { heads, kv_heads, head_dim, scale: 0.3, window, max_len, softcap, causal, cache, keys, sinks: false };
                    ks.push(attention::attention(shape, seq));
                    if causal && window.is_some() {
                        // gpt-oss's sinks: whole attention and the combine.
                        let sinks = AttentionShape { sinks: true, ..shape };
                        ks.push(attention::attention(sinks, seq));
                        ks.push(attention::attention_combine(sinks, attention::DECODE_SPLITS, seq));
                    }
                    if causal {
                        for splits in [1, 3, attention::DECODE_SPLITS] {
                            ks.push(attention::attention_partial(shape, splits, seq));
                            ks.push(attention::attention_combine(shape, splits, seq));
                            if seq == SeqMode::Dynamic && keys == KeyLayout::Rows {
                                ks.push(attention::attention_paged(shape, Paging { block_size: 4, blocks_per_seq: 5 }, Some(splits)));
                            }
                        }
                        if seq == SeqMode::Dynamic {
                            ks.push(attention::attention_paged(shape, Paging { block_size: 16, blocks_per_seq: 10 }, None));
                        }
                    }
                }
            }
            for cache in [ElemType::F32, ElemType::F16] {
                ks.push(attention::kv_store(2, 8, 20, cache, KeyLayout::Rows, seq));
                ks.push(attention::kv_store(4, 64, 2048, cache, KeyLayout::Rows, seq));
                ks.push(attention::kv_store(4, 64, 2048, cache, KeyLayout::Panels, seq));
                if seq == SeqMode::Dynamic {
                    ks.push(attention::kv_store_paged(2, 8, Paging { block_size: 4, blocks_per_seq: 5 }, cache, KeyLayout::Rows));
                    ks.push(attention::kv_store_paged(4, 64, Paging { block_size: 16, blocks_per_seq: 128 }, cache, KeyLayout::Rows));
                    ks.push(attention::kv_store_paged(4, 64, Paging { block_size: 16, blocks_per_seq: 128 }, cache, KeyLayout::Panels));
                }
            }
            // Copies, elementwise, norms, rope.
            for width in [3, 576] {
                ks.push(copy::slice_columns(width * 3, width, width, seq));
                for op in [Unary::Neg, Unary::Exp, Unary::Silu, Unary::GeluTanh, Unary::Gelu, Unary::Rsqrt, Unary::Tanh] {
                    ks.push(elementwise::unary(op, width, seq));
                }
                for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Max] {
                    for bc in [Broadcast::None, Broadcast::Row, Broadcast::Scalar] {
                        ks.push(elementwise::binary(op, width, bc, seq));
                    }
                }
                ks.push(elementwise::swiglu(width, seq));
                ks.push(pooling::mean_rows(width, seq));
                ks.push(rms_norm::rms_norm(width, width, 1e-5, seq));
                ks.push(rms_norm::layer_norm(width, 1e-6, seq));
            }
            ks.push(rms_norm::rms_norm(4, 2, 0.0, seq));
            ks.push(rms_norm::rms_norm(576, 64, 1e-6, seq));
            ks.push(rope::rope(4, 4, seq));
            ks.push(rope::rope(576, 64, seq));
            // Embeddings.
            for encoding in all_encodings {
                ks.push(embedding::embedding(32, 512, encoding, seq));
                ks.push(embedding::embedding(49152, 256, encoding, seq));
                ks.push(embedding::embedding_range(16, 16, 512, encoding, seq));
            }
            for encoding in INTERLEAVED_ENCODINGS {
                ks.push(embedding::embedding_in(32, 512, encoding, maxc_format::Layout::Interleaved16, seq));
                ks.push(embedding::embedding_in(48, 256, encoding, maxc_format::Layout::Interleaved16, seq));
            }
            for encoding in [WeightEncoding::Float32, WeightEncoding::BFloat16, WeightEncoding::Float16, WeightEncoding::Float8E4M3] {
                ks.push(embedding::embedding_in(49152, 576, encoding, maxc_format::Layout::Panel16, seq));
            }
            // Quantized activations.
            for k in [128, 512] {
                for form in [DotForm::Int8, DotForm::NibblePairs] {
                    ks.push(quantize_activations::quantize_q8(k, form, seq));
                }
                for levels in [ActivationLevels::Int16Planes, ActivationLevels::Int16Words, ActivationLevels::Int16WordPairs] {
                    ks.push(quantize_activations::quantize_q16(k, levels, seq));
                }
                ks.push(quantize_activations::round_bf16(k, seq));
            }
            // Matmuls.
            for (k, n) in [(5, 11), (64, 576)] {
                for elem in [ElemType::F32, ElemType::BF16, ElemType::F16] {
                    ks.push(matmul::matmul(k, n, elem, seq));
                    for bc in [Broadcast::None, Broadcast::Row, Broadcast::Scalar] {
                        ks.push(matmul::matmul_add(k, n, bc, elem, seq));
                    }
                }
            }
            for (k, n) in [(256, 11), (512, 48)] {
                for addend in ADDENDS {
                    for encoding in all_encodings.into_iter().filter(|e| e.block() > 1) {
                        ks.push(matmul_blocks::matmul_blocks(k, n, encoding, addend, seq));
                        ks.push(matmul_blocks::matmul_blocks_rowwise(k, n, encoding, addend, seq));
                    }
                    for encoding in BLOCK_ENCODINGS {
                        ks.push(matmul_int8::matmul_int8(k, n, encoding, addend, seq));
                    }
                }
            }
            for (k, n) in [(512, 48), (256, 32)] {
                for addend in ADDENDS {
                    for encoding in INTERLEAVED_ENCODINGS {
                        // Q6_K's two halves take bytes or planes, not words.
                        for levels in ActivationLevels::ALL.into_iter().filter(|&l| !(encoding == WeightEncoding::Q6K && l.is_words())) {
                            for tile in TILES {
                                ks.push(matmul_interleaved::matmul_interleaved(k, n, encoding, addend, seq, tile, levels));
                            }
                        }
                    }
                }
            }
            for (k, n) in [(9, 48), (64, 32)] {
                for addend in ADDENDS {
                    for weights in [PanelWeights::Float(ElemType::F32), PanelWeights::Float(ElemType::BF16), PanelWeights::Float(ElemType::F16), PanelWeights::Float8E4M3] {
                        for tile in TILES {
                            ks.push(matmul_panel::matmul_panel(k, n, weights, addend, seq, tile));
                        }
                        ks.push(matmul_panel::matmul_panel_rowwise(k, n, weights, addend, seq));
                    }
                    // bfloat16 pair dots: an even k only.
                    if k % 2 == 0 {
                        for tile in TILES {
                            ks.push(matmul_panel::matmul_panel(k, n, PanelWeights::BFloat16Pairs, addend, seq, tile));
                        }
                    }
                }
            }
        }
        for width in [3, 576] {
            ks.push(copy::last_row(width));
            ks.push(copy::gather_rows(width));
            ks.push(pooling::l2_normalize(width, 4));
            ks.push(pooling::l2_normalize_rows(width));
            ks.push(pooling::mean_rows_ragged(width));
            ks.push(moe::moe_gather(width, 2));
            ks.push(moe::moe_combine(width, 3, None, false));
            ks.push(moe::moe_combine(width, 3, Some(4), false));
            ks.push(moe::moe_combine(width, 3, None, true));
            ks.push(moe::moe_activation(width, 2, moe::MoeActivation::ClampedSwiGlu { alpha: 1.702, limit: 7.0 }, Some(4)));
            ks.push(moe::moe_activation(width, 2, moe::MoeActivation::SwiGlu, None));
        }
        for (heads, kv_heads, head_dim, softcap) in [(12, 12, 32, None), (6, 2, 8, Some(2.5))] {
            ks.push(attention_ragged::attention_ragged(attention_ragged::RaggedShape { heads, kv_heads, head_dim, scale: 0.3, softcap }));
        }
        ks
    }

    /// Prints, parses and prints again: the kernel and its text come back the same.
    fn assert_round_trips(k: &Kernel) {
        let text = print(k);
        let parsed = parse(&text).unwrap_or_else(|e| panic!("kernel `{}`: {e}\n{text}", k.name));
        assert_eq!(&parsed, k, "kernel `{}` changed in the round trip", k.name);
        assert_eq!(print(&parsed), text, "kernel `{}` prints differently after the round trip", k.name);
        if k.validate().is_ok() {
            assert!(parsed.validate().is_ok(), "kernel `{}`: the parsed kernel does not validate", k.name);
        }
    }

    #[test]
    fn every_library_kernel_round_trips() {
        let kernels = library_kernels();
        for k in &kernels {
            assert_round_trips(k);
        }
        // Every kind of statement and operand the library emits is among them.
        let text: String = kernels.iter().map(print).collect();
        for needle in ["for ", "for_vec ", "if ", "set ", "store ", "prefetch ", "dot_block {", "dot_rows {", "act_levels planes", "act_levels words", "form nibbles5 high_bits", "form nibbles6 high_bits", "row_min subtracted", "factors p", "prefetch_ahead 4096", "select(", "seq"] {
            assert!(text.contains(needle), "no library kernel prints `{needle}`");
        }
        eprintln!("{} library kernels round-trip", kernels.len());
    }

    /// A kernel with every statement, operator and odd literal the library may
    /// not use: NaN payloads, infinities, -0.0, subnormals, extreme integers,
    /// names that need escapes, far buffer and variable ids.
    fn odd_kernel() -> Kernel {
        let mut b = KernelBuilder::new();
        let odd = b.param("w\"eird\\ name\n\t\u{1}\u{2028} ünï", ElemType::U8, false);
        let acts = b.param("", ElemType::I8, true);
        let scales = b.param("s.scales", ElemType::BF16, false);
        let out = b.param("out", ElemType::F16, true);
        let acc = b.local(16);
        let big = b.local(u64::MAX);
        let t = b.var(ValType::I64);
        let x = b.var(ValType::F32);
        let c = b.var(ValType::Bool);
        let floats = [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0, f32::MIN_POSITIVE / 8.0, f32::MAX, f32::MIN, 1e-45, 0.1, 16777217.0, -87.3];
        let mut body: Vec<Stmt> = floats.iter().map(|&v| set(x, f(v))).collect();
        let ops = [BinOp::Add, BinOp::Sub, BinOp::Mul, BinOp::Div, BinOp::Rem, BinOp::Max, BinOp::Min, BinOp::Shl, BinOp::Shr, BinOp::And];
        body.extend(ops.map(|op| set(t, bin(op, i(i64::MIN), i(i64::MAX)))));
        body.extend(UN_OPS.map(|op| set(x, un(op, v(x)))));
        body.push(set(c, le(seq(), i(-1))));
        body.push(set(c, eq(v(u32::MAX), ld(LocalId(u32::MAX), i(0)))));
        body.push(if_(lt(v(t), i(3)), vec![]));
        body.push(Stmt::For { var: t, start: i(-5), end: seq(), hint: LoopHint::Serial, body: vec![prefetch(ParamId(u32::MAX), i(1 << 40)), if_(v(c), vec![store(out, v(t), select(v(c), f(1.5), f(-0.0)))])] });
        body.push(for_vec(t, i(0), i(0), vec![]));
        body.push(Stmt::DotBlock { acc, scales: [f(0.5), ld(scales, v(t))], weights: odd, w_start: i(0), form: DotForm::NibblePairs, act: acts, act_start: v(t) });
        for (act_levels, row_min, prefetch_ahead) in [
            (ActLevels::Bytes, RowMin::Offset(f32::NAN), None),
            (ActLevels::Planes { low: add(v(t), i(512)) }, RowMin::Offset(-0.0), Some(i64::MIN)),
            (ActLevels::Words, RowMin::Stored(RowScale { values: (scales, i(2)), factors: None }), Some(-1)),
            (ActLevels::WordPairs, RowMin::Offset(-8.0), None),
            (ActLevels::Bytes, RowMin::Subtracted(RowScale { values: (ParamId(u32::MAX - 1), i(3)), factors: Some((odd, v(t))) }), Some(64)),
        ] {
            body.push(Stmt::DotRows(RowDot {
                acc: big,
                weights: odd,
                w_start: mul(v(t), i(256)),
                form: if prefetch_ahead == Some(64) { RowsForm::Nibbles5 } else { RowsForm::Bytes },
                high_bits: (prefetch_ahead == Some(64)).then(|| (odd, sub(v(t), i(3)))),
                half_sums: None,
                act: acts,
                act_start: i(7),
                act_levels,
                act_scales: [f(1e30), f(f32::INFINITY)],
                row_scales: RowScale { values: (scales, v(t)), factors: Some((odd, i(-9))) },
                row_min,
                prefetch_ahead,
            }));
        }
        Kernel {
            name: "odd \"kernel\"\r\n\0".into(),
            family: "# not a comment".into(),
            params: b.params,
            tasks: TaskCount { per_seq: u64::MAX, fixed: 0 },
            task_var: t,
            vars: b.vars,
            locals: b.locals,
            body,
            float_order: FloatOrder::Ordered,
        }
    }

    #[test]
    fn odd_literals_names_and_every_statement_round_trip_bit_exactly() {
        let k = odd_kernel();
        let text = print(&k);
        let parsed = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        // NaNs make `==` fail: the text holds every bit, so compare texts.
        assert_eq!(print(&parsed), text);
        let float_bits = |k: &Kernel| -> Vec<u32> {
            k.body.iter().filter_map(|s| match s {
                Stmt::Set { value: Expr::F32(x), .. } => Some(x.to_bits()),
                _ => None,
            }).collect()
        };
        assert_eq!(float_bits(&parsed), float_bits(&k));
        assert_eq!((parsed.name.as_str(), parsed.family.as_str(), parsed.params[0].name.as_str()), (k.name.as_str(), k.family.as_str(), k.params[0].name.as_str()));
        // Without the NaNs the kernels compare equal.
        let mut clean = k.clone();
        clean.body.retain(|s| !matches!(s, Stmt::Set { value: Expr::F32(x), .. } if x.is_nan()) && !matches!(s, Stmt::DotRows(RowDot { row_min: RowMin::Offset(o), .. }) if o.is_nan()));
        assert_eq!(parse(&print(&clean)), Ok(clean));
    }

    /// The variant lists the parser searches hold every variant once (as many
    /// distinct names as each enum has variants).
    #[test]
    fn variant_lists_name_every_variant_once() {
        let distinct = |names: &[&str]| names.iter().collect::<std::collections::HashSet<_>>().len();
        assert_eq!(distinct(&ElemType::ALL.map(ElemType::name)), 6);
        assert_eq!(distinct(&VAL_TYPES.map(val_name)), 3);
        assert_eq!(distinct(&UN_OPS.map(un_name)), 11);
    }

    /// The example of the module documentation, as written there.
    fn documented_example() -> String {
        let source = include_str!("ir_text.rs");
        let example = source.split("//! # Example").nth(1).and_then(|rest| rest.split("//! ```text\n").nth(1)).and_then(|rest| rest.split("//! ```\n").next());
        let example = example.unwrap_or_else(|| panic!("no example in the module documentation"));
        example.lines().map(|line| format!("{}\n", line.trim_start_matches("//!").strip_prefix(' ').unwrap_or(""))).collect()
    }

    #[test]
    fn the_documented_example_is_what_print_writes() {
        let mut b = KernelBuilder::new();
        let (x, out) = (b.param("x", ElemType::F32, false), b.param("out", ElemType::F32, true));
        let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
        let idx = || add(mul(v(t), i(4)), v(c));
        let k = b.finish("double_w4_sN".into(), "elementwise", TaskCount { per_seq: 1, fixed: 0 }, t, vec![for_vec(c, i(0), i(4), vec![store(out, idx(), mul(ld(x, idx()), f(2.0)))])]);
        let text = documented_example();
        assert_eq!(print(&k), text);
        assert_eq!(parse(&text), Ok(k));
        // Comments, grouping parentheses and `-` before literals read as documented.
        let edited = text.replace("(p0[((v0 * 4) + v1)] * 2.0)", "((((p0[((v0 * 4) + v1)])) * -2.0))  # doubled, negated").replace("  body {", "  # the code\n  body {");
        let parsed = parse(&edited).unwrap_or_else(|e| panic!("{e}"));
        let Stmt::For { body, .. } = &parsed.body[0] else { panic!("not a loop") };
        assert_eq!(body[0], store(out, idx(), mul(ld(x, idx()), f(-2.0))));
    }

    /// The error for `bad` replacing `good` in a printed kernel.
    fn error_for(good: &str, bad: &str) -> ParseError {
        let text = print(&elementwise::binary(Binary::Add, 4, Broadcast::Row, SeqMode::Dynamic));
        assert!(text.contains(good), "{good} not in\n{text}");
        match parse(&text.replacen(good, bad, 1)) {
            Ok(_) => panic!("`{bad}` parsed"),
            Err(e) => e,
        }
    }

    #[test]
    fn unknown_statements_are_errors_at_their_place() {
        let e = error_for("    for_vec v1", "    frob v1");
        assert_eq!((e.line, e.column, e.found.as_str()), (17, 5, "`frob`"));
        assert!(e.expected.contains("a statement"), "{e}");
        assert!(e.to_string().starts_with("line 17, column 5: expected a statement"), "{e}");
    }

    #[test]
    fn missing_braces_are_errors() {
        let text = print(&elementwise::binary(Binary::Add, 4, Broadcast::Row, SeqMode::Dynamic));
        let cut = text.trim_end().strip_suffix('}').unwrap_or(&text);
        let e = parse(cut).err().unwrap_or_else(|| panic!("parsed without its last brace"));
        assert_eq!((e.expected.as_str(), e.found.as_str()), ("`}`", "end of input"));
        let e = error_for("for_vec v1 in 0 .. 4 {", "for_vec v1 in 0 .. 4");
        assert_eq!((e.expected.as_str(), e.found.as_str(), e.line), ("`{`", "`store`", 18));
        let e = error_for("  params {", "  params");
        assert_eq!((e.expected.as_str(), e.found.as_str(), e.line, e.column), ("`{`", "`p0`", 6, 5));
    }

    #[test]
    fn bad_numbers_are_errors() {
        let e = error_for("in 0 ..", "in 99999999999999999999 ..");
        assert_eq!((e.expected.as_str(), e.found.as_str()), ("an i64", "`99999999999999999999`"));
        let e = error_for("in 0 ..", "in 1.5e ..");
        assert_eq!((e.expected.as_str(), e.found.as_str()), ("the digits of an exponent", "' '"));
        let e = error_for("in 0 ..", "in 12ab ..");
        assert_eq!((e.expected.as_str(), e.found.as_str()), ("a number", "`12ab`"));
        let e = error_for("tasks per_seq 1", "tasks per_seq -1");
        assert_eq!((e.found.as_str(), e.column), ("`-1`", 17));
        let e = error_for("in 0 ..", "in 1e39 ..");
        assert!(e.expected.starts_with("a finite f32"), "{e}");
        let e = error_for("in 0 ..", "in f32(0x123456789) ..");
        assert!(e.expected.contains("at most 8 digits"), "{e}");
        let e = error_for("p1 \"b\" f32", "p1 \"b\" f64");
        assert!(e.expected.starts_with("an element type"), "{e}");
    }

    #[test]
    fn other_bad_input_is_an_error_not_a_panic() {
        for (good, bad, expected) in [
            ("p1 \"b\"", "p2 \"b\"", "`p1` or `}`"),
            ("kernel \"", "kernel \"\\q", "an escape"),
            ("kernel \"", "kernel \"\\u{110000}", "a `\\u{HEX}` escape"),
            ("\"out\"", "\"out", "a closing `\"`"),
            ("task_var v0", "task_var x0", "a variable"),
            ("store p2[", "store p4294967296[", "a buffer"),
            ("store p2[", "store l4294967296[", "a buffer"),
            ("store p2[", "store p2[v1 + 1] ", "`]`"),
            ("store p2[", "store p2[(v1 ^ 1)] ", "a token"),
            ("store p2[", "store p2[(v1 max 1)] ", "an infix operator"),
            ("store p2[", "store p2[- v1] ", "a number after `-`"),
            ("store p2[", "store p2[frob(1)] ", "an expression"),
            ("body {", "body { set v9 = (1 + 2 }", "`)`"),
        ] {
            let e = error_for(good, bad);
            assert!(e.expected.starts_with(expected), "{bad}: {e}");
        }
        let e = parse("kernel").err();
        assert_eq!(e.map(|e| e.found), Some("end of input".into()));
        let text = print(&elementwise::binary(Binary::Add, 4, Broadcast::Row, SeqMode::Dynamic));
        let e = parse(&format!("{text} extra")).err();
        assert_eq!(e.map(|e| (e.expected, e.found)), Some(("end of input".into(), "`extra`".into())));
        // Deep nesting is refused, not a stack overflow.
        let deep = format!("{}1{}", "neg(".repeat(100_000), ")".repeat(100_000));
        let e = error_for("store p2[", &format!("store p2[{deep}] "));
        assert!(e.expected.starts_with("nesting at most"), "{e}");
        let e = error_for("body {", &format!("body {{ {}", "if (1 < 2) {".repeat(100_000)));
        assert!(e.expected.starts_with("nesting at most"), "{e}");
        // Every prefix of a kernel's text is an error, never a panic.
        let text = print(&matmul_interleaved::matmul_interleaved(256, 32, WeightEncoding::Q4K, Some(Broadcast::Row), SeqMode::Fixed(1), RegisterTile::ZMM, ActivationLevels::Int16Planes));
        let step = text.len() / 400;
        for (cut, _) in text.char_indices().step_by(step.max(1)) {
            assert!(parse(&text[..cut]).is_err());
        }
        let small = print(&odd_kernel());
        let small = small.trim_end();
        for (cut, _) in small.char_indices() {
            assert!(parse(&small[..cut]).is_err());
        }
    }
}
