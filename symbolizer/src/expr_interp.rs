//! The name of the expression interpreter of a stripped Postgres: `ExecInterpExpr`, the static
//! function that evaluates every qual and projection (61% of a filtered scan's time, inclusive)
//! and that a stripped build otherwise leaves `postgres+0x<start>`.
//!
//! The exported `ExecReadyInterpretedExpr` readies an expression for it: it stores the
//! interpreter into `ExprState.evalfunc_private` (`state->evalfunc_private = (void *)
//! ExecInterpExpr;`), beside the `ExecJust*` fast paths it stores there for expressions of two or
//! three steps, and it calls it once directly (the inlined `ExecInitInterpreter`:
//! `(void) ExecInterpExpr(NULL, NULL, NULL)` returns the computed-goto dispatch table). The one
//! function both stored there and called is the interpreter. Nothing is guessed: a build that
//! does not inline `ExecInitInterpreter` (the call is then to it) names none, and only a function
//! start no symbol names is named.

use std::collections::BTreeSet;

use crate::callees;
use crate::elf::ElfData;
use crate::exec_nodes::stored_at;
use crate::functions::FunctionRanges;
use crate::symbols::SymbolTable;

/// The exported function that readies an expression for the interpreter.
const READY: &str = "ExecReadyInterpretedExpr";

/// The interpreter's name in the Postgres source (13 through 18).
pub(crate) const INTERPRETER: &str = "ExecInterpExpr";

/// Offset of `evalfunc_private` in `ExprState` (`NodeTag type; uint8 flags; bool resnull; Datum
/// resvalue; TupleTableSlot *resultslot; struct ExprEvalStep *steps; ExprStateEvalFunc
/// evalfunc; Expr *expr; void *evalfunc_private;`), the same on x86-64 from Postgres 14 through
/// 18 (checked against their server headers).
const EVALFUNC_PRIVATE_OFFSET: u64 = 0x30;

/// The start of the interpreter in `elf`, when no symbol names it and its code says which it is;
/// None otherwise (not a Postgres binary, a build with symbols, or code that does not say).
pub(crate) fn interpreter(elf: &ElfData, symbols: &SymbolTable, functions: &FunctionRanges) -> Option<u64> {
    let start = symbols.address_of(READY)?;
    let extent = functions.lookup(start).filter(|fde| fde.start == start)?;
    let stored = stored_at(elf.code_bytes(&extent)?, &extent, EVALFUNC_PRIVATE_OFFSET)?;
    let called = callees::in_elf(elf, &extent).ok()?;
    let both: BTreeSet<u64> = stored
        .intersection(&called)
        .copied()
        .filter(|&a| functions.lookup(a).is_some_and(|f| f.start == a))
        .collect();
    let mut all = both.into_iter();
    match (all.next(), all.next()) {
        (Some(interpreter), None) if symbols.at(interpreter).is_none() => Some(interpreter),
        _ => None,
    }
}
