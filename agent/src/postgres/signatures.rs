//! Probe signatures: where, in one Postgres major, a probed function keeps the argument values
//! the function probes read. Each major's table gives the signature of every function it knows
//! ([`super::VersionTable::probe_args`]); a function it does not know is refused by name, never
//! read with another major's layout (`_bt_getroot` gained an argument in 16, `pgss_store` two in
//! 18).

use crate::bpf::abi::{ArgField, Function, ProbeArgs, ARG_REGISTERS};

/// A probeable function's signature in one major.
#[derive(Clone, Copy, Debug)]
pub struct ProbeSignature {
    /// The C prototype in this major's source, parameters named as Postgres names them. The
    /// major's header test redeclares it against the server headers (a conflicting
    /// redeclaration does not compile), and `args` are checked against its parameters.
    pub prototype: &'static str,
    /// The server header declaring it, or None for a static function (`pgss_store`), whose
    /// prototype the table cites from the source instead. Read by the major's header test.
    #[cfg_attr(not(test), allow(dead_code))]
    pub header: Option<&'static str>,
    /// The 1-based integer-class argument position (see [`ARG_REGISTERS`]) of each value the
    /// probe reads.
    pub args: &'static [(ArgField, u8)],
}

/// Why a function's arguments cannot be read in an instance's major.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error(
        "pgscope does not know the signature of `{function}` in PostgreSQL {major}, and reading \
         its arguments with another major's layout would record garbage; leave it out of the \
         probes on this instance"
    )]
    Unknown { function: &'static str, major: u32 },
    #[error(
        "the PostgreSQL {major} signature of `{function}` (`{prototype}`) places no `{parameter}` \
         argument, which its probe reads"
    )]
    Unplaced {
        function: &'static str,
        major: u32,
        prototype: &'static str,
        parameter: &'static str,
    },
    #[error(
        "the PostgreSQL {major} signature of `{function}` (`{prototype}`) has `{parameter}` as \
         integer argument {position}; probes read arguments 1 to {ARG_REGISTERS} only"
    )]
    NotARegister {
        function: &'static str,
        major: u32,
        prototype: &'static str,
        parameter: &'static str,
        position: u8,
    },
}

impl ProbeSignature {
    /// The positions the entry program reads `function`'s values at, in major `major`.
    pub fn probe_args(&self, function: Function, major: u32) -> Result<ProbeArgs, SignatureError> {
        let mut args = ProbeArgs::default();
        for &field in function.argument_fields() {
            let parameter = field.parameter();
            let &(_, position) =
                self.args
                    .iter()
                    .find(|(f, _)| *f == field)
                    .ok_or(SignatureError::Unplaced {
                        function: function.name(),
                        major,
                        prototype: self.prototype,
                        parameter,
                    })?;
            if position == 0 || position > ARG_REGISTERS {
                return Err(SignatureError::NotARegister {
                    function: function.name(),
                    major,
                    prototype: self.prototype,
                    parameter,
                    position,
                });
            }
            *field.position_in(&mut args) = position;
        }
        Ok(args)
    }
}

/// Where `pgss_store` keeps the values its probe reads, the same from 14 to 18: `queryId` is
/// its 2nd argument and `kind` its 5th in every major (`total_time`, a double, comes after
/// them). What changes after `rows` (14 has no `jitusage`, 18 adds two parallel-worker counts)
/// travels on the stack and is not read. Checked on each major's upstream build: its
/// `pgss_ExecutorEnd` loads `PGSS_EXEC` (1) into the 5th argument register, `r8`, before the call.
pub(super) const PGSS_STORE_ARGS: &[(ArgField, u8)] = &[(ArgField::QueryId, 2), (ArgField::PgssKind, 5)];

/// `pgss_store` of 14: static in contrib/pg_stat_statements/pg_stat_statements.c, so no
/// header declares it; no `jitusage` yet (it came with pg_stat_statements 1.10, in 15). No 14
/// source is in the registries here: the upstream 14.23 build's `pgss_ExecutorEnd` passes 3
/// arguments on the stack (`bufusage`, `walusage`, `jstate`) after the six register ones.
pub(super) const PGSS_STORE_14: ProbeSignature = ProbeSignature {
    prototype: "void pgss_store(const char *query, uint64 queryId, int query_location, int query_len, \
                pgssStoreKind kind, double total_time, uint64 rows, const BufferUsage *bufusage, \
                const WalUsage *walusage, JumbleState *jstate)",
    header: None,
    args: PGSS_STORE_ARGS,
};

/// `pgss_store` of 15 to 17 (read in Debian's 15 source; the 16.14 and 17.10 upstream builds'
/// `pgss_ExecutorEnd` pass the same 4 stack arguments: `bufusage`, `walusage`, `jitusage`,
/// `jstate`).
pub(super) const PGSS_STORE_15_TO_17: ProbeSignature = ProbeSignature {
    prototype: "void pgss_store(const char *query, uint64 queryId, int query_location, int query_len, \
                pgssStoreKind kind, double total_time, uint64 rows, const BufferUsage *bufusage, \
                const WalUsage *walusage, const struct JitInstrumentation *jitusage, JumbleState *jstate)",
    header: None,
    args: PGSS_STORE_ARGS,
};

/// `pgss_store` of 18 (read in Debian's postgresql-18 18.6 source): `queryId` became int64, and
/// two parallel-worker counts follow `jstate`.
pub(super) const PGSS_STORE_18: ProbeSignature = ProbeSignature {
    prototype: "void pgss_store(const char *query, int64 queryId, int query_location, int query_len, \
                pgssStoreKind kind, double total_time, uint64 rows, const BufferUsage *bufusage, \
                const WalUsage *walusage, const struct JitInstrumentation *jitusage, JumbleState *jstate, \
                int parallel_workers_to_launch, int parallel_workers_launched)",
    header: None,
    args: PGSS_STORE_ARGS,
};

/// `_bt_getroot` of 14 and 15; 16 added `heaprel` before `access` (no argument is read).
pub(super) const BT_GETROOT_UNTIL_15: ProbeSignature = ProbeSignature {
    prototype: "Buffer _bt_getroot(Relation rel, int access)",
    header: Some("access/nbtree.h"),
    args: &[],
};

/// `_bt_getroot` from 16 on.
pub(super) const BT_GETROOT_FROM_16: ProbeSignature = ProbeSignature {
    prototype: "Buffer _bt_getroot(Relation rel, Relation heaprel, int access)",
    header: Some("access/nbtree.h"),
    args: &[],
};

/// The signatures that have not changed from 14 to 18: each major's header test compiles them
/// against that major's headers, so a change in a later major fails there. None for the
/// functions whose signature differs between majors (`pgss_store`, `_bt_getroot`): each
/// major's table gives those itself.
pub(super) fn unchanged_since_14(function: Function) -> Option<ProbeSignature> {
    let (prototype, header, args): (_, _, &'static [(ArgField, u8)]) = match function {
        Function::SLock => (
            "int s_lock(volatile slock_t *lock, const char *file, int line, const char *func)",
            "storage/s_lock.h",
            &[
                (ArgField::SpinFile, 2),
                (ArgField::SpinLine, 3),
                (ArgField::SpinFunc, 4),
            ],
        ),
        Function::LockRelationOid => (
            "void LockRelationOid(Oid relid, LOCKMODE lockmode)",
            "storage/lmgr.h",
            &[(ArgField::RelId, 1), (ArgField::LockMode, 2)],
        ),
        Function::GetCachedPlan => (
            "CachedPlan *GetCachedPlan(CachedPlanSource *plansource, ParamListInfo boundParams, \
             ResourceOwner owner, QueryEnvironment *queryEnv)",
            "utils/plancache.h",
            &[],
        ),
        Function::PortalStart => (
            "void PortalStart(Portal portal, ParamListInfo params, int eflags, Snapshot snapshot)",
            "tcop/pquery.h",
            &[],
        ),
        Function::VacUpdateDatfrozenxid => ("void vac_update_datfrozenxid(void)", "commands/vacuum.h", &[]),
        Function::PgssStore | Function::BtGetroot | Function::Named(_) => return None,
    };
    Some(ProbeSignature {
        prototype,
        header: Some(header),
        args,
    })
}

/// A prototype taken apart: the function's name and its parameters as (type, name), types with
/// their whitespace normalized (`const char *`).
#[cfg(test)]
pub(crate) fn parse_prototype(prototype: &str) -> Option<(&str, Vec<(String, &str)>)> {
    let (head, rest) = prototype.split_once('(')?;
    let name = head.rsplit(|c: char| c.is_whitespace() || c == '*').next()?;
    let list = rest.strip_suffix(')')?.trim();
    let mut parameters = Vec::new();
    if list != "void" {
        for parameter in list.split(',') {
            let parameter = parameter.trim();
            let start = parameter.rfind(|c: char| !(c.is_alphanumeric() || c == '_'))? + 1;
            let ty = parameter[..start].replace('*', " * ");
            let ty = ty.split_whitespace().collect::<Vec<_>>().join(" ");
            parameters.push((ty.replace("* *", "**"), &parameter[start..]));
        }
    }
    Some((name, parameters))
}

/// The 1-based integer-class position of parameter `name`: floating-point parameters before it
/// travel in xmm registers and do not count.
#[cfg(test)]
pub(crate) fn integer_position(parameters: &[(String, &str)], name: &str) -> Option<u8> {
    let index = parameters.iter().position(|(_, n)| *n == name)?;
    let integers = parameters[..index]
        .iter()
        .filter(|(ty, _)| !matches!(ty.as_str(), "double" | "float"))
        .count();
    u8::try_from(integers + 1).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::{table_for, VersionTable, TABLES};

    /// The C types the entry program's reads are right for: it reads a whole register and
    /// keeps 32 bits of `relid`, `lockmode`, `kind` and `line`, 64 of the others.
    fn types_read_as(field: ArgField) -> &'static [&'static str] {
        match field {
            ArgField::RelId => &["Oid"],
            ArgField::LockMode => &["LOCKMODE"],
            // int64 from 18: the same register, the same bits.
            ArgField::QueryId => &["uint64", "int64"],
            ArgField::PgssKind => &["pgssStoreKind"],
            ArgField::SpinFile | ArgField::SpinFunc => &["const char *"],
            ArgField::SpinLine => &["int"],
        }
    }

    #[test]
    fn prototypes_come_apart_into_names_and_integer_positions() {
        let (name, parameters) =
            parse_prototype("CachedPlan *f(const char *a, double t, volatile slock_t *lock, int **x)")
                .expect("a prototype");
        assert_eq!(name, "f");
        assert_eq!(
            parameters,
            vec![
                ("const char *".to_string(), "a"),
                ("double".to_string(), "t"),
                ("volatile slock_t *".to_string(), "lock"),
                ("int **".to_string(), "x"),
            ]
        );
        assert_eq!(integer_position(&parameters, "a"), Some(1));
        assert_eq!(
            integer_position(&parameters, "lock"),
            Some(2),
            "the double is in xmm0"
        );
        assert_eq!(integer_position(&parameters, "x"), Some(3));
        assert_eq!(integer_position(&parameters, "nosuch"), None);
        assert_eq!(parse_prototype("void g(void)").expect("valid").1, vec![]);
    }

    /// Every table's positions are those of the parameters its prototypes name, of a type the
    /// entry program reads correctly, and place every value the probe reads.
    #[test]
    fn every_tables_positions_match_its_prototypes() {
        for table in TABLES {
            for function in Function::ALL {
                let Some(signature) = (table.probe_signature)(function) else {
                    continue;
                };
                let context = format!("PostgreSQL {} `{}`", table.major, signature.prototype);
                let (name, parameters) = parse_prototype(signature.prototype).expect(&context);
                assert_eq!(name, function.name(), "{context}");
                for &(field, position) in signature.args {
                    let parameter = field.parameter();
                    assert_eq!(
                        integer_position(&parameters, parameter),
                        Some(position),
                        "{context}: position of `{parameter}`"
                    );
                    let (ty, _) = parameters
                        .iter()
                        .find(|(_, n)| *n == parameter)
                        .expect("found above");
                    assert!(
                        types_read_as(field).contains(&ty.as_str()),
                        "{context}: `{parameter}` is `{ty}`"
                    );
                }
                assert!(table.probe_args(function).is_ok(), "{context}");
            }
        }
    }

    #[test]
    fn every_major_places_arguments_where_the_probes_read_them() {
        for table in TABLES {
            let major = table.major;
            let args = |function| table.probe_args(function).expect("every function is known");
            let lock = args(Function::LockRelationOid);
            assert_eq!((lock.relid, lock.lockmode), (1, 2), "{major}");
            let pgss = args(Function::PgssStore);
            assert_eq!((pgss.query_id, pgss.pgss_kind), (2, 5), "{major}");
            let spin = args(Function::SLock);
            assert_eq!(
                (spin.spin_file, spin.spin_line, spin.spin_func),
                (2, 3, 4),
                "{major}"
            );
            for function in [
                Function::GetCachedPlan,
                Function::PortalStart,
                Function::VacUpdateDatfrozenxid,
                Function::BtGetroot,
            ] {
                assert_eq!(
                    args(function),
                    ProbeArgs::default(),
                    "{major}: {function:?} reads no argument"
                );
            }
            let bt_getroot = (table.probe_signature)(Function::BtGetroot).expect("known");
            assert_eq!(
                bt_getroot.prototype.contains("heaprel"),
                major >= 16,
                "{major}: `_bt_getroot` gained `heaprel` in 16"
            );
        }
    }

    /// A table like 15's whose signatures come from `signature`.
    fn table_with(signature: fn(Function) -> Option<ProbeSignature>) -> VersionTable {
        VersionTable {
            major: 99,
            probe_signature: signature,
            ..*table_for(15).expect("supported")
        }
    }

    #[test]
    fn refuses_a_function_the_table_does_not_know_by_name() {
        let table = table_with(|function| match function {
            Function::BtGetroot => None,
            other => (table_for(15).expect("supported").probe_signature)(other),
        });
        let error = table.probe_args(Function::BtGetroot).expect_err("unknown");
        assert_eq!(
            error,
            SignatureError::Unknown {
                function: "_bt_getroot",
                major: 99
            }
        );
        let message = error.to_string();
        assert!(
            message.contains("`_bt_getroot`") && message.contains("PostgreSQL 99"),
            "{message}"
        );
        assert!(table.probe_args(Function::LockRelationOid).is_ok());
    }

    /// An s_lock whose call site is passed on the stack.
    const S_LOCK_PAST_THE_REGISTERS: &str =
        "int s_lock(int a, int b, int c, int d, int e, int f, const char *file, int line, const char *func)";

    #[test]
    fn refuses_a_signature_that_misses_or_misplaces_a_value_read() {
        let table = table_with(|function| match function {
            Function::LockRelationOid => Some(ProbeSignature {
                prototype: "void LockRelationOid(Oid relid)",
                header: None,
                args: &[(ArgField::RelId, 1)],
            }),
            Function::SLock => Some(ProbeSignature {
                prototype: S_LOCK_PAST_THE_REGISTERS,
                header: None,
                args: &[
                    (ArgField::SpinFile, 7),
                    (ArgField::SpinLine, 8),
                    (ArgField::SpinFunc, 9),
                ],
            }),
            _ => None,
        });
        assert_eq!(
            table.probe_args(Function::LockRelationOid),
            Err(SignatureError::Unplaced {
                function: "LockRelationOid",
                major: 99,
                prototype: "void LockRelationOid(Oid relid)",
                parameter: "lockmode"
            })
        );
        assert_eq!(
            table.probe_args(Function::SLock),
            Err(SignatureError::NotARegister {
                function: "s_lock",
                major: 99,
                prototype: S_LOCK_PAST_THE_REGISTERS,
                parameter: "file",
                position: 7
            })
        );
    }
}
