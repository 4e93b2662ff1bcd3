//! A PTX interpreter for the simulated CUDA driver: what `cuModuleLoadData` compiles and
//! `cuLaunchKernel` runs.
//!
//! The real driver JIT-compiles PTX text for its GPU; here [`parse`] checks the text and
//! turns each `.entry` into a list of decoded instructions over numbered registers, and
//! [`Kernel::launch`] runs every thread of the grid one after the other against device
//! memory ([`Memory`]). That is enough for the element-wise kernels a check runs (a saxpy,
//! a vector add): no thread waits for another, so running them in sequence gives the
//! results a GPU gives.
//!
//! The subset, which is what `nvcc` emits for such kernels:
//! - module directives `.version`, `.target` (one `sm_XY`), `.address_size 64`, and
//!   `.entry` kernels (optionally `.visible`) with a `.param` list of `.u32`, `.s32`, `.b32`,
//!   `.u64`, `.s64`, `.b64`, `.f32`, `.f64` parameters;
//! - `.reg` declarations (`%r<5>` ranges or plain names), labels, `@p`/`@!p` guards;
//! - `ld.param`, `ld.global` (also `.nc`), `st.global`, `cvta.to.global`, `mov` (registers,
//!   immediates, `%tid`, `%ntid`, `%ctaid`, `%nctaid`), `add`, `sub`, `mul` (`.lo`, `.hi`,
//!   `.wide`), `mad` (`.lo`, `.wide`), `fma.rn`, `div`, `rem`, `min`, `max`, `neg`, `abs`,
//!   `and`, `or`, `xor`, `not`, `shl`, `shr`, `cvt`, `setp`, `selp`, `bra`, `ret`, `exit`;
//!   floating point in round-to-nearest (`.rn`, the default; `.ftz` and `.approx` are read
//!   as their exact counterparts).
//!
//! Anything else (shared memory, barriers, atomics, calls, other state spaces) is refused
//! with a message naming it, which the driver reports as `CUDA_ERROR_INVALID_PTX`: a kernel
//! that would need it is not simulated rather than simulated wrongly. Invariants: a thread
//! only touches memory through [`Memory`], which refuses addresses outside allocations
//! (`CUDA_ERROR_ILLEGAL_ADDRESS`) and misaligned ones; each thread runs at most
//! [`MAX_STEPS`] instructions, so a kernel that never ends fails the launch instead of
//! hanging the caller.

use std::collections::HashMap;

/// Instructions one thread may execute before the launch fails as timed out.
pub const MAX_STEPS: u64 = 1 << 20;

/// Why PTX text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ptx line {line}: {message}")]
pub struct PtxError {
    /// 1-based line of the text (0: the whole module).
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// Why a launch failed while running.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// A thread read or wrote outside every allocation.
    #[error("illegal address {0:#x}")]
    IllegalAddress(u64),
    /// A thread accessed memory at an address not aligned to the access size.
    #[error("misaligned address {0:#x}")]
    Misaligned(u64),
    /// A thread ran longer than [`MAX_STEPS`] instructions.
    #[error("a thread ran more than {MAX_STEPS} instructions")]
    Timeout,
    /// The arguments do not match the kernel's parameters.
    #[error("kernel {kernel} takes {expected} parameters")]
    Arguments {
        /// The kernel.
        kernel: String,
        /// How many it declares.
        expected: usize,
    },
}

/// Device memory as a kernel sees it.
pub trait Memory {
    /// Reads `buf.len()` bytes at `addr`; `Err(addr)` when they are not all inside one
    /// allocation.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), u64>;
    /// Writes `data` at `addr`; `Err(addr)` when it is not all inside one allocation.
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), u64>;
}

/// The value types of registers, parameters and instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Type {
    /// `.pred`.
    Pred,
    /// `.u32`.
    U32,
    /// `.s32`.
    S32,
    /// `.b32`.
    B32,
    /// `.u64`.
    U64,
    /// `.s64`.
    S64,
    /// `.b64`.
    B64,
    /// `.f32`.
    F32,
    /// `.f64`.
    F64,
}

impl Type {
    fn parse(s: &str) -> Option<Type> {
        Some(match s {
            "pred" => Type::Pred,
            "u32" => Type::U32,
            "s32" => Type::S32,
            "b32" => Type::B32,
            "u64" => Type::U64,
            "s64" => Type::S64,
            "b64" => Type::B64,
            "f32" => Type::F32,
            "f64" => Type::F64,
            _ => return None,
        })
    }

    /// Size in bytes (a predicate counts as 1).
    pub fn size(self) -> usize {
        match self {
            Type::Pred => 1,
            Type::U32 | Type::S32 | Type::B32 | Type::F32 => 4,
            Type::U64 | Type::S64 | Type::B64 | Type::F64 => 8,
        }
    }

    fn bits(self) -> u32 {
        (self.size() * 8) as u32
    }

    fn signed(self) -> bool {
        matches!(self, Type::S32 | Type::S64)
    }

    fn float(self) -> bool {
        matches!(self, Type::F32 | Type::F64)
    }

    fn mask(self, v: u64) -> u64 {
        if self.bits() >= 64 {
            v
        } else {
            v & ((1u64 << self.bits()) - 1)
        }
    }

    /// The value as a signed or unsigned integer, widened to 128 bits.
    fn int(self, v: u64) -> i128 {
        match self {
            Type::S32 => i128::from(v as u32 as i32),
            Type::S64 => i128::from(v as i64),
            _ => i128::from(self.mask(v)),
        }
    }

    fn to_f64(self, v: u64) -> f64 {
        match self {
            Type::F32 => f64::from(f32::from_bits(v as u32)),
            Type::F64 => f64::from_bits(v),
            _ => self.int(v) as f64,
        }
    }

    fn encode_f64(self, f: f64) -> u64 {
        match self {
            Type::F32 => u64::from((f as f32).to_bits()),
            _ => f.to_bits(),
        }
    }
}

/// A special register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Special {
    Tid(usize),
    Ntid(usize),
    Ctaid(usize),
    Nctaid(usize),
}

/// An instruction operand.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Operand {
    Reg(usize),
    Imm(u64),
    Special(Special),
}

/// An address operand `[base+offset]`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Base {
    Reg(usize),
    Param(usize),
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Address {
    base: Base,
    offset: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bin {
    Add,
    Sub,
    MulLo,
    MulHi,
    MulWide,
    Div,
    Rem,
    Min,
    Max,
    And,
    Or,
    Xor,
    Shl,
    Shr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Un {
    Neg,
    Abs,
    Not,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, PartialEq)]
enum Op {
    LdParam(Type, usize, Address),
    LdGlobal(Type, usize, Address),
    StGlobal(Type, Address, Operand),
    Mov(Type, usize, Operand),
    Binary(Bin, Type, usize, Operand, Operand),
    Unary(Un, Type, usize, Operand),
    /// `mad.lo`/`mad.wide` (integers) and `fma` (floats): d = a * b + c.
    Mad(Bin, Type, usize, Operand, Operand, Operand),
    Cvt(Type, Type, bool, usize, Operand),
    Setp(Cmp, Type, usize, Operand, Operand),
    Selp(Type, usize, Operand, Operand, Operand),
    Bra(usize),
    Ret,
}

#[derive(Debug, Clone, PartialEq)]
struct Instr {
    guard: Option<(usize, bool)>,
    op: Op,
}

/// A kernel parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// Its name.
    pub name: String,
    /// Its type.
    pub ty: Type,
}

/// One `.entry` of a module, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Kernel {
    /// The entry's name (`cuModuleGetFunction`'s).
    pub name: String,
    /// Its parameters, in order.
    pub params: Vec<Param>,
    regs: usize,
    code: Vec<Instr>,
}

/// A parsed module.
#[derive(Debug, Clone, PartialEq)]
pub struct Module {
    /// `.version` (major, minor): the PTX ISA version the text needs.
    pub version: (u32, u32),
    /// `.target sm_XY` as XY (`50` for `sm_50`).
    pub target: u32,
    /// The kernels.
    pub kernels: Vec<Kernel>,
}

impl Module {
    /// The kernel named `name`.
    pub fn kernel(&self, name: &str) -> Option<&Kernel> {
        self.kernels.iter().find(|k| k.name == name)
    }
}

/// Removes `//` and `/* */` comments, keeping the line breaks (for line numbers).
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '/' && chars.peek() == Some(&'/') {
            for c in chars.by_ref() {
                if c == '\n' {
                    out.push('\n');
                    break;
                }
            }
        } else if c == '/' && chars.peek() == Some(&'*') {
            chars.next();
            let mut prev = ' ';
            for c in chars.by_ref() {
                if c == '\n' {
                    out.push('\n');
                }
                if prev == '*' && c == '/' {
                    break;
                }
                prev = c;
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A cursor over the comment-free text that knows its line.
struct Cursor<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn line(&self) -> usize {
        self.text[..self.pos].matches('\n').count() + 1
    }

    fn err(&self, message: impl Into<String>) -> PtxError {
        PtxError {
            line: self.line(),
            message: message.into(),
        }
    }

    fn skip_ws(&mut self) {
        let rest = &self.text[self.pos..];
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    fn eat(&mut self, s: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    /// The text up to (not including) `end`, moving past `end`.
    fn until(&mut self, end: char) -> Result<&'a str, PtxError> {
        let rest = self.rest();
        let Some(i) = rest.find(end) else {
            return Err(self.err(format!("missing `{end}`")));
        };
        self.pos += i + end.len_utf8();
        Ok(&rest[..i])
    }

    fn word(&mut self) -> &'a str {
        self.skip_ws();
        let rest = self.rest();
        let n = rest
            .find(|c: char| !(c.is_alphanumeric() || "_$.%".contains(c)))
            .unwrap_or(rest.len());
        self.pos += n;
        &rest[..n]
    }
}

/// Parses PTX text: the directives and kernels of the subset in the module doc.
pub fn parse(text: &str) -> Result<Module, PtxError> {
    let clean = strip_comments(text);
    let mut c = Cursor {
        text: &clean,
        pos: 0,
    };
    let mut version = None;
    let mut target = None;
    let mut kernels = Vec::new();
    loop {
        c.skip_ws();
        if c.rest().is_empty() {
            break;
        }
        let line = c.line();
        let word = c.word();
        match word {
            ".version" => {
                let v = c.word();
                let parsed = v
                    .split_once('.')
                    .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
                version = Some(parsed.ok_or_else(|| c.err(format!("bad .version {v:?}")))?);
            }
            ".target" => {
                let t = c.until('\n')?.trim();
                let sm = t
                    .strip_prefix("sm_")
                    .map(|n| n.trim_end_matches(['a', 'f']))
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| PtxError {
                        line,
                        message: format!(".target {t:?} is not simulated (one sm_XY target)"),
                    })?;
                target = Some(sm);
            }
            ".address_size" => {
                let a = c.word();
                if a != "64" {
                    return Err(c.err(format!(".address_size {a} is not simulated (64 only)")));
                }
            }
            ".visible" | ".entry" => {
                if word == ".visible" && c.word() != ".entry" {
                    return Err(c.err("only .entry functions are simulated"));
                }
                kernels.push(parse_entry(&mut c)?);
            }
            "" => return Err(c.err(format!("unexpected {:?}", c.rest().chars().next()))),
            other => {
                return Err(PtxError {
                    line,
                    message: format!("`{other}` is not simulated"),
                });
            }
        }
    }
    let version = version.ok_or(PtxError {
        line: 0,
        message: "missing .version".into(),
    })?;
    let target = target.ok_or(PtxError {
        line: 0,
        message: "missing .target".into(),
    })?;
    if kernels.is_empty() {
        return Err(PtxError {
            line: 0,
            message: "no .entry".into(),
        });
    }
    Ok(Module {
        version,
        target,
        kernels,
    })
}

/// Registers of one kernel by name, with their types.
#[derive(Default)]
struct Regs {
    by_name: HashMap<String, (usize, Type)>,
}

impl Regs {
    fn declare(&mut self, name: &str, ty: Type) {
        let n = self.by_name.len();
        self.by_name.entry(name.to_string()).or_insert((n, ty));
    }
}

fn parse_entry(c: &mut Cursor<'_>) -> Result<Kernel, PtxError> {
    let name = c.word().to_string();
    if name.is_empty() {
        return Err(c.err(".entry without a name"));
    }
    let mut params = Vec::new();
    if c.eat("(") {
        let list = c.until(')')?;
        for p in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let words: Vec<&str> = p.split_whitespace().collect();
            let [".param", ty, pname] = words.as_slice() else {
                return Err(c.err(format!("parameter {p:?} is not simulated")));
            };
            let ty = ty
                .strip_prefix('.')
                .and_then(Type::parse)
                .filter(|t| *t != Type::Pred)
                .ok_or_else(|| c.err(format!("parameter type {ty} is not simulated")))?;
            params.push(Param {
                name: (*pname).to_string(),
                ty,
            });
        }
    }
    // Performance directives (.maxntid, .reqntid, ...) before the body are not simulated.
    if !c.eat("{") {
        return Err(c.err(format!("expected `{{` to open the body of {name}")));
    }
    let body_start = c.pos;
    let body = c.until('}')?;
    if body.contains('{') {
        return Err(c.err("nested blocks are not simulated"));
    }
    let first_line = c.text[..body_start].matches('\n').count() + 1;
    let mut regs = Regs::default();
    let mut labels: HashMap<String, usize> = HashMap::new();
    // (line, guard, opcode, operands)
    let mut statements: Vec<(usize, &str)> = Vec::new();
    let mut offset = 0;
    for piece in body.split(';') {
        let line = first_line + body[..offset].matches('\n').count();
        offset += piece.len() + 1;
        let mut stmt = piece.trim();
        let leading = piece.len() - piece.trim_start().len();
        let mut line = line + piece[..leading].matches('\n').count();
        // Labels before the statement.
        while let Some(i) = stmt.find(':') {
            let label = &stmt[..i];
            if label.is_empty()
                || !label
                    .chars()
                    .all(|ch| ch.is_alphanumeric() || "_$".contains(ch))
            {
                break;
            }
            labels.insert(label.to_string(), statements.len());
            let after = &stmt[i + 1..];
            line += after[..after.len() - after.trim_start().len()]
                .matches('\n')
                .count();
            stmt = after.trim();
        }
        if stmt.is_empty() {
            continue;
        }
        if let Some(decl) = stmt.strip_prefix(".reg") {
            declare_regs(decl, &mut regs).map_err(|message| PtxError { line, message })?;
            continue;
        }
        statements.push((line, stmt));
    }
    let mut code = Vec::with_capacity(statements.len());
    for (line, stmt) in statements {
        let instr = parse_instr(stmt, &regs, &params, &labels).map_err(|message| PtxError {
            line,
            message: format!("{message} (in `{stmt}`)"),
        })?;
        code.push(instr);
    }
    Ok(Kernel {
        name,
        params,
        regs: regs.by_name.len(),
        code,
    })
}

fn declare_regs(decl: &str, regs: &mut Regs) -> Result<(), String> {
    let decl = decl.trim();
    let (ty, names) = decl
        .split_once(char::is_whitespace)
        .ok_or_else(|| format!(".reg {decl:?} has no names"))?;
    let ty = ty
        .strip_prefix('.')
        .and_then(Type::parse)
        .ok_or_else(|| format!("register type {ty} is not simulated"))?;
    for name in names.split(',').map(str::trim) {
        if let Some((stem, n)) = name.split_once('<') {
            let n: usize = n
                .trim_end_matches('>')
                .parse()
                .map_err(|_| format!("bad register range {name}"))?;
            for i in 0..n {
                regs.declare(&format!("{stem}{i}"), ty);
            }
        } else {
            regs.declare(name, ty);
        }
    }
    Ok(())
}

fn split_operands(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, ch) in s.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    let last = s[start..].trim();
    if !last.is_empty() {
        out.push(last);
    }
    out
}

fn reg(s: &str, regs: &Regs) -> Result<usize, String> {
    regs.by_name
        .get(s)
        .map(|(i, _)| *i)
        .ok_or_else(|| format!("undeclared register {s}"))
}

fn special(s: &str) -> Option<Special> {
    let (name, dim) = s.split_once('.')?;
    let d = match dim {
        "x" => 0,
        "y" => 1,
        "z" => 2,
        _ => return None,
    };
    Some(match name {
        "%tid" => Special::Tid(d),
        "%ntid" => Special::Ntid(d),
        "%ctaid" => Special::Ctaid(d),
        "%nctaid" => Special::Nctaid(d),
        _ => return None,
    })
}

/// An immediate of type `ty`: integers (decimal, `0x` hex, negative), `0fXXXXXXXX` and
/// `0dXXXXXXXXXXXXXXXX` float bits, or a decimal float.
fn immediate(s: &str, ty: Type) -> Result<u64, String> {
    let bad = || format!("bad immediate {s}");
    if let Some(h) = s.strip_prefix("0f").or_else(|| s.strip_prefix("0F")) {
        let bits = u32::from_str_radix(h, 16).map_err(|_| bad())?;
        return Ok(match ty {
            Type::F64 => f64::from(f32::from_bits(bits)).to_bits(),
            _ => u64::from(bits),
        });
    }
    if let Some(h) = s.strip_prefix("0d").or_else(|| s.strip_prefix("0D")) {
        let bits = u64::from_str_radix(h, 16).map_err(|_| bad())?;
        return Ok(match ty {
            Type::F32 => u64::from((f64::from_bits(bits) as f32).to_bits()),
            _ => bits,
        });
    }
    if ty.float() {
        let f: f64 = s.parse().map_err(|_| bad())?;
        return Ok(ty.encode_f64(f));
    }
    let (neg, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s),
    };
    let v = if let Some(h) = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        u64::from_str_radix(h.trim_end_matches('U'), 16).map_err(|_| bad())?
    } else {
        digits
            .trim_end_matches('U')
            .parse::<u64>()
            .map_err(|_| bad())?
    };
    Ok(ty.mask(if neg { v.wrapping_neg() } else { v }))
}

fn operand(s: &str, ty: Type, regs: &Regs) -> Result<Operand, String> {
    if let Some(sp) = special(s) {
        return Ok(Operand::Special(sp));
    }
    if s.starts_with('%') {
        return reg(s, regs).map(Operand::Reg);
    }
    immediate(s, ty).map(Operand::Imm)
}

fn address(s: &str, regs: &Regs, params: &[Param]) -> Result<Address, String> {
    let inner = s
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .ok_or_else(|| format!("expected an address, got {s}"))?
        .trim();
    let (base, offset) = match inner.find(['+', '-']) {
        Some(i) if i > 0 => {
            let off = inner[i..].replace(' ', "");
            let off = off.strip_prefix('+').unwrap_or(&off);
            let offset: i64 = off.parse().map_err(|_| format!("bad offset in {s}"))?;
            (inner[..i].trim(), offset)
        }
        _ => (inner, 0),
    };
    let base = if base.starts_with('%') {
        Base::Reg(reg(base, regs)?)
    } else {
        Base::Param(
            params
                .iter()
                .position(|p| p.name == base)
                .ok_or_else(|| format!("unknown parameter {base}"))?,
        )
    };
    Ok(Address { base, offset })
}

fn parse_instr(
    stmt: &str,
    regs: &Regs,
    params: &[Param],
    labels: &HashMap<String, usize>,
) -> Result<Instr, String> {
    let mut rest = stmt;
    let mut guard = None;
    if let Some(g) = rest.strip_prefix('@') {
        let (p, after) = g
            .split_once(char::is_whitespace)
            .ok_or("a guard without an instruction")?;
        let (neg, p) = match p.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, p),
        };
        guard = Some((reg(p, regs)?, neg));
        rest = after.trim();
    }
    let (opcode, args) = match rest.split_once(char::is_whitespace) {
        Some((o, a)) => (o, a.trim()),
        None => (rest, ""),
    };
    let mut parts = opcode.split('.');
    let base = parts.next().unwrap_or("");
    let mods: Vec<&str> = parts.collect();
    let args = split_operands(args);
    let types: Vec<Type> = mods.iter().filter_map(|m| Type::parse(m)).collect();
    let others: Vec<&str> = mods
        .iter()
        .copied()
        .filter(|m| Type::parse(m).is_none())
        .collect();
    let one_type = || -> Result<Type, String> {
        match types.as_slice() {
            [t] => Ok(*t),
            _ => Err(format!("`{opcode}` needs one type")),
        }
    };
    let nargs = |n: usize| -> Result<(), String> {
        if args.len() == n {
            Ok(())
        } else {
            Err(format!("`{opcode}` takes {n} operands"))
        }
    };
    let only = |allowed: &[&str]| -> Result<(), String> {
        match others.iter().find(|m| !allowed.contains(m)) {
            Some(m) => Err(format!("`.{m}` of `{base}` is not simulated")),
            None => Ok(()),
        }
    };
    let dst = |i: usize| reg(args[i], regs);
    let src = |i: usize, ty: Type| operand(args[i], ty, regs);
    let op = match base {
        "ld" | "st" => {
            let ty = one_type()?;
            nargs(2)?;
            let space = others.first().copied().unwrap_or("");
            match (base, space) {
                ("ld", "param") => {
                    only(&["param"])?;
                    Op::LdParam(ty, dst(0)?, address(args[1], regs, params)?)
                }
                ("ld", "global") => {
                    only(&["global", "nc"])?;
                    Op::LdGlobal(ty, dst(0)?, address(args[1], regs, params)?)
                }
                ("st", "global") => {
                    only(&["global"])?;
                    Op::StGlobal(ty, address(args[0], regs, params)?, src(1, ty)?)
                }
                _ => return Err(format!("`{opcode}`: state space not simulated")),
            }
        }
        "mov" => {
            only(&[])?;
            nargs(2)?;
            let ty = one_type()?;
            Op::Mov(ty, dst(0)?, src(1, ty)?)
        }
        "cvta" => {
            if others != ["to", "global"] {
                return Err(format!("`{opcode}` is not simulated (cvta.to.global only)"));
            }
            nargs(2)?;
            let ty = one_type()?;
            Op::Mov(ty, dst(0)?, src(1, ty)?)
        }
        "add" | "sub" | "mul" | "div" | "rem" | "min" | "max" | "and" | "or" | "xor" | "shl"
        | "shr" => {
            nargs(3)?;
            let ty = one_type()?;
            let bin = match (base, others.first().copied()) {
                ("mul", Some("wide")) => Bin::MulWide,
                ("mul", Some("hi")) => Bin::MulHi,
                ("mul", _) => Bin::MulLo,
                ("add", _) => Bin::Add,
                ("sub", _) => Bin::Sub,
                ("div", _) => Bin::Div,
                ("rem", _) => Bin::Rem,
                ("min", _) => Bin::Min,
                ("max", _) => Bin::Max,
                ("and", _) => Bin::And,
                ("or", _) => Bin::Or,
                ("xor", _) => Bin::Xor,
                ("shl", _) => Bin::Shl,
                _ => Bin::Shr,
            };
            if ty.float() {
                only(&["rn", "ftz", "approx", "full"])?;
            } else {
                only(&["lo", "hi", "wide"])?;
            }
            // Shift amounts are .u32 whatever the value's type.
            let bty = if matches!(bin, Bin::Shl | Bin::Shr) {
                Type::U32
            } else {
                ty
            };
            Op::Binary(bin, ty, dst(0)?, src(1, ty)?, src(2, bty)?)
        }
        "mad" | "fma" => {
            nargs(4)?;
            let ty = one_type()?;
            let kind = if others.contains(&"wide") {
                Bin::MulWide
            } else {
                Bin::MulLo
            };
            if ty.float() {
                only(&["rn", "ftz"])?;
            } else {
                only(&["lo", "wide"])?;
            }
            let cty = if kind == Bin::MulWide { wide(ty) } else { ty };
            Op::Mad(kind, ty, dst(0)?, src(1, ty)?, src(2, ty)?, src(3, cty)?)
        }
        "neg" | "abs" | "not" => {
            nargs(2)?;
            only(&["ftz"])?;
            let ty = one_type()?;
            let un = match base {
                "neg" => Un::Neg,
                "abs" => Un::Abs,
                _ => Un::Not,
            };
            Op::Unary(un, ty, dst(0)?, src(1, ty)?)
        }
        "cvt" => {
            nargs(2)?;
            let [dty, sty] = types.as_slice() else {
                return Err(format!("`{opcode}` needs two types"));
            };
            only(&["rn", "rzi", "rni", "ftz", "sat"])?;
            if others.contains(&"sat") {
                return Err(format!("`{opcode}`: .sat is not simulated"));
            }
            // Float to integer truncates with .rzi, rounds to nearest even with .rni.
            let round = others.contains(&"rni");
            Op::Cvt(*dty, *sty, round, dst(0)?, src(1, *sty)?)
        }
        "setp" => {
            nargs(3)?;
            let ty = one_type()?;
            let cmp = match others.as_slice() {
                ["eq"] => Cmp::Eq,
                ["ne"] => Cmp::Ne,
                ["lt" | "lo"] => Cmp::Lt,
                ["le" | "ls"] => Cmp::Le,
                ["gt" | "hi"] => Cmp::Gt,
                ["ge" | "hs"] => Cmp::Ge,
                _ => return Err(format!("`{opcode}`: comparison not simulated")),
            };
            Op::Setp(cmp, ty, dst(0)?, src(1, ty)?, src(2, ty)?)
        }
        "selp" => {
            nargs(4)?;
            let ty = one_type()?;
            Op::Selp(ty, dst(0)?, src(1, ty)?, src(2, ty)?, src(3, Type::Pred)?)
        }
        "bra" => {
            only(&["uni"])?;
            nargs(1)?;
            Op::Bra(
                *labels
                    .get(args[0])
                    .ok_or_else(|| format!("unknown label {}", args[0]))?,
            )
        }
        "ret" | "exit" => {
            nargs(0)?;
            Op::Ret
        }
        other => return Err(format!("instruction `{other}` is not simulated")),
    };
    Ok(Instr { guard, op })
}

/// The type twice as wide (the destination of `.wide`).
fn wide(ty: Type) -> Type {
    match ty {
        Type::S32 => Type::S64,
        Type::U32 | Type::B32 => Type::U64,
        other => other,
    }
}

/// A launch's geometry: blocks in the grid and threads in a block, per dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// `gridDim`.
    pub grid: [u32; 3],
    /// `blockDim`.
    pub block: [u32; 3],
}

struct Thread<'a> {
    regs: Vec<u64>,
    tid: [u32; 3],
    ctaid: [u32; 3],
    geometry: Geometry,
    params: &'a [Vec<u8>],
}

impl Thread<'_> {
    fn value(&self, o: Operand) -> u64 {
        match o {
            Operand::Reg(r) => self.regs[r],
            Operand::Imm(v) => v,
            Operand::Special(s) => u64::from(match s {
                Special::Tid(d) => self.tid[d],
                Special::Ntid(d) => self.geometry.block[d],
                Special::Ctaid(d) => self.ctaid[d],
                Special::Nctaid(d) => self.geometry.grid[d],
            }),
        }
    }

    fn addr(&self, a: Address) -> u64 {
        match a.base {
            Base::Reg(r) => self.regs[r].wrapping_add(a.offset as u64),
            Base::Param(_) => a.offset as u64,
        }
    }
}

fn binary(bin: Bin, ty: Type, a: u64, b: u64) -> u64 {
    if ty.float() {
        let (x, y) = (ty.to_f64(a), ty.to_f64(b));
        let r = match bin {
            Bin::Add => x + y,
            Bin::Sub => x - y,
            Bin::MulLo | Bin::MulHi | Bin::MulWide => x * y,
            Bin::Div => x / y,
            Bin::Rem => x % y,
            Bin::Min => x.min(y),
            Bin::Max => x.max(y),
            // Bitwise operations take .b types, never floats (refused at parse by type).
            _ => return ty.mask(a),
        };
        // Single precision rounds each operation to f32, as the hardware does.
        return match ty {
            Type::F32 => {
                let (x, y) = (f32::from_bits(a as u32), f32::from_bits(b as u32));
                let r = match bin {
                    Bin::Add => x + y,
                    Bin::Sub => x - y,
                    Bin::MulLo | Bin::MulHi | Bin::MulWide => x * y,
                    Bin::Div => x / y,
                    Bin::Rem => x % y,
                    Bin::Min => x.min(y),
                    _ => x.max(y),
                };
                u64::from(r.to_bits())
            }
            _ => r.to_bits(),
        };
    }
    let bits = ty.bits();
    let (x, y) = (ty.int(a), ty.int(b));
    let r: i128 = match bin {
        Bin::Add => x.wrapping_add(y),
        Bin::Sub => x.wrapping_sub(y),
        Bin::MulLo | Bin::MulWide => x.wrapping_mul(y),
        Bin::MulHi => x.wrapping_mul(y) >> bits,
        Bin::Div => x.checked_div(y).unwrap_or(-1),
        Bin::Rem => x.checked_rem(y).unwrap_or(x),
        Bin::Min => x.min(y),
        Bin::Max => x.max(y),
        Bin::And => x & y,
        Bin::Or => x | y,
        Bin::Xor => x ^ y,
        Bin::Shl => {
            if b >= u64::from(bits) {
                0
            } else {
                x << b
            }
        }
        Bin::Shr => {
            let sh = b.min(u64::from(bits) - 1 + u64::from(!ty.signed()));
            if sh >= u64::from(bits) { 0 } else { x >> sh }
        }
    };
    if bin == Bin::MulWide {
        wide(ty).mask(r as u64)
    } else {
        ty.mask(r as u64)
    }
}

fn compare(cmp: Cmp, ty: Type, a: u64, b: u64) -> bool {
    let ord = if ty.float() {
        let (x, y) = (ty.to_f64(a), ty.to_f64(b));
        match x.partial_cmp(&y) {
            Some(o) => o,
            // Ordered comparisons with NaN are false; `ne` of NaN is false too in PTX.
            None => return false,
        }
    } else {
        ty.int(a).cmp(&ty.int(b))
    };
    use std::cmp::Ordering::*;
    match cmp {
        Cmp::Eq => ord == Equal,
        Cmp::Ne => ord != Equal,
        Cmp::Lt => ord == Less,
        Cmp::Le => ord != Greater,
        Cmp::Gt => ord == Greater,
        Cmp::Ge => ord != Less,
    }
}

fn convert(dty: Type, sty: Type, round: bool, v: u64) -> u64 {
    match (dty.float(), sty.float()) {
        (true, true) => dty.encode_f64(sty.to_f64(v)),
        (true, false) => match dty {
            Type::F32 => u64::from((sty.int(v) as f32).to_bits()),
            _ => (sty.int(v) as f64).to_bits(),
        },
        (false, true) => {
            let f = sty.to_f64(v);
            let f = if round {
                f.round_ties_even()
            } else {
                f.trunc()
            };
            // Out-of-range values saturate, as PTX's float-to-integer conversions do.
            let i = if dty.signed() {
                let (lo, hi) = if dty.bits() == 32 {
                    (f64::from(i32::MIN), f64::from(i32::MAX))
                } else {
                    (i64::MIN as f64, i64::MAX as f64)
                };
                if f.is_nan() {
                    0
                } else {
                    f.clamp(lo, hi) as i64 as u64
                }
            } else {
                let hi = if dty.bits() == 32 {
                    f64::from(u32::MAX)
                } else {
                    u64::MAX as f64
                };
                if f.is_nan() {
                    0
                } else {
                    f.clamp(0.0, hi) as u64
                }
            };
            dty.mask(i)
        }
        (false, false) => dty.mask(sty.int(v) as u64),
    }
}

impl Kernel {
    /// Runs the kernel over `geometry` with `params` (each parameter's bytes, in order)
    /// against `memory`. Threads run one after the other; the first fault ends the launch.
    pub fn launch(
        &self,
        geometry: Geometry,
        params: &[Vec<u8>],
        memory: &mut dyn Memory,
    ) -> Result<(), LaunchError> {
        if params.len() != self.params.len() {
            return Err(LaunchError::Arguments {
                kernel: self.name.clone(),
                expected: self.params.len(),
            });
        }
        let [gx, gy, gz] = geometry.grid;
        let [bx, by, bz] = geometry.block;
        for cz in 0..gz {
            for cy in 0..gy {
                for cx in 0..gx {
                    for tz in 0..bz {
                        for ty in 0..by {
                            for tx in 0..bx {
                                let mut t = Thread {
                                    regs: vec![0; self.regs],
                                    tid: [tx, ty, tz],
                                    ctaid: [cx, cy, cz],
                                    geometry,
                                    params,
                                };
                                self.run(&mut t, memory)?;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn run(&self, t: &mut Thread<'_>, memory: &mut dyn Memory) -> Result<(), LaunchError> {
        let mut pc = 0;
        let mut steps = 0u64;
        while pc < self.code.len() {
            steps += 1;
            if steps > MAX_STEPS {
                return Err(LaunchError::Timeout);
            }
            let instr = &self.code[pc];
            pc += 1;
            if let Some((p, neg)) = instr.guard
                && (t.regs[p] != 0) == neg
            {
                continue;
            }
            match instr.op {
                Op::LdParam(ty, d, a) => {
                    let Base::Param(i) = a.base else {
                        return Err(LaunchError::IllegalAddress(t.addr(a)));
                    };
                    let bytes = &t.params[i];
                    let at = a.offset as usize;
                    let mut buf = [0u8; 8];
                    let n = ty.size();
                    let src = bytes
                        .get(at..at + n)
                        .ok_or(LaunchError::IllegalAddress(a.offset as u64))?;
                    buf[..n].copy_from_slice(src);
                    t.regs[d] = u64::from_le_bytes(buf);
                }
                Op::LdGlobal(ty, d, a) => {
                    let addr = t.addr(a);
                    let n = ty.size();
                    if !addr.is_multiple_of(n as u64) {
                        return Err(LaunchError::Misaligned(addr));
                    }
                    let mut buf = [0u8; 8];
                    memory
                        .read(addr, &mut buf[..n])
                        .map_err(LaunchError::IllegalAddress)?;
                    t.regs[d] = u64::from_le_bytes(buf);
                }
                Op::StGlobal(ty, a, s) => {
                    let addr = t.addr(a);
                    let n = ty.size();
                    if !addr.is_multiple_of(n as u64) {
                        return Err(LaunchError::Misaligned(addr));
                    }
                    let v = t.value(s).to_le_bytes();
                    memory
                        .write(addr, &v[..n])
                        .map_err(LaunchError::IllegalAddress)?;
                }
                Op::Mov(ty, d, s) => t.regs[d] = ty.mask(t.value(s)),
                Op::Binary(bin, ty, d, a, b) => {
                    t.regs[d] = binary(bin, ty, t.value(a), t.value(b));
                }
                Op::Unary(un, ty, d, a) => {
                    let v = t.value(a);
                    t.regs[d] = match (un, ty) {
                        (Un::Not, _) => ty.mask(!v),
                        (Un::Neg, Type::F32) => v ^ 0x8000_0000,
                        (Un::Neg, Type::F64) => v ^ (1 << 63),
                        (Un::Abs, Type::F32) => v & 0x7fff_ffff,
                        (Un::Abs, Type::F64) => v & !(1 << 63),
                        (Un::Neg, _) => ty.mask(ty.int(v).wrapping_neg() as u64),
                        (Un::Abs, _) => ty.mask(ty.int(v).unsigned_abs() as u64),
                    };
                }
                Op::Mad(kind, ty, d, a, b, c) => {
                    let (a, b, c) = (t.value(a), t.value(b), t.value(c));
                    t.regs[d] = match ty {
                        // Fused: one rounding, as the hardware's fma.
                        Type::F32 => {
                            let r = f32::from_bits(a as u32)
                                .mul_add(f32::from_bits(b as u32), f32::from_bits(c as u32));
                            u64::from(r.to_bits())
                        }
                        Type::F64 => f64::from_bits(a)
                            .mul_add(f64::from_bits(b), f64::from_bits(c))
                            .to_bits(),
                        _ => {
                            let p = binary(kind, ty, a, b);
                            let sum_ty = if kind == Bin::MulWide { wide(ty) } else { ty };
                            binary(Bin::Add, sum_ty, p, c)
                        }
                    };
                }
                Op::Cvt(dty, sty, round, d, s) => {
                    t.regs[d] = convert(dty, sty, round, t.value(s));
                }
                Op::Setp(cmp, ty, d, a, b) => {
                    t.regs[d] = u64::from(compare(cmp, ty, t.value(a), t.value(b)));
                }
                Op::Selp(ty, d, a, b, p) => {
                    t.regs[d] = ty.mask(if t.value(p) != 0 {
                        t.value(a)
                    } else {
                        t.value(b)
                    });
                }
                Op::Bra(target) => pc = target,
                Op::Ret => return Ok(()),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory of one allocation at 0x1000.
    struct Flat(Vec<u8>);

    impl Memory for Flat {
        fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), u64> {
            let at = addr.checked_sub(0x1000).ok_or(addr)? as usize;
            buf.copy_from_slice(self.0.get(at..at + buf.len()).ok_or(addr)?);
            Ok(())
        }
        fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), u64> {
            let at = addr.checked_sub(0x1000).ok_or(addr)? as usize;
            self.0
                .get_mut(at..at + data.len())
                .ok_or(addr)?
                .copy_from_slice(data);
            Ok(())
        }
    }

    const SAXPY: &str = r#"
//
// saxpy: y[i] = a * x[i] + y[i]
//
.version 6.0
.target sm_50
.address_size 64

.visible .entry saxpy(
	.param .u64 saxpy_param_0,
	.param .u64 saxpy_param_1,
	.param .f32 saxpy_param_2,
	.param .u32 saxpy_param_3
)
{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<5>;
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<8>;

	ld.param.u64 	%rd1, [saxpy_param_0];
	ld.param.u64 	%rd2, [saxpy_param_1];
	ld.param.f32 	%f1, [saxpy_param_2];
	ld.param.u32 	%r2, [saxpy_param_3];
	mov.u32 	%r3, %ctaid.x;
	mov.u32 	%r4, %ntid.x;
	mov.u32 	%r5, %tid.x;
	mad.lo.s32 	%r1, %r3, %r4, %r5;
	setp.ge.u32 	%p1, %r1, %r2;
	@%p1 bra 	$L__BB0_2;

	cvta.to.global.u64 	%rd3, %rd1;
	cvta.to.global.u64 	%rd4, %rd2;
	mul.wide.u32 	%rd5, %r1, 4;
	add.s64 	%rd6, %rd3, %rd5;
	ld.global.f32 	%f2, [%rd6];
	add.s64 	%rd7, %rd4, %rd5;
	ld.global.f32 	%f3, [%rd7];
	fma.rn.f32 	%f4, %f1, %f2, %f3;
	st.global.f32 	[%rd7], %f4;

$L__BB0_2:
	ret;
}
"#;

    fn params(x: u64, y: u64, a: f32, n: u32) -> Vec<Vec<u8>> {
        vec![
            x.to_le_bytes().to_vec(),
            y.to_le_bytes().to_vec(),
            a.to_le_bytes().to_vec(),
            n.to_le_bytes().to_vec(),
        ]
    }

    #[test]
    fn saxpy_computes_every_element_and_stops_at_n() {
        let module = parse(SAXPY).expect("parses");
        assert_eq!((module.version, module.target), ((6, 0), 50));
        let k = module.kernel("saxpy").expect("kernel");
        let n = 100u32;
        // x at 0x1000 (n floats), y right after, one float of slack after y.
        let mut bytes = Vec::new();
        for i in 0..n {
            bytes.extend_from_slice(&(i as f32).to_le_bytes());
        }
        for i in 0..=n {
            bytes.extend_from_slice(&(1.5 * i as f32).to_le_bytes());
        }
        let mut mem = Flat(bytes);
        let y = 0x1000 + 4 * u64::from(n);
        let geo = Geometry {
            grid: [2, 1, 1],
            block: [64, 1, 1],
        };
        k.launch(geo, &params(0x1000, y, 2.0, n), &mut mem)
            .expect("runs");
        for i in 0..=n as usize {
            let at = 4 * (n as usize + i);
            let got = f32::from_le_bytes(mem.0[at..at + 4].try_into().expect("4"));
            let want = if i < n as usize {
                2.0 * i as f32 + 1.5 * i as f32
            } else {
                1.5 * i as f32
            };
            assert_eq!(got, want, "element {i}");
        }
    }

    #[test]
    fn out_of_bounds_access_is_an_illegal_address() {
        let k = parse(SAXPY).expect("parses").kernels.remove(0);
        let mut mem = Flat(vec![0; 16]);
        let geo = Geometry {
            grid: [1, 1, 1],
            block: [8, 1, 1],
        };
        let err = k
            .launch(geo, &params(0x1000, 0x1008, 1.0, 8), &mut mem)
            .expect_err("faults");
        assert!(matches!(err, LaunchError::IllegalAddress(_)), "{err}");
    }

    #[test]
    fn unsupported_and_broken_text_is_refused_with_its_line() {
        let shared = SAXPY.replace("ret;", "bar.sync 0;\n\tret;");
        let err = parse(&shared).expect_err("bar.sync");
        assert!(err.message.contains("bar"), "{err}");
        assert_eq!(err.line, 43, "{err}");
        let undeclared = SAXPY.replace("%f4, %f1", "%f9, %f1");
        assert!(
            parse(&undeclared)
                .expect_err("undeclared")
                .message
                .contains("%f9")
        );
        assert!(parse(&SAXPY.replace(".version 6.0", "")).is_err());
        assert!(parse("garbage").is_err());
        assert!(parse(&SAXPY[..SAXPY.len() / 2]).is_err());
    }

    #[test]
    fn integer_float_and_conversion_semantics() {
        assert_eq!(
            binary(Bin::MulWide, Type::S32, u64::from(-3i32 as u32), 4),
            -12i64 as u64
        );
        assert_eq!(binary(Bin::MulHi, Type::U32, 0x8000_0000, 4), 2);
        assert_eq!(
            binary(Bin::Shr, Type::S32, u64::from(-8i32 as u32), 1),
            u64::from(-4i32 as u32)
        );
        assert_eq!(binary(Bin::Shr, Type::U32, 0xffff_fff8, 1), 0x7fff_fffc);
        assert_eq!(binary(Bin::Add, Type::U32, 0xffff_ffff, 1), 0);
        assert!(compare(Cmp::Lt, Type::S32, u64::from(-1i32 as u32), 0));
        assert!(!compare(Cmp::Lt, Type::U32, u64::from(-1i32 as u32), 0));
        assert_eq!(
            convert(Type::S32, Type::F32, false, u64::from((-2.7f32).to_bits())),
            u64::from(-2i32 as u32)
        );
        assert_eq!(
            convert(Type::F32, Type::U32, false, 3),
            u64::from(3.0f32.to_bits())
        );
        assert_eq!(
            convert(Type::S64, Type::S32, false, u64::from(-1i32 as u32)),
            u64::MAX
        );
        assert_eq!(
            immediate("0f3F800000", Type::F32),
            Ok(u64::from(1.0f32.to_bits()))
        );
        assert_eq!(immediate("-1", Type::S32), Ok(0xffff_ffff));
    }

    #[test]
    fn a_loop_that_never_ends_times_out() {
        let text = ".version 6.0\n.target sm_50\n.address_size 64\n.visible .entry spin()\n{\nL: bra L;\n}\n";
        let k = parse(text).expect("parses").kernels.remove(0);
        let geo = Geometry {
            grid: [1, 1, 1],
            block: [1, 1, 1],
        };
        assert_eq!(
            k.launch(geo, &[], &mut Flat(Vec::new())),
            Err(LaunchError::Timeout)
        );
    }
}
