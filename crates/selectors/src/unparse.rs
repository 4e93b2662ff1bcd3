//! Prints a parsed CEL expression back as source, for messages that quote a part of a
//! selector (`device.attributes['gpu.nvidia.com'].index`). Covers what selectors use;
//! comprehensions (macros) print as `...`.

use cel::common::ast::{EntryExpr, Expr, IdedExpr, LiteralValue, operators};

/// The source text of `e`, normalised (single quotes, spaces around operators).
pub(crate) fn unparse(e: &IdedExpr) -> String {
    match &e.expr {
        Expr::Ident(name) => name.clone(),
        Expr::Literal(lit) => literal(lit),
        Expr::Select(s) if s.test => format!("has({}.{})", operand(&s.operand), s.field),
        Expr::Select(s) => format!("{}.{}", operand(&s.operand), s.field),
        Expr::List(l) => format!(
            "[{}]",
            l.elements
                .iter()
                .map(unparse)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Expr::Map(m) => {
            let entries: Vec<String> = m
                .entries
                .iter()
                .map(|en| match &en.expr {
                    EntryExpr::MapEntry(me) => {
                        format!("{}: {}", unparse(&me.key), unparse(&me.value))
                    }
                    EntryExpr::StructField(f) => format!("{}: {}", f.field, unparse(&f.value)),
                })
                .collect();
            format!("{{{}}}", entries.join(", "))
        }
        Expr::Call(c) => call(&c.func_name, c.target.as_deref(), &c.args),
        Expr::Comprehension(_) | Expr::Struct(_) | Expr::Unspecified => "...".to_owned(),
    }
}

fn literal(lit: &LiteralValue) -> String {
    match lit {
        LiteralValue::Boolean(b) => format!("{}", b.inner()),
        LiteralValue::Int(i) => format!("{}", i.inner()),
        LiteralValue::UInt(u) => format!("{}u", u.inner()),
        LiteralValue::Double(d) => format!("{}", d.inner()),
        LiteralValue::String(s) => format!("'{}'", s.inner().replace('\'', "\\'")),
        LiteralValue::Bytes(_) => "b'...'".to_owned(),
        LiteralValue::Null => "null".to_owned(),
    }
}

/// An operand of `.`: parenthesised unless it is atomic.
fn operand(e: &IdedExpr) -> String {
    wrapped(e, ATOM)
}

const ATOM: u8 = 7;
const UNARY: u8 = 6;

/// Binding strength of `e`'s outermost operator (higher binds tighter).
fn precedence(e: &IdedExpr) -> u8 {
    let Expr::Call(c) = &e.expr else { return ATOM };
    if c.target.is_some() {
        return ATOM;
    }
    match c.func_name.as_str() {
        operators::CONDITIONAL => 0,
        operators::LOGICAL_OR => 1,
        operators::LOGICAL_AND => 2,
        operators::ADD | operators::SUBSTRACT => 4,
        operators::MULTIPLY | operators::DIVIDE | operators::MODULO => 5,
        operators::LOGICAL_NOT | operators::NEGATE => UNARY,
        f if infix(f).is_some() => 3,
        _ => ATOM,
    }
}

/// `e`, parenthesised when it binds looser than `min`.
fn wrapped(e: &IdedExpr, min: u8) -> String {
    if precedence(e) < min {
        format!("({})", unparse(e))
    } else {
        unparse(e)
    }
}

fn infix(func: &str) -> Option<&'static str> {
    Some(match func {
        operators::LOGICAL_AND => "&&",
        operators::LOGICAL_OR => "||",
        operators::EQUALS => "==",
        operators::NOT_EQUALS => "!=",
        operators::LESS => "<",
        operators::LESS_EQUALS => "<=",
        operators::GREATER => ">",
        operators::GREATER_EQUALS => ">=",
        operators::IN => "in",
        operators::ADD => "+",
        operators::SUBSTRACT => "-",
        operators::MULTIPLY => "*",
        operators::DIVIDE => "/",
        operators::MODULO => "%",
        _ => return None,
    })
}

fn call(func: &str, target: Option<&IdedExpr>, args: &[IdedExpr]) -> String {
    if let (None, Some(op), [a, b]) = (target, infix(func), args) {
        let own = precedence(&IdedExpr {
            id: 0,
            expr: Expr::Call(cel::common::ast::CallExpr {
                func_name: func.to_owned(),
                target: None,
                args: Vec::new(),
            }),
        });
        return format!("{} {op} {}", wrapped(a, own), wrapped(b, own + 1));
    }
    match (func, target, args) {
        (operators::INDEX, None, [a, b]) => format!("{}[{}]", operand(a), unparse(b)),
        (operators::LOGICAL_NOT, None, [a]) => format!("!{}", wrapped(a, UNARY)),
        (operators::NEGATE, None, [a]) => format!("-{}", wrapped(a, UNARY)),
        (operators::CONDITIONAL, None, [c, t, f]) => {
            format!("{} ? {} : {}", wrapped(c, 1), wrapped(t, 1), wrapped(f, 0))
        }
        _ => {
            let args = args.iter().map(unparse).collect::<Vec<_>>().join(", ");
            match target {
                Some(t) => format!("{}.{func}({args})", operand(t)),
                None => format!("{func}({args})"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_print_back_as_written() {
        for src in [
            "device.attributes['gpu.nvidia.com'].index == 0",
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
            "device.driver == 'gpu.nvidia.com' && (a || !b)",
            "'uuid' in device.attributes['gpu.nvidia.com']",
            "has(device.attributes['x'].y)",
        ] {
            let e = cel::parser::Parser::new().parse(src).unwrap();
            assert_eq!(unparse(&e), src);
        }
    }
}
