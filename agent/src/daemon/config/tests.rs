//! The configuration's unit tests: parsing, precedence, validation, and what it shows.

use super::*;

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn an_empty_file_is_the_defaults() {
    let config = AgentConfig::parse("").expect("empty config parses");
    assert_eq!(config, AgentConfig::default());
    assert_eq!(config.collection.frequency, 19);
    assert_eq!(config.collection.upload_interval, Duration::from_secs(15));
}

#[test]
fn a_full_file_parses() {
    let config = AgentConfig::parse(
        r#"
        [pyroscope]
        url = "https://pyroscope.example:4040"
        basic_auth_user = "u"
        basic_auth_password = "p"
        tenant_id = "team-a"
        timeout = "5s"
        [collection]
        frequency = 49
        upload_interval = "10s"
        off_cpu = true
        off_cpu_min_stack = "1ms"
        [labels]
        service_name = "pg/{instance}"
        pid = true
        static = { env = "prod", region = "eu" }
        [[discovery.exclude]]
        port = 5433
        [server]
        metrics_addr = "127.0.0.1:9999"
        log_format = "json"
        "#,
    )
    .expect("full config parses");
    config.validate().expect("full config is valid");
    assert_eq!(config.collection.off_cpu_min_stack, Duration::from_millis(1));
    assert_eq!(
        config.labels.static_labels.get("region").map(String::as_str),
        Some("eu")
    );
    assert_eq!(config.discovery.exclude[0].port, Some(5433));
    assert_eq!(config.server.log_format, LogFormat::Json);
}

#[test]
fn errors_name_the_bad_key() {
    let error = AgentConfig::parse("[collection]\nfrequncy = 10\n").unwrap_err();
    assert!(format!("{error:#}").contains("frequncy"), "{error:#}");
    let error = AgentConfig::parse("[collection]\nupload_interval = \"soon\"\n").unwrap_err();
    assert!(format!("{error:#}").contains("upload_interval"), "{error:#}");
    let mut config = AgentConfig::default();
    config.pyroscope.url = Some("pyroscope:4040".into());
    let error = config.validate().unwrap_err();
    assert!(format!("{error:#}").contains("pyroscope.url"), "{error:#}");
    config.pyroscope.url = Some("http://p:4040".into());
    config.collection.frequency = 0;
    assert!(format!("{:#}", config.validate().unwrap_err()).contains("collection.frequency"));
    config.collection.frequency = 19;
    config.labels.static_labels.insert("bad-name".into(), "x".into());
    assert!(format!("{:#}", config.validate().unwrap_err()).contains("bad-name"));
}

/// Any function of the executable can be probed by name; what is no C name is refused before
/// the agent starts. (`pg_sleep` only: the names are the process's, see bpf::abi's test.)
#[test]
fn probes_name_the_seven_or_any_function() {
    let mut config = AgentConfig::default();
    config.pyroscope.url = Some("http://p:4040".into());
    config.probes.functions = vec!["GetCachedPlan".into(), "pg_sleep".into()];
    config.validate().expect("the seven and any other name");
    config.probes.functions = vec!["pg_sleep(0.1)".into()];
    let error = format!("{:#}", config.validate().unwrap_err());
    assert!(
        error.contains("probes.functions") && error.contains("pg_sleep(0.1)"),
        "{error}"
    );
}

#[test]
fn errors_say_where_without_quoting_the_line() {
    let error = AgentConfig::parse("[pyroscope]\nbasic_auth_pasword = \"hunter2\"\n").unwrap_err();
    let error = format!("{error:#}");
    assert!(
        error.starts_with("line 2, column 1 (key `basic_auth_pasword`): unknown field"),
        "{error}"
    );
    assert!(!error.contains("hunter2"), "{error}");
    let error = AgentConfig::parse("[pyroscope]\nbearer_token = \"hunter2\n").unwrap_err();
    assert!(!format!("{error:#}").contains("hunter2"), "{error:#}");
    let error = AgentConfig::parse("[pyroscope]\nbearer_token = 4711\n").unwrap_err();
    assert!(!format!("{error:#}").contains("4711"), "{error:#}");
}

#[test]
fn secrets_stay_out_of_the_summary_debug_and_errors() {
    let env = |name: &str| match name {
        "PGSCOPE_PYROSCOPE_URL" => Some("https://agent:url-secret@pyro:4040/?token=query-secret".to_string()),
        "PGSCOPE_PYROSCOPE_TOKEN" => Some("env-token-secret".to_string()),
        _ => None,
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("agent.toml");
    std::fs::write(
        &path,
        "[pyroscope]\nbasic_auth_user = \"u\"\nbasic_auth_password = \"file-secret\"\n",
    )
    .expect("write config");
    let mut config = AgentConfig::default();
    config.pyroscope.url = env("PGSCOPE_PYROSCOPE_URL");
    config.pyroscope.bearer_token = Some(Secret::new("token-secret"));
    config.pyroscope.basic_auth_password = Some(Secret::new("file-secret"));
    let mut shown = vec![config.summary(), format!("{config:?}")];
    // Both credentials in the URL and auth settings: refused, the URL shown redacted.
    shown.push(format!("{:#}", config.validate().unwrap_err()));
    shown.push(format!(
        "{:#}",
        AgentConfig::load(Some(&path), &env, &Overrides::default()).unwrap_err()
    ));
    // Malformed URLs (the second found by the config fuzzer) are not quoted at all.
    for url in ["ftp://agent:url-secret@pyro", "https:'//agent:url-secret@pyro"] {
        config.pyroscope.url = Some(url.into());
        shown.push(format!("{:#}", config.validate().unwrap_err()));
    }
    for text in shown {
        for secret in ["url-secret", "query-secret", "token-secret", "file-secret"] {
            assert!(!text.contains(secret), "`{secret}` shown:\n{text}");
        }
    }
    config.pyroscope.url = Some("https://agent:url-secret@pyro:4040".into());
    config.pyroscope.bearer_token = None;
    config.pyroscope.basic_auth_password = None;
    config.validate().expect("credentials in the URL alone are fine");
    assert!(
        config.summary().contains("https://***@pyro:4040"),
        "{}",
        config.summary()
    );
}

#[test]
fn metrics_are_served_on_loopback_unless_told_otherwise() {
    assert_eq!(
        AgentConfig::default().server.metrics_addr,
        SocketAddr::from(([127, 0, 0, 1], 9437))
    );
    let config = |value: &str| {
        let value = value.to_string();
        let env = move |name: &str| match name {
            "PGSCOPE_PYROSCOPE_URL" => Some("http://p:4040".to_string()),
            "PGSCOPE_METRICS_ADDR" => Some(value.clone()),
            _ => None,
        };
        AgentConfig::load(None, &env, &Overrides::default()).map(|c| c.server.metrics_addr)
    };
    // A bare IP (the pod's, from the downward API) keeps the configured port.
    assert_eq!(
        config("10.1.2.3").expect("IP"),
        "10.1.2.3:9437".parse().expect("addr")
    );
    assert_eq!(
        config("fd00::7").expect("IPv6"),
        "[fd00::7]:9437".parse().expect("addr")
    );
    assert_eq!(
        config("10.1.2.3:9500").expect("IP:port"),
        "10.1.2.3:9500".parse().expect("addr")
    );
    let error = format!("{:#}", config("pod-ip").unwrap_err());
    assert!(error.contains("PGSCOPE_METRICS_ADDR"), "{error}");
    // The flag wins over the environment.
    let env = |name: &str| match name {
        "PGSCOPE_PYROSCOPE_URL" => Some("http://p:4040".to_string()),
        "PGSCOPE_METRICS_ADDR" => Some("10.1.2.3".to_string()),
        _ => None,
    };
    let flags = Overrides {
        metrics_addr: Some("127.0.0.1:1".parse().expect("addr")),
        ..Overrides::default()
    };
    let loaded = AgentConfig::load(None, &env, &flags).expect("loads");
    assert_eq!(loaded.server.metrics_addr, "127.0.0.1:1".parse().expect("addr"));
}

#[test]
fn a_config_that_is_not_a_regular_file_is_refused() {
    let error = AgentConfig::load(Some(Path::new("/dev/zero")), &no_env, &Overrides::default()).unwrap_err();
    assert!(
        format!("{error:#}").contains("is a character device"),
        "{error:#}"
    );
}

#[test]
fn flags_override_the_environment_which_overrides_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("agent.toml");
    std::fs::write(
        &path,
        "[pyroscope]\nurl = \"http://file:4040\"\n[collection]\nfrequency = 7\n",
    )
    .expect("write config");
    let env = |name: &str| match name {
        "PGSCOPE_PYROSCOPE_URL" => Some("http://env:4040".to_string()),
        "PGSCOPE_FREQUENCY" => Some("11".to_string()),
        _ => None,
    };
    let config = AgentConfig::load(Some(&path), &env, &Overrides::default()).expect("loads");
    assert_eq!(config.pyroscope.url.as_deref(), Some("http://env:4040"));
    assert_eq!(config.collection.frequency, 11);
    let flags = Overrides {
        pyroscope_url: Some("http://flag:4040".into()),
        frequency: Some(29),
        ..Overrides::default()
    };
    let config = AgentConfig::load(Some(&path), &env, &flags).expect("loads");
    assert_eq!(config.pyroscope.url.as_deref(), Some("http://flag:4040"));
    assert_eq!(config.collection.frequency, 29);
    let missing = AgentConfig::load(None, &no_env, &Overrides::default()).unwrap_err();
    assert!(format!("{missing:#}").contains("pyroscope.url"));
}
