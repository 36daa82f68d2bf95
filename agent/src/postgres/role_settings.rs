//! A setting as the sessions of one database and role start with it, from the catalog, for
//! settings whose variable cannot be read from a backend's memory
//! (`pg_stat_statements.track_planning` is static in its library). Postgres applies
//! `pg_db_role_setting` at connection in this order of precedence (`process_settings`):
//! (database, role) > (any database, role) > (database, any role) > (any, any), over the
//! server-wide value (postgresql.conf, `ALTER SYSTEM`, the command line). A `SET` in the
//! session, `PGOPTIONS` or a client's startup options come after all of these and cannot be seen
//! from the catalog.
//!
//! The server-wide value is pg_settings' where pgscope's own session has it from the server
//! (its `source` is not a per-database, per-role or per-client one); otherwise the applied row
//! of pg_file_settings (readable by superusers and pg_read_all_settings); otherwise unknown.

use std::collections::{BTreeSet, HashMap};

use anyhow::{Context, Result};
use tokio_postgres::Client;

use super::sql::SessionSetting;

/// pg_settings sources that mean the value is the server's, not pgscope's own session's.
const SERVER_SOURCES: [&str; 6] = [
    "default",
    "environment variable",
    "configuration file",
    "command line",
    "override",
    // `dynamic default`: computed by the server at start (e.g. shared_buffers' unit).
    "dynamic default",
];

/// `name`'s value in a `setconfig` array (`name=value` entries), the last entry naming it
/// (names compare as Postgres compares GUC names: case-insensitively).
pub fn setconfig_value<'a>(setconfig: &'a [String], name: &str) -> Option<&'a str> {
    setconfig.iter().rev().find_map(|entry| {
        let (key, value) = entry.split_once('=')?;
        key.trim().eq_ignore_ascii_case(name).then_some(value)
    })
}

/// A boolean setting's text as Postgres' `parse_bool` reads it: `on`, `off`, `true`, `false`,
/// `yes`, `no`, `1`, `0`, and unique prefixes of the words, in any case.
pub fn parse_bool(text: &str) -> Option<bool> {
    let text = text.trim().trim_matches('\'').to_ascii_lowercase();
    let prefix_of = |word: &str, min: usize| text.len() >= min && word.starts_with(text.as_str());
    match text.as_str() {
        "1" => Some(true),
        "0" => Some(false),
        _ if prefix_of("true", 1) || prefix_of("yes", 1) || prefix_of("on", 2) => Some(true),
        _ if prefix_of("false", 1) || prefix_of("no", 1) || prefix_of("off", 2) => Some(false),
        _ => None,
    }
}

/// One row of pg_db_role_setting (0: any database, or any role).
#[derive(Clone, Debug)]
pub struct CatalogRow {
    pub database: u32,
    pub role: u32,
    pub setconfig: Vec<String>,
}

/// The server-wide value and why it is known or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerValue {
    Known(bool),
    /// pgscope's own session has it from `source`, which hides the server's.
    Hidden {
        source: String,
    },
}

/// Names for the OIDs a source quotes.
#[derive(Debug, Default)]
pub struct Names {
    pub databases: HashMap<u32, String>,
    pub roles: HashMap<u32, String>,
}

impl Names {
    fn database(&self, oid: u32) -> String {
        self.databases
            .get(&oid)
            .cloned()
            .unwrap_or_else(|| format!("(OID {oid})"))
    }

    fn role(&self, oid: u32) -> String {
        self.roles
            .get(&oid)
            .cloned()
            .unwrap_or_else(|| format!("(OID {oid})"))
    }
}

/// `name` as sessions of `database` and `role` start with it, by Postgres' precedence.
pub fn resolve(
    name: &str,
    database: u32,
    role: u32,
    rows: &[CatalogRow],
    server: &ServerValue,
    names: &Names,
) -> SessionSetting {
    let levels = [(database, role), (0, role), (database, 0), (0, 0)];
    let found = levels.iter().find_map(|&(db, r)| {
        let row = rows.iter().find(|row| row.database == db && row.role == r)?;
        let value = parse_bool(setconfig_value(&row.setconfig, name)?)?;
        let source = match (db, r) {
            (0, 0) => "ALTER ROLE ALL SET".to_string(),
            (0, r) => format!("ALTER ROLE {} SET", names.role(r)),
            (db, 0) => format!("ALTER DATABASE {} SET", names.database(db)),
            (db, r) => format!(
                "ALTER ROLE {} IN DATABASE {} SET",
                names.role(r),
                names.database(db)
            ),
        };
        Some((Some(value), source))
    });
    let (value, source) = found.unwrap_or_else(|| match server {
        ServerValue::Known(on) => (Some(*on), "server setting".to_string()),
        ServerValue::Hidden { source } => (
            None,
            format!("server setting not readable: pgscope's own session has it from `{source}`"),
        ),
    });
    SessionSetting {
        database,
        role,
        value,
        source,
    }
}

/// Boolean setting `name` as each of `sessions` ((database OID, role OID)) starts with it;
/// empty where the setting does not exist (its library is not loaded). One query each for the
/// server value, the catalog rows and the names: pg_db_role_setting, pg_roles and pg_database
/// are shared catalogs, so any database's connection sees them all.
pub async fn resolve_sessions(
    client: &Client,
    name: &str,
    sessions: &BTreeSet<(u32, u32)>,
) -> Result<Vec<SessionSetting>> {
    if sessions.is_empty() {
        return Ok(Vec::new());
    }
    let Some(server) = server_value(client, name).await? else {
        return Ok(Vec::new());
    };
    let databases: Vec<u32> = sessions.iter().map(|s| s.0).collect();
    let roles: Vec<u32> = sessions.iter().map(|s| s.1).collect();
    let rows = client
        .query(
            "SELECT setdatabase, setrole, setconfig FROM pg_db_role_setting \
             WHERE (setdatabase = 0 OR setdatabase = ANY($1)) AND (setrole = 0 OR setrole = ANY($2))",
            &[&databases, &roles],
        )
        .await
        .context("reading pg_db_role_setting")?
        .iter()
        .map(|row| {
            Ok(CatalogRow {
                database: row.try_get(0)?,
                role: row.try_get(1)?,
                setconfig: row.try_get::<_, Option<Vec<String>>>(2)?.unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>, tokio_postgres::Error>>()
        .context("pg_db_role_setting")?;
    let names = Names {
        databases: oid_names(
            client,
            "SELECT oid, datname::text FROM pg_database WHERE oid = ANY($1)",
            &databases,
        )
        .await
        .context("reading pg_database")?,
        roles: oid_names(
            client,
            "SELECT oid, rolname::text FROM pg_roles WHERE oid = ANY($1)",
            &roles,
        )
        .await
        .context("reading pg_roles")?,
    };
    Ok(sessions
        .iter()
        .map(|&(database, role)| resolve(name, database, role, &rows, &server, &names))
        .collect())
}

async fn oid_names(
    client: &Client,
    sql: &str,
    oids: &[u32],
) -> Result<HashMap<u32, String>, tokio_postgres::Error> {
    client
        .query(sql, &[&oids])
        .await?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect()
}

/// The server-wide value of `name`; None where no such setting exists.
async fn server_value(client: &Client, name: &str) -> Result<Option<ServerValue>> {
    let Some(row) = client
        .query_opt(
            "SELECT setting, source FROM pg_settings WHERE name = $1",
            &[&name],
        )
        .await
        .context("reading pg_settings")?
    else {
        return Ok(None);
    };
    let setting: String = row.try_get(0).context("pg_settings.setting")?;
    let source: String = row.try_get(1).context("pg_settings.source")?;
    if SERVER_SOURCES.contains(&source.as_str()) {
        return Ok(parse_bool(&setting).map(ServerValue::Known));
    }
    // The configuration files' applied value, where this role may read them: what a session
    // without per-database or per-role settings starts with, unless the command line set it.
    let file = client
        .query_opt(
            "SELECT setting FROM pg_file_settings WHERE name = $1 AND applied ORDER BY seqno DESC LIMIT 1",
            &[&name],
        )
        .await;
    let from_file = match file {
        Ok(row) => row.and_then(|row| row.try_get::<_, String>(0).ok()),
        Err(error) => {
            tracing::debug!("pg_file_settings not readable: {error}");
            None
        }
    };
    Ok(Some(match from_file.as_deref().and_then(parse_bool) {
        Some(on) => ServerValue::Known(on),
        None => ServerValue::Hidden { source },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NAME: &str = "pg_stat_statements.track_planning";

    fn row(database: u32, role: u32, entries: &[&str]) -> CatalogRow {
        CatalogRow {
            database,
            role,
            setconfig: entries.iter().map(|e| e.to_string()).collect(),
        }
    }

    fn names() -> Names {
        Names {
            databases: HashMap::from([(5, "postgres".to_string()), (16384, "app".to_string())]),
            roles: HashMap::from([(10, "postgres".to_string()), (16385, "app".to_string())]),
        }
    }

    #[test]
    fn values_parse_as_postgres_reads_booleans() {
        for on in ["on", "ON", "true", "t", "yes", "Y", "1", " on ", "'on'"] {
            assert_eq!(parse_bool(on), Some(true), "{on}");
        }
        for off in ["off", "OF", "false", "f", "no", "N", "0"] {
            assert_eq!(parse_bool(off), Some(false), "{off}");
        }
        for neither in ["", "o", "2", "onn", "maybe", "truex"] {
            assert_eq!(parse_bool(neither), None, "{neither}");
        }
    }

    #[test]
    fn the_last_entry_naming_the_setting_counts_whatever_its_case() {
        let entries: Vec<String> = [
            "work_mem=64MB",
            "PG_STAT_STATEMENTS.Track_Planning=off",
            "search_path=a, b=c",
            "pg_stat_statements.track_planning=on",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(setconfig_value(&entries, NAME), Some("on"));
        assert_eq!(setconfig_value(&entries[..2], NAME), Some("off"));
        assert_eq!(setconfig_value(&entries, "search_path"), Some("a, b=c"));
        assert_eq!(setconfig_value(&entries, "jit"), None);
    }

    #[test]
    fn each_level_wins_over_the_ones_below_it() {
        let server = ServerValue::Known(false);
        let all = [
            row(16384, 16385, &[&format!("{NAME}=on")]),
            row(0, 16385, &[&format!("{NAME}=off")]),
            row(16384, 0, &[&format!("{NAME}=yes")]),
            row(0, 0, &[&format!("{NAME}=0")]),
        ];
        let quoted = |rows: &[CatalogRow], db, role| {
            let s = resolve(NAME, db, role, rows, &server, &names());
            (s.value, s.source)
        };
        assert_eq!(
            quoted(&all, 16384, 16385),
            (Some(true), "ALTER ROLE app IN DATABASE app SET".into())
        );
        assert_eq!(
            quoted(&all[1..], 16384, 16385),
            (Some(false), "ALTER ROLE app SET".into())
        );
        assert_eq!(
            quoted(&all[2..], 16384, 16385),
            (Some(true), "ALTER DATABASE app SET".into())
        );
        assert_eq!(
            quoted(&all[3..], 16384, 16385),
            (Some(false), "ALTER ROLE ALL SET".into())
        );
        assert_eq!(quoted(&[], 16384, 16385), (Some(false), "server setting".into()));
        // Another role's and another database's rows do not apply.
        assert_eq!(quoted(&all[..3], 5, 10), (Some(false), "server setting".into()));
        // A row that sets other things only, or an unreadable value, falls through.
        let other = [row(0, 16385, &["work_mem=1MB", &format!("{NAME}=perhaps")])];
        assert_eq!(
            quoted(&other, 16384, 16385),
            (Some(false), "server setting".into())
        );
        // An OID without a name is quoted as one.
        assert_eq!(quoted(&all[1..2], 1, 77).1, "server setting");
        let unnamed = [row(0, 77, &[&format!("{NAME}=on")])];
        assert_eq!(quoted(&unnamed, 1, 77).1, "ALTER ROLE (OID 77) SET");
    }

    #[test]
    fn a_hidden_server_value_is_unknown_and_says_why() {
        let hidden = ServerValue::Hidden {
            source: "user".into(),
        };
        let s = resolve(NAME, 16384, 16385, &[], &hidden, &names());
        assert_eq!(s.value, None);
        assert!(s.source.contains("`user`"), "{}", s.source);
        let set = [row(0, 16385, &[&format!("{NAME}=on")])];
        assert_eq!(
            resolve(NAME, 16384, 16385, &set, &hidden, &names()).value,
            Some(true)
        );
    }

    proptest! {
        #[test]
        fn arbitrary_setconfig_entries_never_panic(
            entries in proptest::collection::vec(".*", 0..8),
            name in ".*",
        ) {
            if let Some(value) = setconfig_value(&entries, &name) {
                let _ = parse_bool(value);
            }
            let rows = [CatalogRow { database: 0, role: 1, setconfig: entries }];
            let _ = resolve(&name, 2, 1, &rows, &ServerValue::Known(true), &Names::default());
        }
    }
}
