//! Names for the executor's per-node functions of a stripped Postgres (`ExecSeqScan`,
//! `ExecHashJoin`, `ExecAgg`, …), read from the exported functions that install them.
//!
//! Each per-node function is static, so a stripped build has no symbol for it, but the exported
//! `ExecInit<Node>` that builds the node's state stores its address into
//! `PlanState.ExecProcNode` (`scanstate->ss.ps.ExecProcNode = ExecSeqScan;`). In position-
//! independent x86-64 code that is a `lea reg, [rip+X]` followed by `mov [base+0x18], reg`:
//! decoding `ExecInit<Node>` finds `X`, which is then named `Exec<Node>`. Nothing is guessed: an
//! `ExecInit*` storing several distinct functions there names none of them, and only a
//! function start (an `.eh_frame` FDE) that no symbol names is named.
//!
//! Scan nodes tail-call the exported `ExecScan` with their access method as second argument
//! (`return ExecScan(&node->ss, SeqNext, SeqRecheck);`), so `ExecSeqScan` leaves no frame on
//! the stack: the access method, decoded the same way from the node function (`lea rsi,
//! [rip+X]` before `jmp ExecScan`), is named (`SeqNext`) and counted as the scan node.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Arc;

use iced_x86::{Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};

use crate::elf::ElfData;
use crate::functions::FunctionRanges;
use crate::symbols::SymbolTable;

/// Offset of `ExecProcNode` in `PlanState` (`NodeTag type; Plan *plan; EState *state;
/// ExecProcNodeMtd ExecProcNode;`), the same on x86-64 from Postgres 10 through 18 (checked
/// against the server headers of 14, 15, 16, 17 and 18).
const EXEC_PROC_NODE_OFFSET: u64 = 0x18;

/// The exported functions that install a node's `ExecProcNode`.
const INIT_PREFIX: &str = "ExecInit";

/// `ExecInitNode` is the dispatcher, not a node type: it installs the wrapper
/// `ExecProcNodeFirst` (through an inlined `ExecSetExecProcNode`) into every node.
const NOT_A_NODE: &[&str] = &["Node"];

/// The scan nodes whose per-node function tail-calls the exported `ExecScan` with one access
/// method (`return ExecScan(&node->ss, SeqNext, SeqRecheck);`), and that method's name in the
/// Postgres source (the same in 13 through 18, read from the symbol tables of those builds).
/// The tail call leaves no frame of `ExecSeqScan` on the stack, only `ExecScan` (shared by all
/// scans) and the access method below it: the access method is what says which scan it is.
/// `IndexScan` has two (`IndexNext`, `IndexNextWithReorder`), chosen at run time, so neither
/// gets a name, but both still count as an index scan.
const SCAN_ACCESS_METHODS: &[(&str, &str)] = &[
    ("SeqScan", "SeqNext"),
    ("IndexOnlyScan", "IndexOnlyNext"),
    ("BitmapHeapScan", "BitmapHeapNext"),
    ("SampleScan", "SampleNext"),
    ("TidScan", "TidNext"),
    ("TidRangeScan", "TidRangeNext"),
    ("FunctionScan", "FunctionNext"),
    ("ValuesScan", "ValuesNext"),
    ("CteScan", "CteScanNext"),
    ("SubqueryScan", "SubqueryNext"),
    ("ForeignScan", "ForeignNext"),
    ("WorkTableScan", "WorkTableScanNext"),
    ("NamedTuplestoreScan", "NamedTuplestoreScanNext"),
    ("TableFuncScan", "TableFuncNext"),
];

/// The exported function the scan nodes tail-call with their access method.
const EXEC_SCAN: &str = "ExecScan";

/// The plan node functions of one module: the function each exported `ExecInit<Node>` installs,
/// by start address, with its node type (`SeqScan`).
#[derive(Debug, Default)]
pub(crate) struct ExecNodes {
    /// Start (stated address) of each installed function no symbol names, with its derived
    /// name: `Exec<Node>`, or the scan access method's name (`SeqNext`); and the expression
    /// interpreter's, `ExecInterpExpr` (crate::expr_interp).
    pub derived: HashMap<u64, Arc<str>>,
    /// Every function that runs a node of a type, by the name its frames get (`ExecSeqScan` →
    /// `SeqScan`): the installed ones and the scans' access methods (named by symbol, derived,
    /// or left `module+0x<start>` when the code does not say which is which), and the exported
    /// `MultiExec<Node>` of nodes that return a bitmap or a hash table instead of tuples
    /// (`MultiExecHash`).
    pub node_types: BTreeMap<Arc<str>, Arc<str>>,
}

impl ExecNodes {
    /// Decodes every exported `ExecInit<Node>` of `elf`, whose frames are named after
    /// `basename` where nothing names them; empty for a module without them.
    pub fn derive(
        elf: &ElfData,
        symbols: &SymbolTable,
        functions: &FunctionRanges,
        basename: &str,
    ) -> ExecNodes {
        let mut found = ExecNodes::default();
        let exec_scan = symbols.address_of(EXEC_SCAN);
        for (init, start, size) in symbols.with_prefix(INIT_PREFIX) {
            let node = &init[INIT_PREFIX.len()..];
            if node.is_empty() || NOT_A_NODE.contains(&node) {
                continue;
            }
            let node_type: Arc<str> = Arc::from(node);
            let Some(installed) = decode(elf, functions, start, size, |code, extent| {
                stored_at_exec_proc_node(code, extent)
            }) else {
                continue;
            };
            let installed = function_starts(installed, functions);
            // Several distinct functions: which is which is in the source, not in the code.
            found.name_if_single(&installed, symbols, || format!("Exec{node}"));
            let access = SCAN_ACCESS_METHODS.iter().find(|(scan, _)| *scan == node);
            for &function in &installed {
                found.count_as(function, &node_type, symbols, basename);
                let methods = exec_scan.and_then(|exec_scan| {
                    decode(elf, functions, function, 0, |code, extent| {
                        passed_to(code, extent, exec_scan, Register::RSI)
                    })
                });
                let methods = function_starts(methods.unwrap_or_default(), functions);
                if let Some((_, method)) = access.filter(|_| installed.len() == 1) {
                    found.name_if_single(&methods, symbols, || method.to_string());
                }
                for &method in &methods {
                    found.count_as(method, &node_type, symbols, basename);
                }
            }
            let multi = format!("MultiExec{node}");
            if symbols.address_of(&multi).is_some() {
                found.node_types.insert(Arc::from(multi), node_type);
            }
        }
        // Not a node's: the expression interpreter, which evaluates the nodes' quals and
        // projections (crate::expr_interp).
        if let Some(interpreter) = crate::expr_interp::interpreter(elf, symbols, functions) {
            let name = Arc::from(crate::expr_interp::INTERPRETER);
            found.derived.insert(interpreter, name);
        }
        found
    }

    /// Names the one function of `starts` when it is alone and no symbol names it.
    fn name_if_single(
        &mut self,
        starts: &BTreeSet<u64>,
        symbols: &SymbolTable,
        name: impl FnOnce() -> String,
    ) {
        let mut all = starts.iter();
        if let (Some(&start), None) = (all.next(), all.next()) {
            if symbols.at(start).is_none() {
                self.derived.insert(start, Arc::from(name()));
            }
        }
    }

    /// Counts the frames of the function at `start` as node `node_type`, under the name they
    /// get (see [`crate::module`]'s naming: a symbol, a derived name, else `module+0x<start>`).
    fn count_as(&mut self, start: u64, node_type: &Arc<str>, symbols: &SymbolTable, basename: &str) {
        let name = match (symbols.at(start), self.derived.get(&start)) {
            (Some(symbol), _) => symbol.clone(),
            (None, Some(derived)) => derived.clone(),
            (None, None) => Arc::from(format!("{basename}+0x{start:x}")),
        };
        self.node_types.insert(name, node_type.clone());
    }
}

/// Runs `read` over the code of the function starting at `start`; its extent is the FDE starting
/// there, else `size` bytes when a symbol gives a size. None when neither is known, the bytes
/// are not in the file, or `read` gives no answer.
fn decode<T>(
    elf: &ElfData,
    functions: &FunctionRanges,
    start: u64,
    size: u64,
    read: impl FnOnce(&[u8], &Range<u64>) -> Option<T>,
) -> Option<T> {
    let extent = match functions.lookup(start) {
        Some(fde) if fde.start == start => fde,
        _ if size > 0 => start..start.saturating_add(size),
        _ => return None,
    };
    read(elf.code_bytes(&extent)?, &extent)
}

/// The addresses of `addresses` at which a function (an FDE) starts.
fn function_starts(addresses: BTreeSet<u64>, functions: &FunctionRanges) -> BTreeSet<u64> {
    addresses
        .into_iter()
        .filter(|&a| functions.lookup(a).is_some_and(|f| f.start == a))
        .collect()
}

/// The code addresses that `code` (the bytes of `function`) stores at offset
/// [`EXEC_PROC_NODE_OFFSET`] of a structure, as `lea reg, [rip+X]` then `mov [base+0x18], reg`;
/// None when an instruction cannot be decoded (wrong extent or bytes: better no answer).
pub(crate) fn stored_at_exec_proc_node(code: &[u8], function: &Range<u64>) -> Option<BTreeSet<u64>> {
    stored_at(code, function, EXEC_PROC_NODE_OFFSET)
}

/// The code addresses that `code` (the bytes of `function`) stores at offset `offset` of a
/// structure, as `lea reg, [rip+X]` then `mov [base+offset], reg`; None when an instruction
/// cannot be decoded.
pub(crate) fn stored_at(code: &[u8], function: &Range<u64>, offset: u64) -> Option<BTreeSet<u64>> {
    let mut stored = BTreeSet::new();
    track_leas(code, function, |instruction, loaded| {
        if instruction.mnemonic() != Mnemonic::Mov || instruction.op0_kind() != OpKind::Memory {
            return;
        }
        let to_field = is_gpr64(instruction.memory_base())
            && instruction.memory_index() == Register::None
            && instruction.memory_displacement64() == offset
            && instruction.op1_kind() == OpKind::Register;
        if let Some(targets) = loaded.get(&instruction.op1_register()).filter(|_| to_field) {
            stored.extend(targets);
        }
    })?;
    Some(stored)
}

/// The code addresses `code` (the bytes of `function`) passes in `register` (loaded by a
/// `lea reg, [rip+X]`) to a direct call or jump to `callee`.
pub(crate) fn passed_to(
    code: &[u8],
    function: &Range<u64>,
    callee: u64,
    register: Register,
) -> Option<BTreeSet<u64>> {
    let mut passed = BTreeSet::new();
    track_leas(code, function, |instruction, loaded| {
        let branch = matches!(instruction.mnemonic(), Mnemonic::Call | Mnemonic::Jmp)
            && instruction.op0_kind() == OpKind::NearBranch64
            && instruction.near_branch64() == callee;
        if let Some(arguments) = loaded.get(&register).filter(|_| branch) {
            passed.extend(arguments);
        }
    })?;
    Some(passed)
}

/// What is known of the registers before an instruction: the 64-bit registers that hold a
/// rip-relative address set by a `lea`, with every address they can hold there.
type Loaded = HashMap<Register, BTreeSet<u64>>;

/// Decodes `code`, the bytes of `function`, and shows `visit` each instruction with what
/// [`Loaded`] says before it. Branches are followed: where paths join (a `jmp` to a shared
/// `mov [rbx+0x18], rax` after one `lea rax` per case), a register is known only if every path
/// into the join sets it, and may then hold any of their addresses. The target of a backward
/// branch (a loop) knows nothing, and after a jump through a switch table only what held at
/// that jump holds. None when an instruction cannot be decoded.
fn track_leas(
    code: &[u8],
    function: &Range<u64>,
    mut visit: impl FnMut(&Instruction, &Loaded),
) -> Option<()> {
    let mut decoder = Decoder::with_ip(64, code, function.start, DecoderOptions::NONE);
    let mut instructions = Vec::new();
    // Per branch target inside the function: whether a branch at or after it goes there.
    let mut targets: HashMap<u64, bool> = HashMap::new();
    while decoder.can_decode() {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            return None;
        }
        if is_jump(&instruction) && function.contains(&instruction.near_branch64()) {
            let backward = instruction.near_branch64() <= instruction.ip();
            *targets.entry(instruction.near_branch64()).or_insert(false) |= backward;
        }
        instructions.push(instruction);
    }
    let mut loaded = Some(Loaded::new());
    // States carried by forward branches to their targets, merged.
    let mut incoming: HashMap<u64, Loaded> = HashMap::new();
    // The states at the jumps through a switch table so far, merged.
    let mut dispatched: Option<Loaded> = None;
    for instruction in &instructions {
        match targets.get(&instruction.ip()) {
            Some(true) => loaded = Some(Loaded::new()),
            Some(false) => {
                if let Some(carried) = incoming.remove(&instruction.ip()) {
                    loaded = Some(match loaded {
                        Some(fallen_through) => merge(&fallen_through, &carried),
                        None => carried,
                    });
                }
            }
            None => {}
        }
        // Any instruction after a switch's jump may be one of its cases: what holds there
        // must hold at the jump too. (Cases lie after the jump, as GCC and Clang lay them out;
        // blocks after a `jmp` or `ret` start knowing nothing anyway.)
        if let (Some(state), Some(switch)) = (loaded.as_mut(), dispatched.as_ref()) {
            *state = merge(state, switch);
        }
        // Reached by no branch and not by falling through (after a `jmp` or `ret`).
        let state = loaded.get_or_insert_with(Loaded::new);
        visit(instruction, state);
        let mnemonic = instruction.mnemonic();
        if mnemonic == Mnemonic::Jmp && instruction.op0_kind() != OpKind::NearBranch64 {
            dispatched = Some(match dispatched {
                Some(earlier) => merge(&earlier, state),
                None => state.clone(),
            });
            loaded = None;
            continue;
        }
        if is_jump(instruction) {
            let target = instruction.near_branch64();
            if function.contains(&target) && target > instruction.ip() {
                let carried = match incoming.remove(&target) {
                    Some(earlier) => merge(&earlier, state),
                    None => state.clone(),
                };
                incoming.insert(target, carried);
            }
            if mnemonic == Mnemonic::Jmp {
                loaded = None;
            }
            continue;
        }
        match mnemonic {
            Mnemonic::Lea
                if instruction.op0_kind() == OpKind::Register
                    && is_gpr64(instruction.op0_register())
                    && instruction.is_ip_rel_memory_operand() =>
            {
                let address = BTreeSet::from([instruction.ip_rel_memory_address()]);
                state.insert(instruction.op0_register(), address);
            }
            // A call clobbers registers.
            Mnemonic::Call => state.clear(),
            Mnemonic::Ret => loaded = None,
            _ => forget_written(instruction, state),
        }
    }
    Some(())
}

/// Whether `instruction` is a direct jump, conditional or not (`jmp`, `jcc`, `loop`, …): every
/// instruction with a near branch target but `call`.
fn is_jump(instruction: &Instruction) -> bool {
    instruction.op0_kind() == OpKind::NearBranch64 && instruction.mnemonic() != Mnemonic::Call
}

/// What holds where two paths join: the registers both know, with the addresses of either.
fn merge(a: &Loaded, b: &Loaded) -> Loaded {
    a.iter()
        .filter_map(|(register, addresses)| {
            let other = b.get(register)?;
            Some((*register, addresses.union(other).copied().collect()))
        })
        .collect()
}

/// Drops what an instruction may overwrite. Which operands an instruction writes is not known
/// without iced's instruction-info tables, so this is conservative: a general-purpose register
/// destination (or any alias of it: `eax`, `r12d`, `al`) drops that register, any other
/// register destination (vector registers, which can also be written from a GPR's value) and
/// the exchanges (which write their source too) drop them all.
fn forget_written(instruction: &Instruction, loaded: &mut Loaded) {
    if loaded.is_empty() {
        return;
    }
    let exchanges = matches!(
        instruction.mnemonic(),
        Mnemonic::Xchg | Mnemonic::Xadd | Mnemonic::Cmpxchg
    );
    if exchanges {
        loaded.clear();
        return;
    }
    if instruction.op_count() == 0 || instruction.op0_kind() != OpKind::Register {
        return;
    }
    match gpr64_of(instruction.op0_register()) {
        Some(register) => {
            loaded.remove(&register);
        }
        None => loaded.clear(),
    }
}

/// The 64-bit register that a general-purpose register (of any width) is part of. iced's own
/// `full_register` needs its instruction-info feature; the numbering (`AL`…`R15L`, `AX`…`R15W`,
/// `EAX`…`R15D`, `RAX`…`R15`, each in `rax rcx rdx rbx rsp rbp rsi rdi r8`… order, with
/// `AH`…`BH` after `BL`) is iced's stable public enum.
fn gpr64_of(register: Register) -> Option<Register> {
    let number = register as u32;
    let index = match number {
        n if (Register::AL as u32..=Register::BL as u32).contains(&n) => n - Register::AL as u32,
        n if (Register::AH as u32..=Register::BH as u32).contains(&n) => n - Register::AH as u32,
        n if (Register::SPL as u32..=Register::R15L as u32).contains(&n) => n - Register::SPL as u32 + 4,
        n if (Register::AX as u32..=Register::R15W as u32).contains(&n) => n - Register::AX as u32,
        n if (Register::EAX as u32..=Register::R15D as u32).contains(&n) => n - Register::EAX as u32,
        n if (Register::RAX as u32..=Register::R15 as u32).contains(&n) => n - Register::RAX as u32,
        _ => return None,
    };
    GPR64.get(usize::try_from(index).ok()?).copied()
}

const GPR64: [Register; 16] = [
    Register::RAX,
    Register::RCX,
    Register::RDX,
    Register::RBX,
    Register::RSP,
    Register::RBP,
    Register::RSI,
    Register::RDI,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
];

/// `rax` … `r15` (iced's own test needs its instruction-info feature).
fn is_gpr64(register: Register) -> bool {
    (Register::RAX as u32..=Register::R15 as u32).contains(&(register as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rel32` little-endian bytes of `target - next_ip`.
    fn rel32(target: u64, next_ip: u64) -> [u8; 4] {
        let delta = i32::try_from(target as i64 - next_ip as i64).expect("in range");
        delta.to_le_bytes()
    }

    #[test]
    fn finds_a_lea_stored_at_the_field_through_any_base() {
        let mut code = Vec::new();
        // 0x1000: lea rax, [rip+…] → 0x5000
        code.extend_from_slice(&[0x48, 0x8d, 0x05]);
        code.extend_from_slice(&rel32(0x5000, 0x1007));
        // 0x1007: mov [rbx+0x18], rax
        code.extend_from_slice(&[0x48, 0x89, 0x43, 0x18]);
        // 0x100b: lea rdx, [rip+…] → 0x6000, stored at +0x20 (another field): not kept
        code.extend_from_slice(&[0x48, 0x8d, 0x15]);
        code.extend_from_slice(&rel32(0x6000, 0x1012));
        // 0x1012: mov [r12+0x20], rdx
        code.extend_from_slice(&[0x49, 0x89, 0x54, 0x24, 0x20]);
        // 0x1017: mov [r12+0x18], rdx (a nested struct's base): kept
        code.extend_from_slice(&[0x49, 0x89, 0x54, 0x24, 0x18]);
        // 0x101c: ret
        code.push(0xc3);
        let function = 0x1000..0x1000 + code.len() as u64;
        let stored = stored_at_exec_proc_node(&code, &function).expect("valid code");
        assert_eq!(stored, BTreeSet::from([0x5000, 0x6000]));
    }

    #[test]
    fn an_overwritten_register_or_a_call_forgets_the_address() {
        let mut code = Vec::new();
        // 0x1000: lea rax, [rip+…] → 0x5000
        code.extend_from_slice(&[0x48, 0x8d, 0x05]);
        code.extend_from_slice(&rel32(0x5000, 0x1007));
        // 0x1007: mov eax, 1 (a 32-bit write zero-extends into rax)
        code.extend_from_slice(&[0xb8, 0x01, 0x00, 0x00, 0x00]);
        // 0x100c: mov [rbx+0x18], rax
        code.extend_from_slice(&[0x48, 0x89, 0x43, 0x18]);
        // 0x1010: lea rcx, [rip+…] → 0x5000
        code.extend_from_slice(&[0x48, 0x8d, 0x0d]);
        code.extend_from_slice(&rel32(0x5000, 0x1017));
        // 0x1017: call rax
        code.extend_from_slice(&[0xff, 0xd0]);
        // 0x1019: mov [rbx+0x18], rcx
        code.extend_from_slice(&[0x48, 0x89, 0x4b, 0x18]);
        code.push(0xc3);
        let function = 0x1000..0x1000 + code.len() as u64;
        let stored = stored_at_exec_proc_node(&code, &function).expect("valid code");
        assert!(stored.is_empty(), "{stored:x?}");
    }

    #[test]
    fn paths_joining_at_the_store_give_every_address() {
        // PG18's ExecInitSeqScan: one `lea rax` per case, each jumping to one shared store.
        let mut code = Vec::new();
        // 0x1000: je 0x1010
        code.extend_from_slice(&[0x0f, 0x84]);
        code.extend_from_slice(&rel32(0x1010, 0x1006));
        // 0x1006: lea rax, [rip+…] → 0x5000
        code.extend_from_slice(&[0x48, 0x8d, 0x05]);
        code.extend_from_slice(&rel32(0x5000, 0x100d));
        // 0x100d: jmp short 0x1017
        code.extend_from_slice(&[0xeb, 0x08]);
        // 0x100f: nop
        code.push(0x90);
        // 0x1010: lea rax, [rip+…] → 0x6000, falling through to the store
        code.extend_from_slice(&[0x48, 0x8d, 0x05]);
        code.extend_from_slice(&rel32(0x6000, 0x1017));
        // 0x1017: mov [rbx+0x18], rax
        code.extend_from_slice(&[0x48, 0x89, 0x43, 0x18]);
        code.push(0xc3);
        let function = 0x1000..0x1000 + code.len() as u64;
        let stored = stored_at_exec_proc_node(&code, &function).expect("valid code");
        assert_eq!(stored, BTreeSet::from([0x5000, 0x6000]));
    }

    #[test]
    fn a_loop_head_or_a_switch_case_knows_only_what_holds_on_every_path() {
        let mut code = Vec::new();
        // 0x1000: lea rax, [rip+…] → 0x5000
        code.extend_from_slice(&[0x48, 0x8d, 0x05]);
        code.extend_from_slice(&rel32(0x5000, 0x1007));
        // 0x1007: mov [rbx+0x18], rax (a loop head: reached again from below)
        code.extend_from_slice(&[0x48, 0x89, 0x43, 0x18]);
        // 0x100b: lea rcx, [rip+…] → 0x6000
        code.extend_from_slice(&[0x48, 0x8d, 0x0d]);
        code.extend_from_slice(&rel32(0x6000, 0x1012));
        // 0x1012: jmp rdx (a switch), leaving rcx known
        code.extend_from_slice(&[0xff, 0xe2]);
        // 0x1014: lea rax, [rip+…] → 0x7000, then a case may enter before the store
        code.extend_from_slice(&[0x48, 0x8d, 0x05]);
        code.extend_from_slice(&rel32(0x7000, 0x101b));
        // 0x101b: nop; 0x101c: mov [rbx+0x18], rax; 0x1020: mov [rbx+0x18], rcx
        code.push(0x90);
        code.extend_from_slice(&[0x48, 0x89, 0x43, 0x18]);
        code.extend_from_slice(&[0x48, 0x89, 0x4b, 0x18]);
        // 0x1024: jne 0x1007 (back to the loop head)
        code.extend_from_slice(&[0x0f, 0x85]);
        code.extend_from_slice(&rel32(0x1007, 0x102a));
        code.push(0xc3);
        let function = 0x1000..0x1000 + code.len() as u64;
        let stored = stored_at_exec_proc_node(&code, &function).expect("valid code");
        assert!(stored.is_empty(), "{stored:x?}");
    }

    #[test]
    fn finds_the_argument_passed_to_a_tail_call() {
        let mut code = Vec::new();
        // 0x1000: lea rdx, [rip+…] → 0x5000 (the recheck method, third argument)
        code.extend_from_slice(&[0x48, 0x8d, 0x15]);
        code.extend_from_slice(&rel32(0x5000, 0x1007));
        // 0x1007: lea rsi, [rip+…] → 0x6000 (the access method, second argument)
        code.extend_from_slice(&[0x48, 0x8d, 0x35]);
        code.extend_from_slice(&rel32(0x6000, 0x100e));
        // 0x100e: jmp 0x9000 (ExecScan)
        code.push(0xe9);
        code.extend_from_slice(&rel32(0x9000, 0x1013));
        // 0x1013: lea rsi, [rip+…] → 0x7000, then call 0x8000 (another function): not kept
        code.extend_from_slice(&[0x48, 0x8d, 0x35]);
        code.extend_from_slice(&rel32(0x7000, 0x101a));
        code.push(0xe8);
        code.extend_from_slice(&rel32(0x8000, 0x101f));
        let function = 0x1000..0x1000 + code.len() as u64;
        let passed = passed_to(&code, &function, 0x9000, Register::RSI).expect("valid code");
        assert_eq!(passed, BTreeSet::from([0x6000]));
    }

    #[test]
    fn register_aliases_map_to_their_64_bit_register() {
        assert_eq!(gpr64_of(Register::AH), Some(Register::RAX));
        assert_eq!(gpr64_of(Register::BL), Some(Register::RBX));
        assert_eq!(gpr64_of(Register::SIL), Some(Register::RSI));
        assert_eq!(gpr64_of(Register::R12D), Some(Register::R12));
        assert_eq!(gpr64_of(Register::R15L), Some(Register::R15));
        assert_eq!(gpr64_of(Register::DI), Some(Register::RDI));
        assert_eq!(gpr64_of(Register::R9), Some(Register::R9));
        assert_eq!(gpr64_of(Register::XMM0), None);
    }

    #[test]
    fn undecodable_code_gives_no_answer() {
        // `lea rax, [rip+…]` cut short by the function's end.
        let code = [0x48, 0x8d, 0x05, 0x00];
        assert_eq!(stored_at_exec_proc_node(&code, &(0x1000..0x1004)), None);
    }

    /// Exported functions after a node function among which one names its node.
    const FOLLOWING: usize = 3;

    /// The distro's stripped Postgres 15: its per-node functions have no symbol at all.
    const DISTRO_POSTGRES: &str = "/usr/lib/postgresql/15/bin/postgres";

    fn distro_postgres() -> (ElfData, SymbolTable, FunctionRanges) {
        let path = std::path::Path::new(DISTRO_POSTGRES);
        let elf = ElfData::open(path)
            .unwrap_or_else(|e| panic!("{DISTRO_POSTGRES} is needed for this test (postgresql-15): {e}"));
        assert!(!elf.has_symtab, "the distro build is stripped");
        let mut symbols = SymbolTable::default();
        symbols.add(&elf.object().expect("parse"), crate::symbols::Origin::DynSym);
        symbols.finish();
        let functions = FunctionRanges::from_elf(&elf);
        (elf, symbols, functions)
    }

    #[test]
    fn names_the_node_functions_of_the_stripped_distro_postgres() {
        let (elf, symbols, functions) = distro_postgres();
        let nodes = ExecNodes::derive(&elf, &symbols, &functions, "postgres");
        let by_name: HashMap<&str, u64> = nodes.derived.iter().map(|(a, n)| (&**n, *a)).collect();
        assert_eq!(
            by_name.len(),
            nodes.derived.len(),
            "one function per name: {by_name:x?}"
        );
        for node in [
            "SeqScan",
            "IndexScan",
            "IndexOnlyScan",
            "BitmapHeapScan",
            "HashJoin",
            "NestLoop",
            "MergeJoin",
            "Sort",
            "Agg",
            "Limit",
            "Material",
            "Append",
            "Gather",
            "Result",
            "ProjectSet",
            "ModifyTable",
            "Unique",
            "Memoize",
        ] {
            let name = format!("Exec{node}");
            let Some(&start) = by_name.get(name.as_str()) else {
                panic!("{name} not derived: {by_name:x?}");
            };
            assert_eq!(functions.lookup(start).map(|f| f.start), Some(start), "{name}");
            assert_eq!(symbols.at(start), None, "{name} had a symbol");
            assert_eq!(nodes.node_types.get(name.as_str()).map(|t| &**t), Some(node));
            // A static function sits in its node's source file (`nodeSeqscan.c`): the exported
            // functions right after it belong to the same node (`ExecSeqScanEstimate`,
            // `ExecInitSeqScan`, …). Node functions are often the file's first function, so
            // the one before it is another file's.
            let mut after: Vec<(Arc<str>, u64, u64)> = symbols
                .with_prefix("")
                .into_iter()
                .filter(|(_, addr, _)| *addr > start)
                .collect();
            after.sort_by_key(|(_, addr, _)| *addr);
            let next: Vec<&str> = after.iter().take(FOLLOWING).map(|(n, _, _)| &**n).collect();
            assert!(
                next.iter().any(|n| n.contains(node)),
                "{name} at {start:#x} is followed by {next:?}"
            );
        }
        // Hash's ExecProcNode only raises an error (the hash table is built by
        // `MultiExecHash`), so the compiler puts it among the cold code of every file;
        // nodeWindowAgg.c's exported functions are the window-function API (`WinGetFuncArg…`).
        for (name, node) in [("ExecHash", "Hash"), ("ExecWindowAgg", "WindowAgg")] {
            let start = by_name
                .get(name)
                .copied()
                .unwrap_or_else(|| panic!("{name} not derived"));
            assert_eq!(symbols.at(start), None);
            assert_eq!(nodes.node_types.get(name).map(|t| &**t), Some(node));
        }
        assert_eq!(nodes.node_types.get("MultiExecHash").map(|t| &**t), Some("Hash"));
        // The scans' access methods, below the shared `ExecScan` their node functions
        // tail-call: named where the node has one, counted as the node either way.
        for (method, node) in [("SeqNext", "SeqScan"), ("IndexOnlyNext", "IndexOnlyScan")] {
            let start = by_name
                .get(method)
                .copied()
                .unwrap_or_else(|| panic!("{method} not derived"));
            assert_eq!(functions.lookup(start).map(|f| f.start), Some(start));
            assert_eq!(symbols.at(start), None);
            assert_eq!(nodes.node_types.get(method).map(|t| &**t), Some(node));
        }
        let index_scan: Vec<&str> = nodes
            .node_types
            .iter()
            .filter(|(_, node)| &***node == "IndexScan")
            .map(|(name, _)| &**name)
            .collect();
        assert_eq!(
            index_scan.len(),
            3,
            "ExecIndexScan and its two access methods: {index_scan:?}"
        );
        assert!(index_scan.contains(&"ExecIndexScan"));
        assert_eq!(
            index_scan.iter().filter(|n| n.starts_with("postgres+0x")).count(),
            2
        );
        // The dispatcher's wrapper is no node, and expression or slot set-up is no node either.
        assert!(!by_name
            .keys()
            .any(|n| matches!(*n, "ExecNode" | "ExecExpr" | "ExecQual")));
    }
}
