//! The command line: flags named as etcd's gRPC proxy and etcdctl name them, each also an
//! environment variable (`ETCD_CACHE_SERVER_*`) and a key of the YAML config file.

use std::ffi::OsString;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};
use etcd_informer::serve::CacheServerOptions;
use serde::Serialize;

const PRECEDENCE: &str = "Each flag can also be set by its environment variable (shown with \
it) or by a key of the same name in the YAML file given by --config-file. A flag on the command \
line wins over its environment variable, which wins over the file, which wins over the default. \
etcdctl's ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY and ETCDCTL_USER are read for the upstream \
when --cacert, --cert, --key and --user are not set.";

/// Serves etcd's gRPC API for key prefixes from a cache: etcdctl, etcd clients and informers
/// read and watch through it as through etcd, and etcd serves one list and one watch per
/// prefix.
#[derive(Debug, Clone, Parser, Serialize)]
#[command(name = "etcd-cache-server", version = crate::VERSION, after_help = PRECEDENCE)]
#[command(args_override_self = true)]
#[serde(rename_all = "kebab-case")]
pub struct Settings {
    /// The etcd cluster's client endpoints, comma-separated (as etcd's gRPC proxy).
    #[arg(
        long,
        env = "ETCD_CACHE_SERVER_ENDPOINTS",
        value_delimiter = ',',
        default_value = "127.0.0.1:2379"
    )]
    pub endpoints: Vec<String>,
    /// The prefixes served from a cache, comma-separated (one cache each; they may not
    /// overlap). Everything else is forwarded to etcd.
    #[arg(long, env = "ETCD_CACHE_SERVER_PREFIX", value_delimiter = ',')]
    pub prefix: Vec<String>,
    /// Where clients connect (gRPC, and etcd's HTTP endpoints answered by etcd).
    #[arg(
        long,
        env = "ETCD_CACHE_SERVER_LISTEN_ADDR",
        default_value = "127.0.0.1:23790"
    )]
    pub listen_addr: SocketAddr,
    /// Where the server's own metrics (/metrics) and health (/health, /readyz, /livez) are
    /// served, over plain HTTP; none if unset.
    #[arg(long, env = "ETCD_CACHE_SERVER_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Serve TLS to clients with this certificate (PEM; with --key-file).
    #[arg(long, env = "ETCD_CACHE_SERVER_CERT_FILE", requires = "key_file")]
    pub cert_file: Option<PathBuf>,
    /// The key of --cert-file (PEM).
    #[arg(long, env = "ETCD_CACHE_SERVER_KEY_FILE", requires = "cert_file")]
    pub key_file: Option<PathBuf>,
    /// Ask clients for a certificate signed by this CA (PEM): mutual TLS.
    #[arg(
        long,
        env = "ETCD_CACHE_SERVER_TRUSTED_CA_FILE",
        requires = "cert_file"
    )]
    pub trusted_ca_file: Option<PathBuf>,
    /// The CA that signs etcd's certificate (PEM): TLS to etcd (etcdctl's --cacert).
    #[arg(long, env = "ETCD_CACHE_SERVER_CACERT")]
    pub cacert: Option<PathBuf>,
    /// The server's client certificate for etcd (PEM; with --key; etcdctl's --cert).
    #[arg(long, env = "ETCD_CACHE_SERVER_CERT", requires = "key")]
    pub cert: Option<PathBuf>,
    /// The key of --cert (PEM).
    #[arg(long, env = "ETCD_CACHE_SERVER_KEY", requires = "cert")]
    pub key: Option<PathBuf>,
    /// The server's own etcd user, name:password (etcdctl's --user): its lists and watches run
    /// as this user. Clients' requests always run as the client's own token.
    #[arg(long, env = "ETCD_CACHE_SERVER_USER", value_parser = parse_user)]
    #[serde(serialize_with = "hide_password")]
    pub user: Option<User>,
    /// Revisions of history kept for `get --rev` and watches that start in the past
    /// (default: CacheServerOptions' 10,000).
    #[arg(long, env = "ETCD_CACHE_SERVER_HISTORY_REVISIONS", default_value_t = CacheServerOptions::default().history_revisions)]
    pub history_revisions: usize,
    /// Bytes of history kept, besides the revision bound (default 64 MiB).
    #[arg(long, env = "ETCD_CACHE_SERVER_HISTORY_BYTES", default_value_t = CacheServerOptions::default().history_bytes)]
    pub history_bytes: usize,
    /// How long a linearizable read waits for the cache to reach etcd's revision before it
    /// fails Unavailable (e.g. 3s, 500ms).
    #[arg(long, env = "ETCD_CACHE_SERVER_READ_TIMEOUT", default_value_t = Dur(CacheServerOptions::default().read_timeout))]
    pub read_timeout: Dur,
    /// How often an idle watch created with progress_notify hears of the revision (etcd's
    /// default: 10 minutes).
    #[arg(long, env = "ETCD_CACHE_SERVER_PROGRESS_INTERVAL", default_value_t = Dur(CacheServerOptions::default().progress_interval))]
    pub progress_interval: Dur,
    /// The largest request a client may send, in bytes (etcd's --max-request-bytes).
    #[arg(long, env = "ETCD_CACHE_SERVER_MAX_REQUEST_BYTES", default_value_t = CacheServerOptions::default().max_request_bytes)]
    pub max_request_bytes: usize,
    /// How long etcd's answer on a client's access to a cached range is used: the bound on a
    /// revoked permission.
    #[arg(long, env = "ETCD_CACHE_SERVER_ACCESS_TTL", default_value_t = Dur(CacheServerOptions::default().access_ttl))]
    pub access_ttl: Dur,
    /// How often the upstream's identity (cluster, member, leader) is read again for headers.
    #[arg(long, env = "ETCD_CACHE_SERVER_IDENTITY_REFRESH", default_value_t = Dur(CacheServerOptions::default().identity_refresh))]
    pub identity_refresh: Dur,
    /// How often each cache is compared with etcd, keys and revisions (0: never).
    #[arg(long, env = "ETCD_CACHE_SERVER_AUDIT_PERIOD", default_value_t = Dur(CacheServerOptions::default().audit_period.unwrap_or_default()))]
    pub audit_period: Dur,
    /// How long a stopping server (SIGTERM) waits for clients to leave.
    #[arg(long, env = "ETCD_CACHE_SERVER_DRAIN_TIMEOUT", default_value_t = Dur(CacheServerOptions::default().drain_timeout))]
    pub drain_timeout: Dur,
    /// The most watches forwarded to etcd at once (outside the prefixes, below the history, or
    /// slow readers): each is an upstream stream; past it a create gets "too many requests".
    #[arg(long, env = "ETCD_CACHE_SERVER_MAX_FORWARDED_WATCHES", default_value_t = CacheServerOptions::default().max_forwarded_watches)]
    pub max_forwarded_watches: usize,
    /// The most watches forwarded to etcd at once for one client connection.
    #[arg(long, env = "ETCD_CACHE_SERVER_MAX_FORWARDED_WATCHES_PER_CONNECTION", default_value_t = CacheServerOptions::default().max_forwarded_watches_per_connection)]
    pub max_forwarded_watches_per_connection: usize,
    /// Forward requests without a token although the server reaches etcd with a client
    /// certificate: every client that reaches the server gets the certificate's permissions.
    #[arg(long, env = "ETCD_CACHE_SERVER_TRUST_CLIENTS_AS_SERVER", num_args = 0..=1, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub trust_clients_as_server: bool,
    /// A YAML file of settings, keyed by the flags' long names (see above for precedence).
    #[arg(long, env = "ETCD_CACHE_SERVER_CONFIG_FILE")]
    #[serde(skip)]
    pub config_file: Option<PathBuf>,
    /// Print the effective settings as YAML (a config file's shape) and exit.
    #[arg(long)]
    #[serde(skip)]
    pub print_config: bool,
}

/// A user and password.
#[derive(Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub password: String,
}

impl fmt::Debug for User {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:***", self.name)
    }
}

fn parse_user(s: &str) -> Result<User, String> {
    match s.split_once(':') {
        Some((name, password)) if !name.is_empty() => Ok(User {
            name: name.to_owned(),
            password: password.to_owned(),
        }),
        _ => Err("expected name:password".to_owned()),
    }
}

fn hide_password<S: serde::Serializer>(user: &Option<User>, s: S) -> Result<S::Ok, S::Error> {
    match user {
        Some(user) => s.serialize_str(&format!("{}:***", user.name)),
        None => s.serialize_none(),
    }
}

/// A duration written as etcd's flags write them: `500ms`, `5s`, `10m`, `1h` (a bare number is
/// seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl FromStr for Dur {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let number: f64 = number
            .parse()
            .map_err(|_| format!("{s:?} is not a duration (e.g. 500ms, 5s, 10m)"))?;
        let seconds = match unit {
            "ms" => number / 1000.0,
            "" | "s" => number,
            "m" => number * 60.0,
            "h" => number * 3600.0,
            _ => return Err(format!("{s:?}: unknown unit {unit:?} (ms, s, m or h)")),
        };
        Duration::try_from_secs_f64(seconds)
            .map(Dur)
            .map_err(|e| format!("{s:?}: {e}"))
    }
}

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms % 1000 == 0 {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

impl Serialize for Dur {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

/// Why the settings could not be read: printed with the exit status 2, before anything starts.
pub enum Refused {
    /// clap's own error (an unknown flag, a bad value; --help and --version too, which exit 0).
    Clap(clap::Error),
    /// The config file, or settings that do not hold together.
    File(String),
}

/// The settings from `args` (the command line, program name first), the environment and the
/// config file.
pub fn settings(args: Vec<OsString>) -> Result<Settings, Refused> {
    let command = Settings::command();
    let first = command
        .clone()
        .try_get_matches_from(&args)
        .map_err(Refused::Clap)?;
    let first = Settings::from_arg_matches(&first).map_err(Refused::Clap)?;
    let Some(path) = first.config_file.clone() else {
        return with_prefixes(first);
    };
    // The file's settings go first, as flags: the command line's own come after and win
    // (`args_override_self`); a key whose environment variable is set is left out, so that the
    // variable wins over the file too.
    let mut merged: Vec<OsString> = args.iter().take(1).cloned().collect();
    for (key, value) in file_settings(&path)? {
        let Some(arg) = command
            .get_arguments()
            .find(|a| a.get_long() == Some(key.as_str()))
        else {
            return Err(Refused::File(format!(
                "{}: unknown setting {key:?} (the keys are the flags' long names, see --help)",
                path.display()
            )));
        };
        if key == "config-file" || key == "print-config" {
            return Err(Refused::File(format!(
                "{}: {key:?} cannot be set in the config file",
                path.display()
            )));
        }
        if arg
            .get_env()
            .is_some_and(|var| std::env::var_os(var).is_some())
        {
            continue;
        }
        merged.push(format!("--{key}={value}").into());
    }
    merged.extend(args.iter().skip(1).cloned());
    let matches = command.try_get_matches_from(merged).map_err(|e| {
        // A value from the file that clap refuses: say which file it came from.
        Refused::File(format!("{} (or the command line): {e}", path.display()))
    })?;
    with_prefixes(Settings::from_arg_matches(&matches).map_err(Refused::Clap)?)
}

/// Refuses settings that serve no prefix (required, but it may come from the file).
fn with_prefixes(settings: Settings) -> Result<Settings, Refused> {
    if settings.prefix.iter().all(|p| p.is_empty()) {
        return Err(Refused::File(
            "no prefix to serve: set --prefix (or ETCD_CACHE_SERVER_PREFIX, or prefix in the config file)".into(),
        ));
    }
    Ok(settings)
}

/// The file's keys and their values, as a flag would take them (a list comma-joined).
fn file_settings(path: &std::path::Path) -> Result<Vec<(String, String)>, Refused> {
    let refuse = |why: String| Refused::File(format!("{}: {why}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| refuse(e.to_string()))?;
    let map: std::collections::BTreeMap<String, serde_yaml::Value> = if text.trim().is_empty() {
        Default::default()
    } else {
        serde_yaml::from_str(&text)
            .map_err(|e| refuse(format!("not a YAML map of settings: {e}")))?
    };
    map.into_iter()
        .map(|(key, value)| {
            let text = match value {
                serde_yaml::Value::Sequence(items) => items
                    .iter()
                    .map(|v| scalar(&key, v))
                    .collect::<Result<Vec<_>, _>>()?
                    .join(","),
                other => scalar(&key, &other)?,
            };
            Ok((key, text))
        })
        .collect::<Result<_, String>>()
        .map_err(refuse)
}

fn scalar(key: &str, value: &serde_yaml::Value) -> Result<String, String> {
    match value {
        serde_yaml::Value::String(s) => Ok(s.clone()),
        serde_yaml::Value::Number(n) => Ok(n.to_string()),
        serde_yaml::Value::Bool(b) => Ok(b.to_string()),
        _ => Err(format!(
            "{key}: expected a string, number, boolean or a list of them"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_etcds_flags_write_them() {
        assert_eq!(
            "500ms".parse::<Dur>().unwrap().0,
            Duration::from_millis(500)
        );
        assert_eq!("5s".parse::<Dur>().unwrap().0, Duration::from_secs(5));
        assert_eq!("2".parse::<Dur>().unwrap().0, Duration::from_secs(2));
        assert_eq!("10m".parse::<Dur>().unwrap().0, Duration::from_secs(600));
        assert!("5 parsecs".parse::<Dur>().is_err());
        assert_eq!(Dur(Duration::from_millis(1500)).to_string(), "1500ms");
        assert_eq!(Dur(Duration::from_secs(10)).to_string(), "10s");
    }

    #[test]
    fn the_command_line_is_consistent() {
        Settings::command().debug_assert();
    }
}
